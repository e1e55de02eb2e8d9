"""The sharded learner (trainer.learner.world_size=2) in two real gloo processes against the single-rank
learner on the same batch: losses, gradients, updated weights and router biases equal within 1e-5 (fp32),
with data parallelism alone and with the routed experts split across the ranks (expert_parallel=2),
whose latent all_to_all sends half the bytes of a backbone-width dispatch (k3_tiny: l = d / 2). The
logged routing mismatch and expert traffic are the whole batch's (summed over the ranks), and every
tensor handed to a torch.distributed collective is on the device its backend takes.

Checkpoints are distributed (torch.distributed.checkpoint): one written at world size 1 loads at 2 (with
the experts split), one written at 2 resumes bit-exactly at 2 and loads at 1 and at 4, where the ranks
form a 2 x 2 (data x expert) mesh; each continues as the learner of one rank does. The full weights
leave a rank one sharded unit at a time (publishing, export), never as a second full copy.

One spawn of two processes runs every scenario (one process group, a new learner per scenario), one of
four processes the 2 -> 4 load; rank 0 writes what it saw to a file that the tests compare with a
`Learner` built here."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_testutil import compose
from torch.distributed.tensor import DTensor

from rl.episode import Episode, collate
from rl.learner.learner import Learner
from rl.learner.ranks import RankGroup, collective_device, free_port, join_rank_group, leave_rank_group
from rl.learner.routing import own_routing
from rl.learner.sharding import VALUE_HEAD

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
    return compose("trainer.num_cpus=5", *overrides, f"trainer.learner.world_size={world_size}",
                   f"trainer.learner.expert_parallel={expert_parallel}")  # fmt: skip


def full_grads(learner: Learner) -> dict[str, torch.Tensor]:
    """The gradient of the last optimizer step, per parameter name (clipped), gathered from the ranks."""
    named = list(learner.model.named_parameters())
    if learner.value_head is not None:
        named += [(VALUE_HEAD + n, p) for n, p in learner.value_head.named_parameters()]
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in named if p.grad is not None}  # fmt: skip


def outcome(learner: Learner, batch: list[Episode]) -> dict:
    """What a rank saw: metrics, memory held, the gradients and the full weights after the step."""
    before = learner.sharded.held_bytes(learner.optimizer)
    metrics = learner.train_step(batch)
    return {
        "metrics": metrics,
        "grads": full_grads(learner),
        "weights": learner.weights()[1],
        "resident_bytes": (before, learner.sharded.held_bytes(learner.optimizer)),
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
    `rl.learner.sharding`'s calls go through them) to record (name, device type) of every tensor handed
    over."""
    for name in COLLECTIVES:
        def wrapper(*args, _real=getattr(dist, name), _name=name, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
            seen.extend((_name, t.device.type) for t in tensors)
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)


def published_units(learner: Learner) -> dict:
    """What each call of `full_units` handed this rank, gathered onto rank 0 and at each ep rank."""
    units: list[dict[str, tuple[int, ...]]] = []
    learner.sharded.full_units(lambda unit: units.append({n: tuple(t.shape) for n, t in unit.items()}))
    own: list[dict[str, tuple[int, ...]]] = []
    learner.sharded.full_units(lambda unit: own.append({n: tuple(t.shape) for n, t in unit.items()}),
                               experts_stay=True)  # fmt: skip
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return {"gathered": units, "experts_stay": every}


def _rank_main(rank: int, port: int, out: str, configs: dict, batches: dict, from_one: str) -> None:
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
                results["units"] = published_units(learner)
                loaded = Learner(cfg, group=RankGroup(rank, 2, expert_parallel))
                loaded.load(from_one)  # written by a learner of one rank, without expert parallelism
                loaded.train_step(episodes(cfg.algo.episodes_per_step, seed=1))
                results["from_one"] = loaded.weights()[1]
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
def one_rank_checkpoint(tmp_path_factory, batches) -> tuple[Path, dict[str, torch.Tensor]]:
    """A world-size-1 learner's checkpoint after the RESUMED scenario's step, and its weights after the
    next step from there."""
    folder = Path(tmp_path_factory.mktemp("one")) / "checkpoint"
    cfg = config(SCENARIOS[RESUMED][0], 1, 1)
    learner = Learner(cfg)
    learner.train_step(batches[RESUMED])
    learner.save(folder)
    learner.train_step(episodes(cfg.algo.episodes_per_step, seed=1))
    return folder, learner.weights()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, batches, one_rank_checkpoint) -> dict:
    out = Path(tmp_path_factory.mktemp("ranks")) / "rank0.pt"
    configs = {name: config(overrides, 2, ep) for name, (overrides, ep) in SCENARIOS.items()}
    from_one = str(one_rank_checkpoint[0])
    spawn_ranks(_rank_main, lambda: (free_port(), str(out), configs, batches, from_one), 2)
    return torch.load(out, weights_only=False) | {"folder": checkpoint_of(str(out))}


