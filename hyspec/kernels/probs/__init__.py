"""Probability rows for sampling: a softmax and an inverse CDF over vocabulary rows,
each row split into CHUNK-token programs (many thread blocks per row, any row count).

Contract (B rows, V vocabulary, C = ceil(V / CHUNK) chunks)::

    softmax_rows(x [B, V] float, temperature [B], keep [B, V] bool = None, only [B] = None,
                 floor [B] = None, top [B] = None, mass=False, only_if [B] bool = None)
                 -> float64 [B, V]
    = softmax over the kept tokens of xt = float64(x) / temperature (0 elsewhere), a token
      kept when xt > -inf, keep is true (if given), xt - xt[top] >= floor (if given: min-p,
      top the row's argmax) -- or, in a row with only >= 0, when it is token `only` (greedy
      rows: exactly one-hot); only_if (with top, without only) is the same as
      only = where(only_if, top, -1). mass=True: int64 fixed-point masses (p * 2**62,
      truncated; hyspec.sampling.fixed_mass) instead of the probabilities.

    inverse_cdf_rows(p float64 [B, V] | [B, R, V], u float64 [B], row [B] = None,
                     q float64 [B, V] | [B, Rq, V] = None, q_row [B] = None, resid [B] bool = None)
                     -> int64 [B]
    = in each row's distribution d (p[b], or p[b, row[b]]; for resid rows with q the
      residual max(d - q[b, q_row[b]], 0) if it has mass: speculative sampling's
      recovered token), the first token whose running mass exceeds u * total (the
      masses added per chunk, then over the chunk totals, then inside the chosen chunk);
      the last token with mass when rounding leaves none; 0 for a row without mass.

Row invariance: a row's programs read only that row, CHUNK is a constant and the chunk
partials of a row are combined in one fixed order (every normalising program of the row
reduces the same C partials alike), so a row's result is bitwise the same whatever the
number of rows. This is what lets the BatchDecoder sample its live rows only (torch's
softmax / sum / cumsum pick their kernel by shape, hence the fixed 16-row blocks of
hyspec.gpu.batch_sampling without these kernels). No host sync; graph capturable.

Rounding: float64 throughout; the kernels add in another order than torch (per chunk,
then over chunks), so they agree with the references to a few ulps (exactly where the
math is exact: masked entries, one-hot rows, dyadic masses).

Files: ``kernel.py`` (Triton kernels + launchers), ``reference.py`` (torch); ``topp.py``:
the top-k / top-p cut (``prefix_select_rows``, integer radix passes; its reference is
hyspec.gpu.sampling.prefix_select; on by default on CUDA, HYSPEC_TOPP_KERNEL=0 turns it off);
``argmax.py``: ``argmax_rows(x) == x.argmax(-1)`` (the greedy choice, exact, in two launches).
"""
from hyspec.kernels.probs.kernel import inverse_cdf_rows, softmax_rows
from hyspec.kernels.probs.reference import CHUNK, inverse_cdf_rows_ref, softmax_rows_ref

__all__ = ["CHUNK", "softmax_rows", "softmax_rows_ref", "inverse_cdf_rows", "inverse_cdf_rows_ref"]
