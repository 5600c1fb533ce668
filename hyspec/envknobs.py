"""The HYSPEC_* environment variables that switch a fast path off or pick a kernel setting
(ablation and debugging knobs, docs/gpu.md), read one way everywhere.

A switch takes 1/0, and also true/false, on/off, yes/no in any case; unset or empty means
its default.  A number takes a decimal integer at or above its minimum, a choice one of its
words (HYSPEC_PDL_SKIP, a list of kernel families, is checked by hyspec.kernels.pdl).
Anything else is a ValueError that names the variable and what it takes, raised where the knob is read and,
for every knob at once, by :func:`check` when an engine or a server starts (so a typo is
caught before any request runs, not inside a kernel launch on the engine's thread).
"""

from __future__ import annotations

import os

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")

# switch: its default (None: three-state, unset leaves the choice to the code)
SWITCHES: dict[str, bool | None] = {
    "HYSPEC_ARGMAX_KERNEL": True, "HYSPEC_ATTN_CHUNKED": False, "HYSPEC_ATTN_COMBINE_TILE": True,
    "HYSPEC_COMMIT_KERNEL": True, "HYSPEC_FP8_CVT": True, "HYSPEC_GDN_CONST_DV": True,
    "HYSPEC_GDN_ONE_REDUCTION": True, "HYSPEC_GDN_PREFETCH": True, "HYSPEC_GDN_PV_FIRST": True,
    "HYSPEC_GDN_STREAM": True, "HYSPEC_MOE_DEFER": True, "HYSPEC_NORM_W_FIRST": True,
    "HYSPEC_PDL": None, "HYSPEC_REPLAY_COMMIT": True, "HYSPEC_SERVE_SCHEDULER": True,
    "HYSPEC_TALL_TUNED": True, "HYSPEC_TOPP_KERNEL": None, "HYSPEC_U01_KERNEL": True,
    "HYSPEC_WINDOW_KERNEL": True,
}
# number: (default, minimum); 0 means "the code's choice" where the reader says so
NUMBERS: dict[str, tuple[int, int]] = {
    "HYSPEC_FAST_PREFILL": (64, 0), "HYSPEC_GDN_BLOCK_V": (0, 0), "HYSPEC_GDN_DECODE_BLOCKS": (1, 1),
    "HYSPEC_GDN_DECODE_BLOCKS_MIN_LANES": (8, 0), "HYSPEC_GDN_WARPS": (0, 0),
}

# one of a few words: (default, the words)
CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "HYSPEC_TALL_ACT": ("split", ("split", "fused")),
    "HYSPEC_BATCH_BLOCK_T": ("auto", ("auto", "16", "32", "64", "128")),
}


def switch(name: str) -> bool | None:
    """The switch ``name`` (registered in SWITCHES; its default when unset or empty);
    ValueError naming it for any other value."""
    raw = os.environ.get(name)
    v = (raw or "").strip().lower()
    if not v:
        return SWITCHES[name]
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a switch: use 1 or 0 "
                     "(also on/off, true/false, yes/no), or unset it")


def number(name: str) -> int:
    """The integer knob ``name`` (registered in NUMBERS); ValueError naming it for a value
    that is not a decimal integer at or above its minimum."""
    default, least = NUMBERS[name]
    raw = os.environ.get(name)
    v = (raw or "").strip()
    if not v:
        return default
    if not (v.isascii() and v.isdigit()) or int(v) < least:  # (a decimal integer; no sign: every minimum is >= 0)
        raise ValueError(f"environment variable {name}={raw!r} is not an integer >= {least}, "
                         f"or unset it (default {default})")
    return int(v)


def choice(name: str) -> str:
    """The knob ``name`` (registered in CHOICES), lower-cased; ValueError naming it for a
    word it does not take."""
    default, words = CHOICES[name]
    raw = os.environ.get(name)
    v = (raw or "").strip().lower() or default
    if v not in words:
        raise ValueError(f"environment variable {name}={raw!r} is not one of {', '.join(words)}, "
                         f"or unset it (default {default})")
    return v


def check() -> None:
    """Read every registered knob that is set, and HYSPEC_PDL_SKIP's kernel families: the
    first bad one raises its ValueError."""
    for name in SWITCHES:
        switch(name)
    for name in NUMBERS:
        number(name)
    for name in CHOICES:
        choice(name)
    if os.environ.get("HYSPEC_PDL_SKIP"):
        from hyspec.kernels.pdl import families

        families(os.environ["HYSPEC_PDL_SKIP"], "HYSPEC_PDL_SKIP")
