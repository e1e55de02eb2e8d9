"""``trainer.device``: how it resolves, the Ray resources each actor asks for, and the bf16 policy paths
(exercised on the CPU here, the same code that runs on CUDA; the CUDA run itself needs a GPU)."""

from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from agentenv.errors import ConfigError
from kernels.dispatch import use_triton
from rl.device import DeviceUnavailable, Placement, learner_options, resolve_device, worker_options
from rl.episode import Episode
from rl.generation import TorchEngine
from rl.learner import Learner
from rl.policy import build_policy_shell
from rl.tokenizer import build_tokenizer
from rl.trainer import with_resolved_device

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
