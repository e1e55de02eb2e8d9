"""``trainer.device``: how it resolves, the Ray resources each actor asks for, whether the GPU shares can
be placed (hand-counted cases, and the config check that uses them with a stated GPU count), and the bf16
policy paths (exercised on the CPU here, the same code that runs on CUDA; the CUDA run needs a GPU)."""

from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from agentenv.errors import ConfigError
from kernels.dispatch import use_triton
from rl.device import (
    DeviceUnavailable,
    GpuDemand,
    Placement,
    check_device,
    learner_options,
    resolve_device,
    worker_options,
)
from rl.driver.trainer import with_resolved_device
from rl.episode import Episode
from rl.learner.learner import Learner
from rl.policy import build_policy_shell
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import build_tokenizer

CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def on(cfg, device: str):
    return replace(cfg, trainer=replace(cfg.trainer, device=device))


def test_auto_follows_what_torch_sees_and_cuda_needs_a_gpu():
    assert [resolve_device("auto", seen) for seen in (True, False)] == ["cuda", "cpu"]
    assert resolve_device("cpu", True) == "cpu" and resolve_device("cuda", True) == "cuda"
    with pytest.raises(DeviceUnavailable, match=r"trainer.device=cuda but torch sees no CUDA GPU on this"):
        resolve_device("cuda", False)
    with pytest.raises(ValueError, match=r"trainer.device: 'tpu' is not one of \['auto', 'cpu', 'cuda'\]"):
        resolve_device("tpu")
    assert with_resolved_device(compose()).trainer.device == ("cuda" if CUDA else "cpu")  # conf: auto


def test_cuda_on_a_host_without_one_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"^trainer.device: 'tpu' is not one of"):
        compose("trainer.device=tpu")
    if CUDA:  # on a GPU host the same setting composes, and the GPU shares must fit the host
        assert compose("trainer.device=cuda").trainer.device == "cuda"
        with pytest.raises(ConfigError, match=r"^trainer.worker_gpus: the learner \(0.5 GPU\) and 64 worker"):
            compose("trainer.device=cuda", "rollout.num_workers=64", "trainer.num_cpus=65")
        return
    with pytest.raises(ConfigError) as caught:
        compose("trainer.device=cuda")
    text = str(caught.value)
    assert text.startswith("trainer.device: trainer.device=cuda but torch sees no CUDA GPU")
    assert "\n" not in text


def test_each_actor_asks_ray_for_a_gpu_share_on_cuda_only():
    cfg = compose()
    cpu, cuda = on(cfg, "cpu"), on(cfg, "cuda")
    assert learner_options(cpu) == {"num_cpus": 1, "resources": {}}  # exactly the options of before
    assert worker_options(cpu) == {"num_cpus": 1, "max_restarts": 3, "resources": {}}
    assert learner_options(cuda) == {"num_cpus": 1, "resources": {}, "num_gpus": 0.5}
    assert worker_options(cuda) == {"num_cpus": 1, "max_restarts": 3, "resources": {}, "num_gpus": 0.5}
    cluster = on(compose("trainer=cluster", "trainer.worker_gpus=0.25"), "cuda")
    assert worker_options(cluster) == {
        "num_cpus": 1, "max_restarts": 3, "resources": {"rollout": 1.0}, "scheduling_strategy": "SPREAD",
        "num_gpus": 0.25,
    }  # fmt: skip
    assert Placement.of("cpu") == Placement(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    ("learner", "ranks", "workers", "worker", "gpus"),
    [
        (0.5, 1, 1, 0.5, 1),  # the default: the learner and one worker share a GPU
        (0.5, 1, 3, 0.5, 2),  # one worker beside the learner, two on a second GPU
        (0.5, 1, 2, 0.75, 3),  # the shares add up to 2.0, but no 0.75 fits beside another share
        (0.3, 1, 7, 0.1, 1),  # 0.3 + 7 x 0.1 fill one GPU exactly (in Ray's 1/10,000 units, not floats)
        (1.0, 2, 2, 0.5, 3),  # two ranks on a GPU each, the workers on a third
        (1.0, 4, 0, 0.5, 4),
    ],
)
def test_the_gpus_a_run_needs_are_a_packing_of_its_shares(learner, ranks, workers, worker, gpus):
    demand = GpuDemand(learner, ranks, workers, worker)
    assert demand.gpus == gpus
    assert demand.problem(gpus) is None and demand.problem(None) is None
    key, message = demand.problem(gpus - 1)
    assert key == "trainer.worker_gpus" and f"need {gpus} GPUs" in message and f"has {gpus - 1}" in message


