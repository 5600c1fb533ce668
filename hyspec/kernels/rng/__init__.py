"""Philox uniforms for a whole vocabulary row per lane, and Gumbel-max over them, in
Triton kernels.

Contract::

    u01_rows(seeds int64 [B], stream, positions int64 [B], vocab, out=None) -> float64 [B, vocab]
    out[b, i] = u01(seeds[b], stream, positions[b] * 2**32 + i)

    u01_at(seeds int64 [B], stream, counters int [B, ...]) -> float64 [B, ...]
    out[b, ...] = u01(seeds[b], stream, counters[b, ...])

    gumbel_argmax(probs float64 [B, V], seeds, stream, positions) -> int64 [B]
    = the first argmax over {i: probs[b, i] > 0} of log probs[b, i] - log(-log out[b, i])
      (0 for a row without mass)

Coupled (Gumbel-max) sampling needs these for every token i of a row.  The int64 torch
version (:func:`u01_rows_ref`, built on :func:`hyspec.rng.u01_lanes`) spends ~270
elementwise passes over a [B, V] tensor on it; the kernels do the same integer
arithmetic in registers: 32-bit words as uint32, ``umulhi`` / wrapping ``*`` for the
32x32 -> 64 bit products, the same 53-bit mantissa.  Integer arithmetic and one exact
int -> float64 conversion: the uniforms are bit-identical to the reference (and so to
:func:`hyspec.rng.u01`) on every device.  ``gumbel_argmax`` then takes the logarithms
in the kernel (the noise is never stored; the float64 ``log`` of the device's math
library, as torch's) and reduces per 1024-token chunk, the first best chunk winning.
``u01_at`` is the few draws of a round (rejection sampling's accept, residual, bonus
and inverse-CDF uniforms, one per lane or draft) in one launch: their torch form
(:func:`hyspec.rng.u01_lanes`) is ~250 launches of a few elements each, ~0.3 ms per call
inside a CUDA graph.  No host sync; graph capturable.

Files: ``kernel.py`` (Triton kernels + launchers), ``reference.py`` (torch).
"""
from hyspec.kernels.rng.kernel import gumbel_argmax, u01_at, u01_rows
from hyspec.kernels.rng.reference import gumbel_argmax_ref, u01_rows_ref

__all__ = ["u01_rows", "u01_rows_ref", "u01_at", "gumbel_argmax", "gumbel_argmax_ref"]
