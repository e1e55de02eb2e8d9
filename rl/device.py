"""Where the policy runs (``trainer.device``) and what that asks of Ray and of the tensors.

``auto`` resolves to ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` on a host without one is a
config error (`check_device`, run with the config checks). The driver resolves the setting once
(`resolve_device`) and hands the actors the resolved value, so the learner and every rollout worker
agree on it and Ray is asked for GPUs only when they will be used.

On CUDA (`Placement`): rollout workers hold the policy in bf16 on the GPU; the learner keeps its fp32
weights and AdamW state (as on the CPU) on the GPU and runs forward and backward under bf16 autocast.
The model's ops pick their Triton kernels for CUDA tensors by themselves (`kernels.dispatch`). On the CPU
nothing changes: fp32, no autocast, no GPU request.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

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
