"""Routed-expert GEMV: each (token, chosen expert) pair times that expert's weight.

Contract (Q = T * top-k rows, E experts, N out, K in)::

    expert_gemv(x [T, K], w [E, N, K], ids [Q], xdiv, out [Q, N], act=False)
    out[q] = x[q // xdiv] @ w[ids[q]].T

fp32 accumulation over K in a fixed order (blocks of 64, one program per (32 outputs,
row)), rounded to out.dtype once.  ``act=True``: x is [T, 2K] = [gate | up] and the
input fed is silu(gate) * up, each rounded to the dtype like the model's MLP.  Row q
reads only x[q // xdiv] and ids[q]: row invariant.

Files: ``kernel.py`` (Triton kernel + launcher), ``reference.py`` (torch).
"""
from hyspec.kernels.moe.kernel import expert_gemv
from hyspec.kernels.moe.reference import expert_gemv_ref

__all__ = ["expert_gemv", "expert_gemv_ref"]
