"""The sharded learner (trainer.learner.world_size=2) in two real gloo processes against the single-rank
learner on the same batch: losses, gradients, updated weights and router biases equal within 1e-5 (fp32),
with data parallelism alone and with the routed experts split across the ranks (expert_parallel=2),
whose latent all_to_all sends half the bytes of a backbone-width dispatch (k3_tiny: l = d / 2). The
logged routing mismatch and expert traffic are the whole batch's (summed over the ranks), and every
tensor handed to a torch.distributed collective is on the device its backend takes.

One spawn of two processes runs every scenario (one process group, a new learner per scenario); rank 0
writes what it saw to a file that the tests compare with a `Learner` built here."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_testutil import compose

from rl.data_parallel import VALUE_HEAD
from rl.episode import Episode, collate
from rl.learner import Learner
from rl.ranks import RankGroup, collective_device, free_port, join_rank_group, leave_rank_group
from rl.routing import own_routing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-5
BASE = ("algo.group_size=4", "trainer.learner_threads=1")
SCENARIOS = {  # name -> (overrides, expert_parallel)
    # the exactness check: ONE optimizer step (1 epoch x 1 minibatch)
    "one_step_dp": ((*BASE, "algo.episodes_per_step=8", "algo.epochs=1", "algo.minibatches=1"), 1),
    "one_step_dp_ep": ((*BASE, "algo.episodes_per_step=8", "algo.epochs=1", "algo.minibatches=1"), 2),
    # PPO: the value head (sharded with the backbone), GAE on gathered values, 2 epochs x 2 minibatches
    # (4 optimizer steps, each on its own rows), KL to a reference, per-sequence loss means
    "ppo_4_steps_dp_ep": (
        (
            "algo=ppo",
            "algo.group_size=2",
            "algo.episodes_per_step=8",
            "trainer.learner_threads=1",
            "algo.kl_coef=0.1",
            "algo.loss_aggregation=seq_mean_token_mean",
        ),
        2,
    ),
}


def episodes(n: int, seed: int = 0) -> list[Episode]:
    """Groups of 4 guessing games with random rewards and lengths (varying tokens per rank)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        e = Episode("agentenv/GuessNumber-v0", seed=i // 4, group=i // 4)
        e.append([257, 259, *b"guess 0-7", 261, 260], trained=False)
        for _turn in range(1 + rng.randrange(3)):
            e.append([48 + rng.randrange(8), 261], trained=True, logprobs=[-2.0, -1.0])
            e.step_rewards.append((len(e.tokens) - 1, float(rng.random() < 0.5)))
            e.append([259, *b"higher", 261, 260], trained=False)
        out.append(e)
    return out


ROUTED = "one_step_dp_ep"  # the scenario whose episodes carry the rollout's routing records


def with_routes(cfg, batch: list[Episode]) -> list[Episode]:
    """``batch`` with routing records: the single-rank learner's own routing of every action token, except
    in the last quarter of the episodes (rank 1's rows at world size 2), where every second token's record
    of the first MoE layer names other experts. So the batch's mismatch is not rank 0's half's (zero)."""
    learner = Learner(cfg)
    padded = collate(batch, learner.pad_id)
    with torch.no_grad():
        own = own_routing(learner._forward(padded)[3], padded.attention_mask)  # [B, T, layers, top_k]
    for row, e in enumerate(batch):
        actions = torch.nonzero(torch.tensor(e.action_mask)).flatten()
        routes = own[row, actions - 1].clone()  # the position before a token sampled it
        if row >= len(batch) * 3 // 4:
            routes[::2, 0] = (routes[::2, 0] + 1) % cfg.model.num_experts
        e.routes = routes.to(torch.int16)
    return batch


def config(overrides: tuple[str, ...], world_size: int, expert_parallel: int):
    """The run config of a scenario at this size (local Ray's CPU count raised to fit the ranks)."""
    return compose("trainer.num_cpus=4", *overrides, f"trainer.learner.world_size={world_size}",
                   f"trainer.learner.expert_parallel={expert_parallel}")  # fmt: skip


def full_grads(learner: Learner) -> dict[str, torch.Tensor]:
    """The gradient of the last optimizer step, per parameter name (clipped), gathered from the ranks."""
    parallel = learner.parallel
    if parallel is None:
        named = list(learner.model.named_parameters())
        if learner.value_head is not None:
            named += [(VALUE_HEAD + n, p) for n, p in learner.value_head.named_parameters()]
        return {n: p.grad.clone() for n, p in named if p.grad is not None}
    every = parallel.group.all_gather_equal(parallel.flat.shard.grad)
    flat = every.reshape(-1)[: parallel.flat.total].split(parallel.flat.numels)
    grads = {n: g.view(s) for n, g, s in zip(parallel.flat_names, flat, parallel.flat.shapes, strict=True)}
    if parallel.experts:
        local = torch.cat([p.grad.reshape(-1) for p in parallel.experts])
        gathered = parallel.group.all_gather_equal(local)
        numels = [p.numel() for p in parallel.experts]
        from model.expert_parallel import local_expert_name

        for r in range(parallel.group.world_size):
            for name, g, p in zip(
                parallel.expert_names, gathered[r].split(numels), parallel.experts, strict=True
            ):
                grads[local_expert_name(name, r * parallel.dispatchers[0].per_rank)] = g.view(p.shape)
    return grads


def outcome(learner: Learner, batch: list[Episode]) -> dict:
    """What a rank saw: metrics, memory held, the gradients and the full weights after the step."""
    before = learner.parallel.resident_bytes(learner.optimizer) if learner.parallel else None
    metrics = learner.train_step(batch)
    return {
        "metrics": metrics,
        "grads": full_grads(learner),
        "weights": learner.weights()[1],
        "resident_bytes": (before, learner.parallel.resident_bytes(learner.optimizer))
        if learner.parallel
        else None,
    }


RESUMED = "one_step_dp_ep"  # the scenario whose learner is checkpointed after its step


def checkpoint_of(out: str) -> Path:
    return Path(out).parent / "checkpoint"


def stopped_and_resumed(learner: Learner, cfg, group: RankGroup, out: str) -> dict:
    """Save after the first step, take a second step (the straight run), then a new learner loads the
    checkpoint and takes the same second step (the resumed run): their weights, bit for bit."""
    learner.save(checkpoint_of(out))
    second = episodes(cfg.algo.episodes_per_step, seed=1)
    learner.train_step(second)
    straight = learner.weights()[1]
    resumed = Learner(cfg, group=group)
    resumed.load(checkpoint_of(out))
    resumed.train_step(second)
    return {"straight": straight, "resumed": resumed.weights()[1]}


COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")


def record_collectives(seen: list[tuple[str, str]]) -> None:
    """Wrap this process's torch.distributed collectives (the learner's, `model.expert_parallel`'s and
    `rl.sharding`'s calls go through them) to record (name, device type) of every tensor handed over."""
    for name in COLLECTIVES:
        def wrapper(*args, _real=getattr(dist, name), _name=name, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
            seen.extend((_name, t.device.type) for t in tensors)
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)


def _rank_main(rank: int, port: int, out: str, configs: dict, batches: dict) -> None:
    torch.set_num_threads(1)
    join_rank_group("127.0.0.1", port, rank, 2, 1, torch.device("cpu"))
    seen: list[tuple[str, str]] = []
    record_collectives(seen)
    try:
        results = {}
        for name, (_overrides, expert_parallel) in SCENARIOS.items():
            cfg = configs[name]
            learner = Learner(cfg, group=RankGroup(rank, 2, expert_parallel))
            results[name] = outcome(learner, batches[name])
            if name == RESUMED:
                results["resume"] = stopped_and_resumed(
                    learner, cfg, RankGroup(rank, 2, expert_parallel), out
                )
        results["collectives"] = (seen, dist.get_backend())
        if rank == 0:
            torch.save(results, out)
    finally:
        leave_rank_group()


@pytest.fixture(scope="module")
def batches() -> dict[str, list[Episode]]:
    """Each scenario's batch (the same at world size 1 and 2)."""
    out = {}
    for name, (overrides, _ep) in SCENARIOS.items():
        cfg = config(overrides, 1, 1)
        batch = episodes(cfg.algo.episodes_per_step)
        out[name] = with_routes(cfg, batch) if name == ROUTED else batch
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, batches) -> dict:
    out = Path(tmp_path_factory.mktemp("ranks")) / "rank0.pt"
    configs = {name: config(overrides, 2, ep) for name, (overrides, ep) in SCENARIOS.items()}
    mp.spawn(_rank_main, args=(free_port(), str(out), configs, batches), nprocs=2, join=True)
    return torch.load(out, weights_only=False) | {"folder": checkpoint_of(str(out))}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_step_like_one(two_ranks, batches, name):
    overrides, expert_parallel = SCENARIOS[name]
    cfg = config(overrides, 1, 1)
    single = outcome(Learner(cfg), batches[name])
    sharded = two_ranks[name]
    for key in ("loss", "policy_loss", "entropy", "kl", "grad_norm", "clip_fraction", "approx_kl", "maxvio"):
        assert sharded["metrics"][key] == pytest.approx(single["metrics"][key], abs=TOLERANCE), key
    if "value_loss" in single["metrics"]:
        assert sharded["metrics"]["value_loss"] == pytest.approx(
            single["metrics"]["value_loss"], abs=TOLERANCE
        )
    # a parameter no loss reaches (layer 0's attention-residual mixer) has no gradient on one rank and a
    # zero slice of the flat gradient on two
    unused = sharded["grads"].keys() - single["grads"].keys()
    assert all(not sharded["grads"][k].any() for k in unused)
    assert max_diff({k: sharded["grads"][k] for k in single["grads"]}, single["grads"]) < TOLERANCE
    # router biases included. After several AdamW steps the rounding of the ranks' sums (not the maths) shows:
    # AdamW divides by sqrt(v), so an expert weight whose gradient is near 0 moves by up to lr x its
    # relative rounding error per step (4 steps of the PPO scenario: 6e-5; one step: within 1e-5)
    steps = int(single["metrics"]["optimizer_steps"])
    assert max_diff(sharded["weights"], single["weights"]) < (TOLERANCE if steps == 1 else 1e-4)
    biases = [k for k in single["weights"] if k.endswith("e_score_correction_bias")]
    assert biases and all(single["weights"][k].abs().sum() > 0 for k in biases)  # balancing did move them
    # between steps a rank holds half the parameters and AdamW state (plus the replicated router biases)
    params = sum(p.numel() * 4 for p in single["weights"].values())
    resident = sharded["resident_bytes"][1]
    assert 0.49 * 3 * params < resident < 0.55 * 3 * params
    if expert_parallel > 1:  # experts reached in the latent width: half the backbone bytes (k3_tiny: 64/128)
        sent = sharded["metrics"]["ep_latent_bytes"]
        assert sent > 0 and sent / sharded["metrics"]["ep_backbone_bytes"] == pytest.approx(0.5)