def test_several_learner_ranks_need_a_whole_gpu_each_on_a_cluster_too():
    for available in (8, None):
        assert GpuDemand(0.5, 2, 1, 0.5).problem(available) == (
            "trainer.learner_gpus",
            "trainer.learner.world_size=2 with trainer.learner_gpus=0.5: NCCL needs one whole GPU per rank; "
            "set trainer.learner_gpus=1",
        )
    assert not GpuDemand(0.5, 1, 1, 0.5).whole_gpu_per_rank
    assert GpuDemand(1, 2, 1, 0.5).problem(None) is None


def test_the_config_check_refuses_what_cannot_be_placed():
    """`check_device` on a (stated) CUDA host: the NCCL rule and the GPU count, each a one-line error."""
    ranks = on(compose("trainer.num_cpus=4", "algo.group_size=4", "algo.episodes_per_step=8",
                       "algo.minibatches=1", "trainer.learner.world_size=2"), "cuda")  # fmt: skip
    with pytest.raises(ConfigError, match=r"^trainer.learner_gpus: trainer.learner.world_size=2 with "
                                          r"trainer.learner_gpus=0.5: NCCL needs one whole GPU per rank"):
        check_device(ranks, cuda_available=True, device_count=4)
    whole = replace(ranks, trainer=replace(ranks.trainer, learner_gpus=1.0))
    with pytest.raises(ConfigError, match=r"^trainer.worker_gpus: the learner \(1 GPU x 2 ranks\) and 1 "
                                          r"worker\(s\) of 0.5 GPU need 3 GPUs .* this host has 2$"):
        check_device(whole, cuda_available=True, device_count=2)
    check_device(whole, cuda_available=True, device_count=3)
    check_device(replace(whole, trainer=replace(whole.trainer, ray_address="10.0.0.1:6379")),
                 cuda_available=True, device_count=0)  # a cluster's GPUs are Ray's to count  # fmt: skip
    with pytest.raises(ConfigError, match=r"^trainer.device: trainer.device=cuda but torch sees no CUDA"):
        check_device(whole, cuda_available=False)


def sample_and_train(cfg, placement: Placement) -> tuple[torch.nn.Module, dict]:
    """A worker policy in ``placement`` samples 4 one-turn episodes; a learner in it trains on them."""
    learner = Learner(cfg, placement)
    tok = build_tokenizer(cfg.tokenizer)
    policy = placement.inference_policy(build_policy_shell(cfg.model))
    policy.load_state_dict(learner.weights()[1])
    engine = TorchEngine(policy, tok, 1.0, cfg.env.action_vocabulary)
    prompt = [tok.bos_id, tok.observation_id, *tok.encode("guess 0-7"), tok.end_id, tok.action_id]
    generations = engine.generate([prompt] * 4, 3, torch.Generator().manual_seed(0))
    episodes = []
    for i, gen in enumerate(generations):
        e = Episode("agentenv/GuessNumber-v0", seed=i // 2, group=i // 2)
        e.append(prompt, trained=False)
        e.append(gen.token_ids, trained=True, logprobs=gen.logprobs, routes=gen.routes)
        e.step_rewards.append((len(e.tokens) - 1, float(i % 2)))
        e.append([tok.end_id], trained=False)
        episodes.append(e)
    return policy, learner.train_step(episodes) | {"learner": learner}


@pytest.fixture(scope="module")
def small():
    return compose("algo.group_size=2", "algo.episodes_per_step=4", "algo.epochs=1", "algo.minibatches=1")


def test_the_bf16_paths_run_on_the_cpu(small):
    """What trainer.device=cuda does to dtypes (a bf16 worker policy, a learner under bf16 autocast with
    fp32 weights), here on the CPU's bf16: sampling, routing records, one optimizer step."""
    policy, metrics = sample_and_train(small, Placement(torch.device("cpu"), torch.bfloat16))
    learner = metrics.pop("learner")
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # master weights
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert 0 < metrics["rollout_logprob_gap"] < 0.5 and metrics["routing_recorded_tokens"] > 0
    assert not use_triton(next(policy.parameters()))  # CPU tensors: the PyTorch kernels


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none on this host)")
def test_on_cuda_the_policy_runs_in_bf16_with_the_triton_kernels(small):
    placement = Placement.of("cuda")
    policy, metrics = sample_and_train(on(small, "cuda"), placement)
    learner = metrics.pop("learner")
    weight = next(policy.parameters())
    assert weight.is_cuda and weight.dtype == torch.bfloat16 and use_triton(weight)
    assert next(learner.model.parameters()).is_cuda and metrics["routing_recorded_tokens"] > 0
    assert metrics["rollout_logprob_gap"] < 0.5
    assert all(state["exp_avg"].is_cuda for state in learner.optimizer.state.values())  # AdamW on the GPU
