"""Top-k / top-p cut as Triton kernels: :func:`hyspec.gpu.sampling.prefix_select` (the
torch reference, same arguments, same result bitwise) in a handful of launches.

Contract (B rows, V tokens, C = ceil(V / CHUNK))::

    prefix_select_rows(key [B, V] int16 | int32, bits 16 | 32, valid [B, V] bool,
                       weight [B, V] int64 >= 0 (0 outside valid), threshold [B, 1] int64)
    -> keep [B, V] bool: the valid tokens whose ahead weight (the weight of the tokens
       ranked before them: decreasing key, ties to the lowest id) is below threshold.
    key may instead be the float values (bf16 / fp16 / fp32, no NaN; bits 16 / 32):
    the kernels form order_key's key from their bits, and valid may then be None (the
    tokens that are not -inf).

The search is the reference's: radix passes of DIGIT bits over the key find the cut key
K* (tokens above it kept, below it dropped), then a token-order exclusive scan of the
weights at K* settles the ties. Per pass two launches: (1) per (row, chunk), the weights
of the chunk's tokens that share K*'s digits found so far are added into the row's int64
bins by digit and into the row's totals per block of SCAN_BLOCK bins (atomic integer adds:
exact in any order); (2) one program per row finds from the block totals the first block
from the top digit down that reaches the threshold, scans that block alone, and so finds
K*'s digit and the weight ranked ahead of it. Then (3) per
(row, chunk) the weight of the chunk's ties, and (4) per (row, chunk) the chunks' totals
before it plus an in-chunk scan give the keep mask. Launches: one
memset of the bins, 2 per pass, 2 for the ties: 5 for 16-bit keys (bf16 / fp16 logits),
7 for 32-bit ones (fp32).

Row invariance: a program reads and writes its own row only; CHUNK and DIGIT are
constants, and everything is integer arithmetic (exact whatever the order), so a row's
result is bitwise the same for any row count. No host sync, static shapes: graph
capturable.

Status: tested in the Triton interpreter (tests/test_kernels_topp.py) and on an H200
(the same tests plus tests/test_gpu_sampling.py with the kernels on: 66 passed at
6d51b62, bench/results/topp_tests_h200.txt). hyspec.gpu.sampling uses it on CUDA by
default (HYSPEC_TOPP_KERNEL=0 turns it off), in the interpreter only with
HYSPEC_TOPP_KERNEL=1 (docs/gpu.md).
"""
from __future__ import annotations

import torch

from hyspec.envknobs import switch
from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode
from hyspec.kernels.probs.reference import CHUNK

__all__ = ["DIGIT", "prefix_select_rows", "topp_kernel_enabled"]

DIGIT = 16  # key bits per radix pass (65,536 int64 bins per row and pass)
SCAN_BLOCK = 4096  # bins per block of the one-program-per-row cut search
# launch settings of the histogram and cut kernels: the bins are integer sums (exact in any
# order), so these change the speed, never a result.  bench/topp_bench.py on the H200
# (b2's 151,936 tokens, bf16 logits of std 2, top-p 0.95; bench/results/topp_bench_h200.json):
# 256-token programs on 2 warps for up to 16 rows (more programs for few rows: 1 row
# 31.1 -> 28.3 us), 1024 from 17 rows, and 8 warps for the one-program-per-row cut (4 rows
# 52.8 -> 51.3, 64 rows 296 -> 295 us).  MREP / REP: copies of the bins / of the block
# totals, the atomics of program c going to copy c % MREP (c % REP): a row's common digits
# (the many tokens of similar logits) otherwise take hundreds of atomic adds at one
# address; the cut kernel sums the copies.  4 x 8 copies for up to 16 rows: the whole cut
# 25.5 -> 21.7 us at 1 row, 41.3 -> 37.5 at 4, 102.1 -> 88.3 at 16 against the rule
# shipped before (256-token programs, one copy; bench/results/topp_copies_h200.json, bf16:
# one pass; at 16 rows 2 x 8 timed 86.9, within the noise of 4 x 8); the first pass only
# (32-bit keys' second pass counts only the tokens under K*'s top digit); more rows keep
# one copy (not timed with copies; the memset grows with them).
HIST_LAUNCH = {"BLOCK": 1024, "num_warps": 2, "MREP": 1, "REP": 1}  # tokens per histogram program (any power
# of two), its warps, the copies
HIST_FEW_ROWS = {"BLOCK": 256, "MREP": 4, "REP": 8}  # ... overridden for calls of up to 16 rows
CUT_WARPS = 8