def test_two_ranks_log_the_whole_batch_routing_mismatch_and_expert_traffic(two_ranks, batches):
    """Counted on each rank's rows, summed over the ranks, then divided: the world-size-1 figures."""
    cfg = config(SCENARIOS[ROUTED][0], 1, 1)
    single = Learner(cfg).train_step(batches[ROUTED])
    sharded = two_ranks[ROUTED]["metrics"]
    routing = sorted(k for k in single if k.startswith("routing_"))
    assert {"routing_mismatch", "routing_mismatch_any", "routing_recorded_tokens"} <= set(routing)
    assert single["routing_mismatch/layer1"] > 0  # rank 1's rows only: rank 0's half alone shows 0
    assert {k: sharded[k] for k in routing} == pytest.approx({k: single[k] for k in routing}, abs=1e-12)
    # expert traffic: every (token, expert) pair of the batch (padding included), all MoE layers
    model = cfg.model
    moe_layers = model.num_hidden_layers - model.first_k_dense_replace
    tokens = collate(batches[ROUTED], 0).input_ids.numel()
    assert sharded["ep_pairs"] == tokens * model.num_experts_per_token * moe_layers
    # activations: each pair sent off-rank crosses 4 times (dispatch, combine, their gradients), l fp32s;
    # metadata: per MoE layer each rank's count for the other (int64), then one int64 id per off-rank pair
    off_rank = sharded["ep_latent_bytes"] / (4 * model.expert_width * 4)
    assert off_rank > 0 and off_rank == int(off_rank)
    assert sharded["ep_metadata_bytes"] == moe_layers * 2 * 8 + off_rank * 8
    assert sharded["ep_sent_bytes"] == sharded["ep_latent_bytes"] + sharded["ep_metadata_bytes"]


def test_every_collective_takes_tensors_on_its_backends_device(two_ranks):
    seen, backend = two_ranks["collectives"]
    assert backend == "gloo" and {name for name, _device in seen} == set(COLLECTIVES)
    assert {device for _name, device in seen} == {collective_device(backend).type}


def test_a_two_rank_checkpoint_resumes_bit_exactly_and_loads_at_one_rank(two_ranks):
    from model import K3ForCausalLM

    resume = two_ranks["resume"]
    assert all(torch.equal(resume["straight"][k], resume["resumed"][k]) for k in resume["straight"])
    folder = two_ranks["folder"]
    overrides, _ep = SCENARIOS[RESUMED]
    cfg = config(overrides, 1, 1)
    single = Learner(cfg)
    single.load(folder)  # the full policy, the ranks' AdamW slices merged per parameter
    saved = two_ranks[RESUMED]["weights"]
    assert all(torch.equal(single.weights()[1][k], saved[k]) for k in saved)
    exported = K3ForCausalLM.from_pretrained(folder / "policy").state_dict()  # save_pretrained's format
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    single.train_step(episodes(cfg.algo.episodes_per_step, seed=1))  # continues like the two ranks did
    assert max_diff(single.weights()[1], resume["straight"]) < TOLERANCE
