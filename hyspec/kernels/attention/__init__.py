"""Attention for decode / verify over a contiguous KV cache: q/k prep + cache write,
split-key decode, grouped-query decode, the fixed-order combine of the splits.

Contract (T rows, Hq/Hkv heads, D head dim, ROT rotary dims, L cache rows, NS splits;
``proj`` is the qkv projection [T, Hq*2D + 2*Hkv*D]: per q head [q D | gate D], then k, v)::

    attn_prep(proj, q_w [D], k_w [D], inv_freq [ROT/2], pos [1], off, q_out [T, Hq, D],
              kc, vc [Hkv, L, D], n_heads, n_kv, head_dim, eps, rows=T)
        zero-centred RMSNorm of q and k per head, neox RoPE on the first ROT dims at
        position pos + off + r (cos/sin rounded like the model's), q to q_out, k and v
        written into the caches at row pos + off + r
    attn_decode(q [T, Hq, D], kc, vc, pos [1], off, proj, out [T, Hq*D], rows=T)
        row r attends keys 0..pos+off+r (fp32 online softmax, scale D**-0.5); keys in
        blocks of 32, block b -> split b % NS (NS = ATTN_SPLITS = 8, a constant; 2 in the
        CPU interpreter, INTERP_SPLITS, see attn_splits; ``splits=`` overrides); the
        splits are combined in a fixed order (``launch_combine``: one [NS, D] tile and a
        reduction tree, or with kernel.COMBINE_TILE off a loop over 0..NS-1) and the
        output is multiplied by sigmoid(gate) with the model's rounding
    attn_decode_grouped(...)    the same contract; one program per (kv head, group of
        GROUPED_ROWS = 4 rows of a lane, split) serves the kv head's REP query heads for
        those rows with ``tl.dot`` tiles (NS = GROUPED_SPLITS = 16; with grouped.CHUNKED,
        an option for long contexts, a row's partials are chunks of its keys sized by its
        own key count); the bf16 fast path's attention (``grouped.py`` explains it, with
        its one condition: finite cache rows)

positions are read from device memory (CUDA-graph friendly); T and off are
``do_not_specialize``: a t-row call and t 1-row calls (off + r) run the same binary and
give the same bits.  ``lanes`` > 1: rows // lanes rows per sequence (lane-major), lane b
at pos[b] in its own cache ``kc + b * kv_lane_stride``.

Files: ``kernel.py`` (prep, split decode, combine: Triton + launchers; ``rope_inv_freq``),
``grouped.py`` (grouped decode), ``reference.py`` (torch, for both decode kernels).
"""
from hyspec.kernels.attention.grouped import GROUPED_SPLITS, attn_decode_grouped
from hyspec.kernels.attention.kernel import (
    ATTN_BLOCK_N,
    ATTN_SPLITS,
    INTERP_SPLITS,
    attn_decode,
    attn_splits,
    attn_prep,
    launch_combine,
    rope_inv_freq,
)
from hyspec.kernels.attention.reference import attn_decode_ref, attn_prep_ref

__all__ = [
    "attn_prep", "attn_prep_ref", "attn_decode", "attn_decode_ref", "attn_decode_grouped", "launch_combine",
    "rope_inv_freq", "attn_splits", "ATTN_SPLITS", "INTERP_SPLITS", "ATTN_BLOCK_N", "GROUPED_SPLITS",
]
