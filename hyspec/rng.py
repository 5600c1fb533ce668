"""Counter-based randomness for sampling.

Every random number is a pure function of ``(seed, stream, counter)``; there is no
hidden generator state.  A run is therefore reproduced exactly by its seed, and a
draw can be recomputed later (after a rollback, in another process, on another
device) without replaying the draws before it.

The block function is Philox-4x32 with 10 rounds (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC'11).  It is implemented twice:

* in plain Python integers (:func:`u01`), for the handful of scalar draws a
  speculative round needs, and
* in ``int64`` torch tensors (:func:`u01_tensor`), for vectors of draws (Gumbel noise
  over a vocabulary, large statistical tests).

Philox only needs 32x32 -> 64 bit products.  The tensor version computes each product
from two 32x16 bit partial products (< 2**48 each), so every intermediate value fits
in a signed int64 and no step relies on overflow behaviour.  Both versions are exact
integer arithmetic and give bit-identical results on any device and thread count.

Input layout of one Philox block (four 32-bit words, two key words)::

    counter words = (counter & 0xFFFFFFFF, counter >> 32, stream, 0)
    key words     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)

The first two output words give a 53-bit integer ``m``; the uniform is ``m / 2**53``
(and ``2**-54`` in the single case ``m == 0``), so every value lies in the open
interval (0, 1) on the 53-bit grid.
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "Stream",
    "philox4x32",
    "u01",
    "u01_tensor",
    "u01_lanes",
    "gumbel_noise",
    "gumbel_noise_batch",
    "gumbel_counters",
]

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_M0 = 0xD2511F53  # Philox multipliers
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9  # Weyl key increments (golden ratio, sqrt(3) - 1)
_W1 = 0xBB67AE85
_ROUNDS = 10

_TWO_M53 = 2.0**-53
_TWO_M54 = 2.0**-54  # value used for the (probability 2**-53) draw m == 0


class Stream(enum.IntEnum):
    """Independent random streams; each decision kind draws from its own stream."""

    DRAFT = 1  # drafter samples a draft token from q
    ACCEPT = 2  # accept/reject uniform for a draft token
    RESIDUAL = 3  # resample from normalize(max(0, p - q)) after a rejection
    BONUS = 4  # token drawn from p after every draft of a round was accepted
    PLAIN = 5  # plain (non-speculative) sampling
    COUPLED = 6  # Gumbel noise for coupled (Gumbel-max) sampling


# --------------------------------------------------------------------------------------
# Pure-Python version
# --------------------------------------------------------------------------------------


def philox4x32(
    c0: int, c1: int, c2: int, c3: int, k0: int, k1: int
) -> tuple[int, int, int, int]:
    """Philox-4x32-10 block function on Python ints (all words 32-bit)."""
    for r in range(_ROUNDS):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0  # < 2**64, exact in Python
        p1 = _M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
    return c0, c1, c2, c3


def _key(seed: int) -> tuple[int, int]:
    s = int(seed) & _MASK64  # any Python int; negative seeds wrap modulo 2**64
    return s & _MASK32, s >> 32


def _check_stream(stream: int) -> int:
    stream = int(stream)
    if not 0 <= stream <= _MASK32:
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    return stream


def u01(seed: int, stream: int, counter: int) -> float:
    """Uniform draw in the open interval (0, 1) for ``(seed, stream, counter)``.

    ``counter`` must be in [0, 2**64) (the tensor version accepts [0, 2**63)).
    """
    counter = int(counter)
    if not 0 <= counter <= _MASK64:
        raise ValueError(f"counter must be in [0, 2**64), got {counter}")
    k0, k1 = _key(seed)
    o0, o1, _, _ = philox4x32(
        counter & _MASK32, counter >> 32, _check_stream(stream), 0, k0, k1
    )
    m = ((o0 >> 5) << 26) | (o1 >> 6)  # 27 + 26 = 53 bits
    return m * _TWO_M53 if m else _TWO_M54


# --------------------------------------------------------------------------------------
# Tensor version (int64, exact)
# --------------------------------------------------------------------------------------


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of ``m * c`` for a 32-bit constant and int64 words < 2**32.

    m * c = m * c_lo + (m * c_hi) << 16 with c = c_hi * 2**16 + c_lo; both partial
    products are < 2**48, so nothing overflows int64.
    """
    t = m * (c & 0xFFFF)  # < 2**48
    v = m * (c >> 16)  # < 2**48
    s = t + ((v & 0xFFFF) << 16)  # < 2**49
    lo = s & _MASK32
    hi = (s >> 32) + (v >> 16)  # < 2**32 because m * c < 2**64
    return hi, lo


