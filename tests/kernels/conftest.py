"""Run every Triton kernel of this directory in Triton's interpreter, on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with ``@triton.jit``: for our kernels
when their module is imported, and for Triton's own ``triton.language`` helpers (``tl.zeros``, ...)
when Triton itself is imported. So the variable must be set before anything imports Triton. It is set
here, at collection of this directory (``import torch``, ``kernels`` and ``model`` do not import
Triton; the Triton kernel modules are imported lazily by the dispatch). If Triton was nevertheless
imported earlier without it, the Triton tests fail with a message saying what to do instead of with
an obscure interpreter error.
"""

from __future__ import annotations

import os
import sys

import pytest

TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def triton_interpreter() -> None:
    """Require that Triton runs in interpreter mode (see the module docstring)."""
    if TRITON_IMPORTED_TOO_EARLY:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1, so its "
            "kernels cannot run on CPU; run the suite as `TRITON_INTERPRET=1 pytest ...`"
        )
