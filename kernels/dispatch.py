"""The one rule that picks an implementation for every op: Triton on CUDA, PyTorch elsewhere.

``K3_KERNELS=reference`` or ``K3_KERNELS=triton`` forces one (Triton on CPU tensors needs
``TRITON_INTERPRET=1``, which runs the kernels in Triton's interpreter: slow, for tests only).
"""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "K3_KERNELS"
BACKENDS = ("reference", "triton")


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the op on ``tensor`` should run its Triton kernel."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced in ("", "auto"):
        return tensor.is_cuda
    if forced not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={forced!r} is not one of {BACKENDS} (or unset for automatic choice)")
    if forced == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{BACKEND_ENV}=triton on {tensor.device.type} tensors needs TRITON_INTERPRET=1, set before "
            "Triton is imported (Triton's interpreter); or use CUDA tensors, or unset K3_KERNELS"
        )
    return forced == "triton"
