"""RMSNorm, fused with the residual add and the embedding gather.

Contract (shape letters: T rows, N hidden, V vocabulary)::

    rmsnorm(x [T, N] | table [V, N] + ids [T], weight [N], eps, out=[T, N],
            delta=[T, N] | SplitPartials | MoePartials, resid_out=[T, N])

* resid = x (or table[ids]) [+ delta, rounded to x.dtype like ``x + h`` in the model];
  written to ``resid_out`` when given (it may alias x);
* out = resid * rsqrt(mean(resid**2) + eps) * (1 + weight) (zero-centred weight), fp32
  inside, rounded to out.dtype once;
* delta may be the fp32 split-K partials of a matmul (:class:`SplitPartials`), summed here
  in the order 0..S-1 as the matmul's own reduce kernel would, or a grouped MoE's slot
  outputs (:class:`MoePartials`), combined in slot order as its combine kernel would;
* one program per row, the reduction over N in one block: row r is bitwise what a 1-row
  call computes.

Files: ``kernel.py`` (Triton kernel + launcher), ``reference.py`` (torch).
"""
from hyspec.kernels.common import MoePartials, SplitPartials
from hyspec.kernels.rmsnorm.kernel import rmsnorm
from hyspec.kernels.rmsnorm.reference import rmsnorm_ref

__all__ = ["rmsnorm", "rmsnorm_ref", "SplitPartials", "MoePartials"]