def topp_kernel_enabled(cuda: bool) -> bool:
    """Whether hyspec.gpu.sampling.probs_batch (with its row kernels on) cuts top-k / top-p
    with these kernels: HYSPEC_TOPP_KERNEL=1 on, =0 off (or true/false, on/off, yes/no; any
    other value is a ValueError, hyspec.envknobs); unset: on CUDA only (the Triton
    interpreter runs them only when asked: slow, and the torch search is their reference)."""
    v = switch("HYSPEC_TOPP_KERNEL")
    return cuda if v is None else v


@kernels_per_mode
def _topp_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["sk", "sw"])
    def _hist_kernel(key_ptr, sk, w_ptr, sw, state_ptr, hist_ptr, V,
                     SHIFT: tl.constexpr, FIRST: tl.constexpr, W: tl.constexpr, SB: tl.constexpr,
                     BLOCK: tl.constexpr, RAW: tl.constexpr = False, HALF: tl.constexpr = 0,
                     MREP: tl.constexpr = 1, REP: tl.constexpr = 1):
        """Chunk c of row b: add the weight of each token sharing K*'s higher digits
        (state[b, 0]; every token on the first pass) into bin `digit` of the row's bins,
        and the chunk's weight per block of SB bins into the row's block totals (after
        its bins). MREP copies of the bins and REP of the block totals: program c adds
        into copy c % MREP (c % REP), which spreads the atomics of common digits over
        more addresses; the cut kernel sums the copies (integers: the same totals)."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)
        inside = i < V
        k = tl.load(key_ptr + b.to(tl.int64) * sk + i, mask=inside, other=0).to(tl.int64)
        if RAW:  # a float's bits (sign-extended): order_key's key (-0.0 first made +0.0)
            k = tl.where(k == -HALF, 0, k)
            k = k ^ ((k >> 63) & (HALF - 1))
        NB: tl.constexpr = 1 << W
        NBLK: tl.constexpr = NB // SB
        if FIRST:  # the top digit of the signed key, moved to [0, NB)
            d = (k >> SHIFT) + NB // 2
            w = tl.load(w_ptr + b.to(tl.int64) * sw + i, mask=inside, other=0)
        else:  # only the tokens under K*'s digits so far (a masked load reads no other weight)
            d = (k >> SHIFT) & (NB - 1)
            under = inside & ((k >> (SHIFT + W)) == tl.load(state_ptr + b * 2))
            w = tl.load(w_ptr + b.to(tl.int64) * sw + i, mask=under, other=0)
        row = hist_ptr + b.to(tl.int64) * (MREP * NB + REP * NBLK)
        tl.atomic_add(row + (c % MREP) * NB + d, w, mask=inside & (w != 0), sem="relaxed")
        blk = d // SB
        j = tl.arange(0, NBLK)
        per_block = tl.zeros([NBLK], tl.int64)
        for jb in tl.static_range(NBLK):
            per_block = tl.where(j == jb, tl.sum(tl.where(blk == jb, w, 0), 0), per_block)
        tl.atomic_add(row + MREP * NB + (c % REP) * NBLK + j, per_block, mask=per_block != 0, sem="relaxed")

    @triton.jit
    def _cut_kernel(hist_ptr, thr_ptr, state_ptr, FIRST: tl.constexpr, W: tl.constexpr, SB: tl.constexpr,
                    MREP: tl.constexpr = 1, REP: tl.constexpr = 1):
        """Row b: reach[d] = base + the weight in bins >= d (base: the weight ranked ahead of
        K*'s higher digits); K*'s digit is the last d with reach[d] >= threshold (0 if none).
        state[b] <- (K*'s digits so far, the weight ranked ahead of them).
        reach never grows with d (weights are >= 0), so from the block totals (the
        hist kernel's, per SB bins) the first block from the top whose lowest digit reaches
        the threshold is found at once; only that block is scanned bin by bin. The row's
        bins and block totals are the sums of their MREP / REP copies (the hist kernel's)."""
        b = tl.program_id(0)
        NB: tl.constexpr = 1 << W
        NBLK: tl.constexpr = NB // SB
        row = hist_ptr + b.to(tl.int64) * (MREP * NB + REP * NBLK)
        thr = tl.load(thr_ptr + b)
        if FIRST:
            base = tl.zeros((), tl.int64)
            prefix = tl.zeros((), tl.int64)
        else:
            prefix = tl.load(state_ptr + b * 2)
            base = tl.load(state_ptr + b * 2 + 1)
        j = tl.arange(0, NBLK)
        top = tl.zeros([NBLK], tl.int64)  # [NBLK] block totals (the sum of the REP copies), the top block first
        for r in tl.static_range(REP):
            top += tl.load(row + MREP * NB + r * NBLK + (NBLK - 1 - j))
        reached = base + tl.cumsum(top, 0) >= thr  # a suffix: the sums only grow
        s = NBLK - tl.sum(reached.to(tl.int32), 0)  # blocks from the top before the first reaching one
        found = (s < NBLK).to(tl.int32)
        above = tl.sum(tl.where(j < s, top, 0), 0)  # weight of the bins above block s (all: none reached)
        blk = tl.minimum(s, NBLK - 1)
        lo = NB - (blk + 1) * SB  # block blk's lowest digit
        h = tl.zeros([SB], tl.int64)  # block blk's bins (the sum of the MREP copies)
        bin0 = tl.zeros((), tl.int64)
        for r in tl.static_range(MREP):
            h += tl.load(row + r * NB + lo + tl.arange(0, SB))
            bin0 += tl.load(row + r * NB)
        hit = (base + above + tl.cumsum(h, 0, reverse=True) >= thr) & (found != 0)
        # digits with reach >= threshold (all below block blk, and its hits), 0 if none
        n_reach = tl.where(found != 0, lo + tl.sum(hit.to(tl.int64), 0), 0)
        # weight of the bins with reach < threshold (every bin when none reaches: above)
        below = above + tl.where(found != 0, tl.sum(tl.where(hit, 0, h), 0), 0)
        cut = tl.maximum(n_reach - 1, 0)
        # the weight ahead of K*'s digit: the bins above it (all but bin 0 when none reaches)
        ahead = below - tl.where(n_reach == 0, bin0, 0)
        if FIRST:
            key = cut - NB // 2
        else:
            key = (prefix << W) | cut
        tl.store(state_ptr + b * 2, key)
        tl.store(state_ptr + b * 2 + 1, base + ahead)

    @triton.jit(do_not_specialize=["sk", "sw", "sv", "so"])
    def _tie_kernel(key_ptr, sk, w_ptr, sw, valid_ptr, sv, thr_ptr, state_ptr, tot_ptr, out_ptr, so, V, n_chunks,
                    KEEP: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr, RAW: tl.constexpr = False,
                    HALF: tl.constexpr = 0, NEG_INF: tl.constexpr = 0, HAS_VALID: tl.constexpr = True):
        """Chunk c of row b, ties = its tokens with key K*. First launch: the ties' weight
        -> tot[b, c]. Second (KEEP): keep = valid & (key > K* | tie & weight of the ties
        before it (earlier chunks' totals, then an in-chunk scan) < threshold - base)."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)
        inside = i < V
        k = tl.load(key_ptr + b.to(tl.int64) * sk + i, mask=inside, other=0).to(tl.int64)
        finite = k != NEG_INF  # (RAW: the bits of -inf mark an invalid token)
        if RAW:
            k = tl.where(k == -HALF, 0, k)
            k = k ^ ((k >> 63) & (HALF - 1))
        cut = tl.load(state_ptr + b * 2)
        tie = inside & (k == cut)
        wt = tl.load(w_ptr + b.to(tl.int64) * sw + i, mask=tie, other=0)  # the ties' weights only (few: a
        # masked load reads none of the others)
        if KEEP:
            j = tl.arange(0, NC)
            earlier = tl.sum(tl.load(tot_ptr + b * n_chunks + j, mask=j < c, other=0), 0)
            room = tl.load(thr_ptr + b) - tl.load(state_ptr + b * 2 + 1)
            before = earlier + tl.cumsum(wt, 0) - wt
            if HAS_VALID:
                valid = tl.load(valid_ptr + b.to(tl.int64) * sv + i, mask=inside, other=0) != 0
            else:
                valid = finite
            keep = valid & ((k > cut) | (tie & (before < room)))
            tl.store(out_ptr + b.to(tl.int64) * so + i, keep.to(tl.int8), mask=inside)
        else:
            tl.store(tot_ptr + b * n_chunks + c, tl.sum(wt, 0))

    return _hist_kernel, _cut_kernel, _tie_kernel


_RAW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def prefix_select_rows(key: torch.Tensor, bits: int, valid: torch.Tensor | None, weight: torch.Tensor,
                       threshold: torch.Tensor) -> torch.Tensor:
    """keep [B, V] bool (see the module docstring): 16-bit keys in 5 launches, 32-bit in 7.

    key may also be the float values themselves (bf16 / fp16 / fp32, no NaN): the kernels
    then form :func:`hyspec.gpu.sampling.order_key`'s key from the bits as they load them
    (no key tensor), and valid may be None: the tokens whose value is not -inf."""
    B, V = key.shape
    raw = key.dtype in _RAW
    neg_inf = 0
    if raw:
        neg_inf = int(torch.tensor(float("-inf"), dtype=key.dtype).view(_RAW[key.dtype]))
        key = key.view(_RAW[key.dtype])
    elif valid is None:
        raise ValueError("prefix_select_rows: valid may be None only for float values")
    if bits % DIGIT or key.dtype not in (torch.int16, torch.int32) or bits != 8 * key.element_size():
        raise ValueError(f"prefix_select_rows: 16- or 32-bit keys only, got {key.dtype} ({bits} bits)")
    if key.stride(1) != 1 or (valid is not None and valid.stride(1) != 1) or weight.stride(1) != 1:
        raise ValueError("prefix_select_rows: rows need a contiguous last dim")
    if weight.dtype != torch.int64:
        raise ValueError("prefix_select_rows: int64 weights")
    dev = key.device
    passes = bits // DIGIT
    C = -(-V // CHUNK)
    thr = threshold.to(torch.int64).expand(B, 1).reshape(B)
    if thr.stride(0) != 1:
        thr = thr.contiguous()
    # the one memset: per pass and row, the bins then their totals per SCAN_BLOCK bins; the
    # first pass in MREP / REP copies of each, a later one (32-bit keys) in one: it counts
    # only the tokens under K*'s top digit, whose atomics copies would not spread much
    launch = {**HIST_LAUNCH, **HIST_FEW_ROWS} if B <= 16 else HIST_LAUNCH
    mrep, rep, hb = launch.get("MREP", 1), launch.get("REP", 1), launch["BLOCK"]
    nb, nblk = 1 << DIGIT, (1 << DIGIT) // SCAN_BLOCK
    first_size = B * (mrep * nb + rep * nblk)
    flat = torch.zeros(first_size + (passes - 1) * B * (nb + nblk), dtype=torch.int64, device=dev)
    hist = [flat[:first_size]] + [flat[first_size + i * B * (nb + nblk):first_size + (i + 1) * B * (nb + nblk)]
                                  for i in range(passes - 1)]
    copies = [(mrep, rep)] + [(1, 1)] * (passes - 1)
    state = torch.empty(B, 2, dtype=torch.int64, device=dev)  # (K*'s digits so far, weight ahead of them)
    tot = torch.empty(B, C, dtype=torch.int64, device=dev)
    out = torch.empty(B, V, dtype=torch.bool, device=dev)
    vu = valid.view(torch.uint8) if valid is not None else key  # (unread without HAS_VALID)
    sv = valid.stride(0) if valid is not None else 0
    half = 1 << (bits - 1) if raw else 0
    hist_k, cut_k, tie_k = _topp_kernels()
    for p in range(passes):
        first = p == 0
        mr, r = copies[p]
        hist_k[(B, -(-V // hb))](key, key.stride(0), weight, weight.stride(0), state, hist[p], V,
                                 SHIFT=bits - (p + 1) * DIGIT, FIRST=first, W=DIGIT, SB=SCAN_BLOCK, BLOCK=hb,
                                 RAW=raw, HALF=half, MREP=mr, REP=r, num_warps=launch["num_warps"])
        cut_k[(B,)](hist[p], thr, state, FIRST=first, W=DIGIT, SB=SCAN_BLOCK, MREP=mr, REP=r,
                    num_warps=CUT_WARPS)
    for keep in (False, True):
        tie_k[(B, C)](key, key.stride(0), weight, weight.stride(0), vu, sv, thr, state, tot,
                      out.view(torch.int8), out.stride(0), V, C, KEEP=keep, BLOCK=CHUNK, NC=p2(C), RAW=raw,
                      HALF=half, NEG_INF=neg_inf, HAS_VALID=valid is not None)
    return out