FOUR = ("algo.group_size=2", "algo.episodes_per_step=8", "algo.epochs=1", "algo.minibatches=1",
        "trainer.learner_threads=1")  # 4 groups: one per rank  # fmt: skip


def spawn_ranks(main, args, nprocs: int) -> None:
    """``nprocs`` gloo ranks, forked by a fork server that imported this module (and so torch and the
    learner) once: clean processes like ``mp.spawn``'s, without each paying about 2.5 s of imports. Started
    again once if a rank aborts (SIGABRT): a four-rank run under a loaded CI once died in glibc's
    `malloc(): unaligned tcache chunk detected` inside torch's DTensor redistribution, not reproduced in 4
    runs since. An exception in a rank, or a second abort, fails the test."""
    mp.set_forkserver_preload([__name__])
    try:
        mp.start_processes(main, args=args(), nprocs=nprocs, join=True, start_method="forkserver")
    except mp.ProcessExitedException as exc:
        if exc.signal_name != "SIGABRT":
            raise
        mp.start_processes(main, args=args(), nprocs=nprocs, join=True, start_method="forkserver")


def _four_main(rank: int, port: int, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    join_rank_group("127.0.0.1", port, rank, 4, 2, torch.device("cpu"))
    try:
        learner = Learner(config(FOUR, 4, 2), group=RankGroup(rank, 4, 2))  # a (dp 2) x (ep 2) mesh
        learner.load(folder)
        metrics = learner.train_step(episodes(8, seed=2))
        weights = learner.weights()[1]
        units = published_units(learner)
        if rank == 0:
            torch.save({"metrics": metrics, "weights": weights, "units": units}, out)
    finally:
        leave_rank_group()


@pytest.fixture(scope="module")
def four_ranks(two_ranks, tmp_path_factory) -> dict:
    """The two ranks' checkpoint loaded by four, one step taken."""
    out = Path(tmp_path_factory.mktemp("four")) / "rank0.pt"
    spawn_ranks(_four_main, lambda: (free_port(), str(two_ranks["folder"]), str(out)), 4)
    return torch.load(out, weights_only=False)


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


def test_a_one_rank_checkpoint_loads_at_two_ranks_with_the_experts_split(two_ranks, one_rank_checkpoint):
    _folder, continued = one_rank_checkpoint
    assert max_diff(two_ranks["from_one"], continued) < TOLERANCE


def test_a_two_rank_checkpoint_loads_at_four_ranks_on_a_data_by_expert_mesh(two_ranks, four_ranks):
    single = Learner(config(FOUR, 1, 1))
    single.load(two_ranks["folder"])
    metrics = single.train_step(episodes(8, seed=2))
    for key in ("loss", "grad_norm", "entropy", "maxvio"):
        assert four_ranks["metrics"][key] == pytest.approx(metrics[key], abs=TOLERANCE), key
    assert max_diff(four_ranks["weights"], single.weights()[1]) < TOLERANCE
    assert four_ranks["metrics"]["ep_latent_bytes"] > 0  # tokens reached experts on the other ep rank


@pytest.mark.parametrize("world", [2, 4])
def test_the_full_weights_leave_a_rank_one_unit_at_a_time(two_ranks, four_ranks, world):
    """Gathered onto rank 0: every tensor once, in units of at most one decoder layer (or its experts);
    with the experts left where they are, each ep rank (dp index 0) hands out its own experts only."""
    units = (two_ranks if world == 2 else four_ranks)["units"]
    full = two_ranks[RESUMED]["weights"]
    gathered = units["gathered"]
    names = [n for unit in gathered for n in unit]
    assert sorted(names) == sorted(full) and len(names) == len(set(names))
    size = {n: full[n].numel() for n in full}
    largest = max(sum(size[n] for n in unit) for unit in gathered)
    assert largest < 0.3 * sum(size.values())
    stay = units["experts_stay"]
    experts = {n for n in full if ".experts." in n and "shared" not in n}
    handed = [{n for unit in rank for n in unit} for rank in stay]
    assert handed[0] | set().union(*handed[1:]) == set(full) and not handed[0] >= experts
    per_ep = len(experts) // 2
    owners = [len(h & experts) for h in handed]
    assert owners == ([per_ep, per_ep] if world == 2 else [per_ep, per_ep, 0, 0])
