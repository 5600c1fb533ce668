"""Routed-expert GEMV: each (token, chosen expert) pair times that expert's weight.

Contract (Q = T * top-k rows, E experts, N out, K in)::

    expert_gemv(x [T, K], w [E, N, K], ids [Q], xdiv, out [Q, N], act=False)
    out[q] = x[q // xdiv] @ w[ids[q]].T

fp32 accumulation over K in a fixed order (blocks of 64, one program per (32 outputs,
row)), rounded to out.dtype once.  ``act=True``: x is [T, 2K] = [gate | up] and the
input fed is silu(gate) * up, each rounded to the dtype like the model's MLP.  Row q
reads only x[q // xdiv] and ids[q]: row invariant.

The fast path's MoE is ``moe_grouped`` (``grouped.py``): router top-k on the device, the
(row, slot) pairs grouped by expert, one grouped gemm per projection that reads each
routed expert's weights (bf16 or block-FP8) once for every row routed to it, a combine in
slot order; row invariant (contract in grouped.py)::

    moe_grouped(x [T, H], logits [T, E (+1)], gate_up [E, 2I, H], down [E, H, I], buf: MoeBuffers,
                out [T, H], top_k=..., renorm=..., shared_experts=None | shared=None, shared_gate=None,
                stats=None, defer=False)

``defer=True`` returns the expert outputs before the combine (``MoePartials``, for
``rmsnorm(delta=...)`` to combine).

Files: ``kernel.py`` (the per-pair gemv + launcher), ``grouped.py`` (the grouped path),
``reference.py`` (torch).
"""
from hyspec.kernels.moe.grouped import MoeBuffers, can_fuse_shared, moe_grouped, moe_tiles
from hyspec.kernels.moe.kernel import expert_gemv
from hyspec.kernels.moe.reference import expert_gemv_ref, moe_grouped_ref

__all__ = ["expert_gemv", "expert_gemv_ref", "moe_grouped", "moe_grouped_ref", "MoeBuffers", "moe_tiles",
           "can_fuse_shared"]
