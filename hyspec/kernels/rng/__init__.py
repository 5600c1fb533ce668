"""Philox uniforms for a whole vocabulary row per lane, in one Triton kernel.

Contract::

    u01_rows(seeds int64 [B], stream, positions int64 [B], vocab, out=None) -> float64 [B, vocab]
    out[b, i] = u01(seeds[b], stream, positions[b] * 2**32 + i)

Coupled (Gumbel-max) sampling needs these for every token i of a row.  The int64 torch
version (:func:`u01_rows_ref`, built on :func:`hyspec.rng.u01_lanes`) spends ~270
elementwise passes over a [B, V] tensor on it; the kernel does the same integer
arithmetic in registers: 32-bit words as uint32, ``umulhi`` / wrapping ``*`` for the
32x32 -> 64 bit products, the same 53-bit mantissa.  Integer arithmetic and one exact
int -> float64 conversion: the result is bit-identical to the reference (and so to
:func:`hyspec.rng.u01`) on every device.  No host sync; graph capturable.

Files: ``kernel.py`` (Triton kernel + launcher), ``reference.py`` (torch).
"""
from hyspec.kernels.rng.kernel import u01_rows
from hyspec.kernels.rng.reference import u01_rows_ref

__all__ = ["u01_rows", "u01_rows_ref"]