def _philox4x32_tensor(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 on int64 tensors holding 32-bit words (same shape or broadcastable)."""
    for r in range(_ROUNDS):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def u01_tensor(seed: int, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Elementwise :func:`u01` over an integer tensor of counters.

    counters: any shape, integer dtype, values in [0, 2**63).
    Returns a float64 tensor of the same shape and device, bit-identical to
    ``u01(seed, stream, c)`` for each element.
    """
    if counters.dtype.is_floating_point or counters.dtype == torch.bool:
        raise TypeError(f"counters must be an integer tensor, got {counters.dtype}")
    c = counters.to(torch.int64)
    if c.numel() and bool((c < 0).any()):
        raise ValueError("counters must be non-negative")
    k0, k1 = _key(seed)
    stream = _check_stream(stream)
    c0 = c & _MASK32
    c1 = c >> 32  # non-negative, so arithmetic shift == logical shift
    c2 = torch.full_like(c, stream)
    c3 = torch.zeros_like(c)
    o0, o1, _, _ = _philox4x32_tensor(c0, c1, c2, c3, k0, k1)
    m = ((o0 >> 5) << 26) | (o1 >> 6)  # [*] int64 < 2**53, exact in float64
    u = m.to(torch.float64) * _TWO_M53
    return torch.where(m == 0, torch.full_like(u, _TWO_M54), u)


def u01_lanes(seeds: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """:func:`hyspec.rng.u01_tensor` with one key per lane and no checks (no host sync).

    seeds: int64 [B] (the uint64 seed's bits); counters: int64 [B, ...] in [0, 2**63).
    Returns float64 [B, ...], bit-identical to ``u01(seed[b], stream, counter)``: it runs
    the same int64 Philox block function as ``u01_tensor``, keyed per element.
    """
    c = counters.to(torch.int64)
    s = seeds.to(torch.int64).reshape(seeds.shape + (1,) * (c.dim() - seeds.dim()))  # [B, 1...]
    k0 = s & _MASK32
    k1 = (s >> 32) & _MASK32  # arithmetic shift, then the high word's 32 bits
    c0 = c & _MASK32
    c1 = c >> 32
    c2 = torch.full_like(c, int(stream))
    c3 = torch.zeros_like(c)
    o0, o1, _, _ = _philox4x32_tensor(c0, c1, c2, c3, k0, k1)
    m = ((o0 >> 5) << 26) | (o1 >> 6)  # int64 < 2**53
    u = m.to(torch.float64) * _TWO_M53
    return torch.where(m == 0, torch.full_like(u, _TWO_M54), u)


# --------------------------------------------------------------------------------------
# Gumbel noise
# --------------------------------------------------------------------------------------

_MAX_POSITION = 1 << 31  # position << 32 must stay below 2**63


def gumbel_counters(
    positions: torch.Tensor | int, vocab: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Counters for token ``i`` at ``position``: ``position * 2**32 + i``.

    The counter does not depend on ``vocab``, so the noise of token i at a position is
    the same whatever vocabulary size the row has.  positions: int or LongTensor [N];
    returns [vocab] or [N, vocab].
    """
    if not 0 < vocab <= _MASK32 + 1:
        raise ValueError(f"vocab must be in [1, 2**32], got {vocab}")
    pos = torch.as_tensor(positions, dtype=torch.int64, device=device)
    if pos.numel() and bool(((pos < 0) | (pos >= _MAX_POSITION)).any()):
        raise ValueError("positions must be in [0, 2**31)")
    ids = torch.arange(vocab, dtype=torch.int64, device=pos.device)  # [V]
    return (pos.unsqueeze(-1) << 32) + ids  # [..., V]


def gumbel_noise(
    seed: int,
    stream: int,
    position: int,
    vocab: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` for every token of one position.

    u = u01(seed, stream, position * 2**32 + i) for token i; returns float64 [vocab].
    """
    return gumbel_noise_batch(seed, stream, torch.tensor([int(position)]), vocab, device)[0]


def gumbel_noise_batch(
    seed: int,
    stream: int,
    positions: torch.Tensor,
    vocab: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`gumbel_noise` for many positions at once: positions [N] -> float64 [N, vocab]."""
    counters = gumbel_counters(positions, vocab, device)  # [N, V]
    u = u01_tensor(seed, stream, counters)  # [N, V] in (0, 1)
    return -torch.log(-torch.log(u))
