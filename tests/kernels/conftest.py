"""Run every Triton kernel of this directory in Triton's interpreter, on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated (at import of the module that defines
it), so the variable is set here, before the test modules import the kernels; kernel modules that
something imported earlier in the session are reloaded so that they are interpreted too.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

TRITON_MODULES = (  # dependencies first: kernels.moe.grouped imports from kernels.situ_glu_triton
    "kernels.situ_glu_triton",
    "kernels.kda.chunk",
    "kernels.kda.fused_recurrent",
    "kernels.moe.grouped",
)
for _name in TRITON_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
