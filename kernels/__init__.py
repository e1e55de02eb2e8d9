"""k3rl kernels: Triton kernels for K3 beside the PyTorch references they must match.

Entry points (one dispatch point per op; Triton for CUDA tensors, PyTorch on CPU,
``K3_KERNELS=reference|triton`` forces one; see ``kernels.dispatch``):

* ``chunk_kda``, ``fused_recurrent_kda``, ``naive_recurrent_kda`` — KDA, see ``kernels.kda``
* ``situ_glu`` — the bounded SiTU-GLU activation, see ``kernels.situ_glu``
* ``moe_experts`` — LatentMoE routed experts, see ``kernels.moe``
"""

from kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kernels.moe import moe_experts
from kernels.situ_glu import situ_glu

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda", "situ_glu", "moe_experts"]
