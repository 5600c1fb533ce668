"""The skinny matmul's tile shape and split-K: a function of the weight shape (N, K) only,
never of the row count (the row-invariance contract, ``hyspec/kernels/matmul/__init__.py``).

Glossary: K input features, N output features, S K-splits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["SkinnyConfig", "skinny_config", "TUNED", "BUILTIN", "set_tuned"]

_TARGET_PROGRAMS = 256  # about two programs per H200 SM (132 SMs); a constant, not a query
_MIN_K_PER_SPLIT = 256  # a K-split streams at least this many K columns


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # BN, output columns per program
    block_k: int  # BK, K columns per loop step
    split_k: int  # S, number of K ranges reduced afterwards (1: no workspace, direct write)
    k_per_split: int  # K columns per split, a multiple of block_k
    num_warps: int = 4
    num_stages: int = 3
    wt: bool = False  # weight tile as the MMA's left operand ([BN, BK] @ x.T) instead of the right


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skinny_config(
    N: int,
    K: int,
    *,
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    wt: bool = False,
) -> SkinnyConfig:
    """Tile shape and split-K for an ``[N, K]`` weight; depends on (N, K) only, never on T.

    Defaults (tuned by reasoning, to be re-tuned on the H200 with ``bench/kernels_gpu.py --sweep``):
    BN = 32 for N <= 1024, 128 for N >= 32768, else 64; BK = 128; S doubles while there
    are fewer than 256 programs and each split keeps >= 256 K columns.  Worked example:
    o_proj N=2048, K=4096 -> BN 64, 32 column tiles, S = 8 (256 programs, 512 K each).
    """
    if N <= 0 or K <= 0:
        raise ValueError(f"skinny_config: N and K must be positive, got N={N}, K={K}")
    bn = block_n or (32 if N <= 1024 else 128 if N >= 32768 else 64)
    bk = block_k or 128
    for name, val in (("block_n", bn), ("block_k", bk)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"skinny_config: {name} must be a power of two >= 16, got {val}")
    if split_k is None:
        n_tiles = _cdiv(N, bn)
        s = 1
        while n_tiles * s < _TARGET_PROGRAMS and K // (2 * s) >= _MIN_K_PER_SPLIT:
            s *= 2
    else:
        if split_k < 1:
            raise ValueError(f"skinny_config: split_k must be >= 1, got {split_k}")
        s = split_k
    # each split covers a whole number of BK steps; recompute S so no split is empty
    k_per_split = _cdiv(_cdiv(K, s), bk) * bk
    s = _cdiv(K, k_per_split)
    return SkinnyConfig(bn, bk, s, k_per_split, num_warps or 4, num_stages or 3, bool(wt))


# Measured best configs per (N, K) on the H200 (bf16, t=1; bench/kernels_gpu.py --sweep),
# used when the caller overrides nothing.  Keyed by shape only, so row invariance holds.
TUNED: dict[tuple[int, int], dict] = {}


def set_tuned(table: dict[tuple[int, int], dict]) -> None:
    """Replace the tuned-config table (clears the config cache)."""
    TUNED.clear()
    TUNED.update(table)
    _config_cached.cache_clear()


# Configs picked by the in-step tuner on the H200 for the b2 bench model's shapes
# (bench/results/step_anatomy_h200_tuning.json); used when TUNED has no entry for the shape.
BUILTIN: dict[tuple[int, int], dict] = {
    (2048, 4096): dict(block_n=32, block_k=256, split_k=4),
    (2048, 6144): dict(block_n=64, block_k=256, split_k=4, wt=True),
    (9216, 2048): dict(block_n=128, block_k=256, split_k=1),
    (12288, 2048): dict(block_n=32, block_k=128, split_k=1, num_stages=4),
    (12352, 2048): dict(block_n=32, block_k=128, split_k=1, num_stages=4),
    (151936, 2048): dict(block_n=64, block_k=256, split_k=1),
}


@lru_cache(maxsize=4096)
def _config_cached(N, K, split_k, block_n, block_k, num_warps, num_stages, wt=None, act=False) -> SkinnyConfig:
    if (split_k, block_n, block_k, num_warps, num_stages, wt) == (None,) * 6:
        if (N, K) in TUNED:
            return skinny_config(N, K, **TUNED[(N, K)])
        if (N, K) in BUILTIN:
            return skinny_config(N, K, **BUILTIN[(N, K)])
        # the fused SiLU*mul input streams far better with the weight as the left operand
        # (b2 down projection in the step: 10.3 vs 44.6 us, step_anatomy_h200_tuning.json)
        wt = act
    return skinny_config(N, K, split_k=split_k, block_n=block_n, block_k=block_k,
                         num_warps=num_warps, num_stages=num_stages, wt=bool(wt))
