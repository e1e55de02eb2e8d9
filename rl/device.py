"""Where the policy runs (``trainer.device``) and what that asks of Ray and of the tensors.

The driver resolves ``auto`` once and hands the actors the result, so every actor agrees and Ray is asked
for GPUs only when they are used; on CUDA the policy runs in bf16 (rollout) or under bf16 autocast over
fp32 master weights (learner); on the CPU nothing changes.

Design: docs/design/training.md#rl-device.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from agentenv.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    """``trainer.device=cuda`` where torch sees no GPU."""


def resolve_device(setting: str, cuda_available: bool | None = None) -> str:
    """``cpu`` or ``cuda`` for a ``trainer.device`` setting; ``cuda_available`` defaults to torch's answer."""
    if setting not in DEVICES:
        raise ValueError(f"trainer.device: {setting!r} is not one of {list(DEVICES)}")
    if setting == "cpu":
        return "cpu"
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if setting == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise DeviceUnavailable(
            "trainer.device=cuda but torch sees no CUDA GPU on this host (torch.cuda.is_available() is "
            f"False; torch {torch.__version__}); use trainer.device=auto or cpu"
        )
    return "cuda"


@dataclass(frozen=True)
class Placement:
    """The device of one actor's policy and the dtype its forward computes in."""

    device: torch.device
    compute_dtype: torch.dtype  # bf16 on CUDA, fp32 on the CPU

    @classmethod
    def of(cls, device: str) -> Placement:
        """The placement for a resolved ``trainer.device`` (``cpu`` or ``cuda``)."""
        resolved = resolve_device(device)
        return cls(torch.device(resolved), torch.bfloat16 if resolved == "cuda" else torch.float32)

    @property
    def is_cpu_fp32(self) -> bool:
        """The default placement, in which nothing is moved, cast or autocast."""
        return self.device.type == "cpu" and self.compute_dtype == torch.float32

    def inference_policy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A rollout worker's policy: moved to the device in the compute dtype (in place)."""
        return model if self.is_cpu_fp32 else model.to(device=self.device, dtype=self.compute_dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The learner's forward context: bf16 autocast on CUDA (fp32 weights stay the master copy)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


RAY_UNITS = 10_000  # Ray counts fractional resources in 1/10,000ths: the shares are compared in those


@dataclass(frozen=True)
class GpuDemand:
    """The GPU shares of a ``trainer.device=cuda`` run: ``world_size`` learner ranks of ``learner_gpus``
    each and ``num_workers`` rollout workers of ``worker_gpus`` each (``trainer.learner_gpus``,
    ``trainer.learner.world_size``, ``rollout.num_workers``, ``trainer.worker_gpus``)."""

    learner_gpus: float
    world_size: int
    num_workers: int
    worker_gpus: float

    @classmethod
    def of(cls, cfg: Any) -> GpuDemand:
        trainer = cfg.trainer
        return cls(trainer.learner_gpus, trainer.learner.world_size, cfg.rollout.num_workers,
                   trainer.worker_gpus)  # fmt: skip

    @property
    def whole_gpu_per_rank(self) -> bool:
        """Whether each learner rank gets a GPU of its own, as NCCL needs with more than one rank."""
        return round(self.learner_gpus * RAY_UNITS) == RAY_UNITS

    @property
    def gpus(self) -> int:
        """The GPUs Ray needs to place every share: a fractional share lives on one GPU, so the count is
        a packing, not the sum. Each rank on a GPU of its own (one rank: its GPU has room for workers
        beside it), the workers in what is left on the ranks' GPUs, then ``1 // worker_gpus`` per GPU."""
        learner, worker = round(self.learner_gpus * RAY_UNITS), round(self.worker_gpus * RAY_UNITS)
        beside = self.world_size * ((RAY_UNITS - learner) // worker)
        rest = max(0, self.num_workers - beside)
        return self.world_size + math.ceil(rest / (RAY_UNITS // worker))

    def problem(self, available: int | None) -> tuple[str, str] | None:
        """(config key, what is wrong) when the shares cannot be placed, else None. ``available``: the
        GPUs of the host (local Ray), None on a cluster (then only the per-rank rule is checked)."""
        if self.world_size > 1 and not self.whole_gpu_per_rank:
            return ("trainer.learner_gpus",
                    f"trainer.learner.world_size={self.world_size} with trainer.learner_gpus="
                    f"{self.learner_gpus:g}: NCCL needs one whole GPU per rank; set trainer.learner_gpus=1")
        if available is not None and self.gpus > available:
            ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
            return ("trainer.worker_gpus",
                    f"the learner ({self.learner_gpus:g} GPU{ranks}) and {self.num_workers} worker(s) of "
                    f"{self.worker_gpus:g} GPU need {self.gpus} GPUs (Ray places each share on one GPU) "
                    f"but this host has {available}")
        return None


def check_device(cfg: Any, cuda_available: bool | None = None, device_count: int | None = None) -> None:
    """``trainer.device=cuda``: torch sees a GPU here, each learner rank of several gets a whole GPU, and
    with local Ray the learner's and the workers' shares fit the host's GPUs (`GpuDemand`); a one-line
    `ConfigError` naming the key. ``cuda_available`` / ``device_count`` default to torch's answers
    (``auto`` resolves in the trainer, which runs this check again with the resolved device)."""
    trainer = cfg.trainer
    if trainer.device != "cuda":
        return
    try:
        resolve_device("cuda", cuda_available)
    except DeviceUnavailable as exc:
        raise ConfigError(f"trainer.device: {exc}") from None
    have = torch.cuda.device_count() if device_count is None else device_count
    problem = GpuDemand.of(cfg).problem(have if trainer.ray_address is None else None)
    if problem is not None:
        key, message = problem
        raise ConfigError(f"{key}: {message}")


def actor_gpu_options(device: str, gpus: float) -> dict[str, Any]:
    """The Ray actor options of a GPU share: ``{"num_gpus": gpus}`` on cuda, nothing on the CPU (so a
    CPU run's actor options stay exactly what they were)."""
    return {"num_gpus": gpus} if device == "cuda" else {}


def learner_options(cfg: Any) -> dict[str, Any]:
    """The Ray actor options of the learner under a resolved ``trainer.device``."""
    trainer = cfg.trainer
    options: dict[str, Any] = {"num_cpus": trainer.learner_cpus, "resources": dict(trainer.learner_resources)}
    return options | actor_gpu_options(trainer.device, trainer.learner_gpus)


def worker_options(cfg: Any) -> dict[str, Any]:
    """The Ray actor options of each rollout worker under a resolved ``trainer.device``."""
    trainer = cfg.trainer
    options: dict[str, Any] = {
        "num_cpus": cfg.rollout.worker_cpus,
        "max_restarts": cfg.rollout.max_worker_restarts,
        "resources": dict(trainer.worker_resources),
    }
    if trainer.worker_placement == "spread":
        options["scheduling_strategy"] = "SPREAD"
    return options | actor_gpu_options(trainer.device, trainer.worker_gpus)


def node_address() -> dict[str, str]:
    """The Ray node this process runs on: its id and IP (the trainer records where each actor is)."""
    import ray  # here: the GPU check imports this module on a machine without Ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}
