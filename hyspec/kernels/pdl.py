"""Programmatic dependent launch (PDL) for the decode-path kernels (Hopper and newer).

A decode step is a chain of ~270 dependent kernels; a skinny matmul in it spends part
of its time ramping up after a small 1-SM kernel (norm, scan, conv) during which HBM
sits idle.  With PDL a kernel may be *launched* while its predecessor still runs:

* every kernel calls ``gdc_launch_dependents`` early, which lets the next kernel in the
  stream be scheduled as soon as every program of this one has started;
* every kernel calls ``gdc_wait`` before it touches memory that an earlier kernel writes
  (activations, caches, states) -- it returns once the predecessor grid has completed
  and its writes are visible.  Since each kernel waits before it completes, completion
  is transitive: after ``gdc_wait`` *all* earlier kernels of the stream are done;
* reads of memory no kernel writes during decoding (weights) could come before the wait
  (an L2 prefetch of the weight slab there measured slower on the H200, per 128-byte line
  and as one bulk prefetch per row, and was removed both times).

The result is unchanged (same kernels, same arithmetic, the waits only order memory
traffic), so exactness is untouched; only the schedule moves.  Without PDL (older GPUs,
the CPU interpreter, launches outside a decoder's step graphs unless ``HYSPEC_PDL=1``) the
kernels are compiled with ``PDL=False`` and the two calls vanish.

A decoder's step graphs run with PDL (:func:`step_default`). Dense models put every kernel
under it, the skinny matmuls triggering their dependents after their K loop instead of at
their start (``LATE``: the next kernel's waiting programs then do not hold SM slots while
the matmul streams its weights -- the reading behind it, not profiled; measured faster on
dense models). MoE and block-FP8 models put every other kernel under it and leave the
matmuls out: those are compiled
with ``PDL=False`` and launched plainly, so they start once the kernel ahead has completed,
and the kernel after them once they have (a kernel that never triggers its dependents
early triggers them as it exits), which keeps the transitive completion above.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from functools import lru_cache

import torch

from hyspec.envknobs import switch

__all__ = ["pdl_enabled", "set_pdl", "scoped", "current", "step_default", "launch_kwargs", "interpreting",
           "kernels_per_mode", "FAMILIES", "families", "matmul_late"]

_override: bool | None = None  # set_pdl's process-wide choice
# kernel families launched without PDL even when it is on (scoped's skip): "matmul" the
# skinny bf16 / block-FP8 matmuls (not their split-K reduce), "moe_gemm" the grouped MoE
# expert gemms
FAMILIES = frozenset({"matmul", "moe_gemm"})
# the innermost scoped() block's (flag, skip, late), per thread: a decoder's step in one thread
# never changes the launches of another thread
_scope = threading.local()


def current() -> tuple[bool | None, frozenset]:
    """This thread's PDL choice: (flag, families left out); flag None: HYSPEC_PDL decides."""
    flag = getattr(_scope, "flag", None)
    return (_override if flag is None else flag), getattr(_scope, "skip", frozenset())


def matmul_late() -> bool:
    """This thread's form of a skinny matmul launched with PDL: True, its dependents launch
    only after its K loop (the next kernel's programs, which wait, then do not take SM
    slots from the matmul's own while it streams its weights); False, at its start, as
    every other kernel does."""
    return getattr(_scope, "late", False)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read at each call."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_per_mode(build):
    """Decorator for a module's lazy kernel builder: build() runs once per Triton mode (the
    CPU interpreter when TRITON_INTERPRET=1, else the GPU JIT) and is cached per mode, so
    interpreter and GPU kernels never mix whichever mode a process used first."""
    built: dict = {}

    def get():
        mode = interpreting()
        if mode not in built:
            built[mode] = build()
        return built[mode]

    get.__doc__, get.__name__ = build.__doc__, build.__name__
    return get


def _supported() -> bool:
    return False if interpreting() else _supported_gpu()


@lru_cache(maxsize=None)
def _supported_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        if torch.cuda.get_device_capability()[0] < 9:
            return False
        from triton.backends.nvidia.compiler import CUDAOptions
        import triton.language.extra.cuda as tlc  # noqa: F401

        if "launch_pdl" not in CUDAOptions.__dataclass_fields__ or not hasattr(tlc, "gdc_wait"):
            return False
    except Exception:
        return False
    return True


def pdl_enabled() -> bool:
    """True when kernels should be compiled with PDL and launched with ``launch_pdl``:
    asked for (:func:`set_pdl(True)` or :func:`scoped`, as a decoder's step graphs do;
    elsewhere ``HYSPEC_PDL=1``) on a CUDA device of compute capability >= 9 with a Triton
    that knows the launch option, not under the interpreter.

    Outside the step graphs it is off by default: with every kernel it measured slower on
    the H200 for the b2 bench model (bench/results/step_anatomy_h200_tuning.json, tuned
    configs: decode step 1.688 ms without, 1.744 ms with PDL, 1.838 ms with PDL + a 16 MB
    L2 weight prefetch, since removed); :func:`step_default` has the measurements behind
    the step graphs' choice."""
    flag = current()[0]
    if flag is not None:
        return flag and _supported()
    if not switch("HYSPEC_PDL"):
        return False
    return _supported()


def set_pdl(flag: bool | None) -> None:
    """Force PDL on/off for launches from now on, in every thread (None: back to the
    default; a :func:`scoped` block's choice wins inside it).  Graphs captured earlier keep
    the launches they captured."""
    global _override
    _override = flag


@contextmanager
def scoped(flag: bool | None, skip: str = "", late: bool = False):
    """Launches inside the block with PDL on (True) or off (False), then the setting before
    it back; None leaves the setting alone.  ``skip``: comma-separated kernel families
    (``FAMILIES``) that launch without PDL inside the block even when it is on (an
    ablation's knob: a family compiled with ``PDL=False`` never triggers its dependents
    early and never waits, and the kernel after it starts once it completes, as without
    PDL).  A decoder's step graphs run in its runner's ``pdl`` / ``pdl_skip`` / ``pdl_late``
    scope (hyspec.gpu.graphs.StepGraphs), by default :func:`step_default`.  The choice is the
    calling thread's own (:func:`current`).  ``late``: the skinny matmuls' form when they
    launch with PDL (:func:`matmul_late`)."""
    names = families(skip, "pdl.scoped")
    if flag is None and not names and not late:
        yield
        return
    before = getattr(_scope, "flag", None), getattr(_scope, "skip", frozenset()), getattr(_scope, "late", False)
    _scope.flag = before[0] if flag is None else flag
    _scope.skip, _scope.late = names, bool(late)
    try:
        yield
    finally:
        _scope.flag, _scope.skip, _scope.late = before


def families(skip: str, who: str) -> frozenset:
    """The kernel families named in ``skip`` (comma-separated); ValueError naming ``who``
    and the unknown ones."""
    names = frozenset(n.strip() for n in skip.split(",") if n.strip())
    if names - FAMILIES:
        raise ValueError(f"{who}: unknown kernel families {sorted(names - FAMILIES)} (known: {sorted(FAMILIES)})")
    return names


def step_default(dense: bool = False) -> tuple[bool | None, str, bool]:
    """A decoder's PDL choice for its step graphs, as (flag, skip, late) for :func:`scoped`:
    on, the skinny matmuls with it and their dependents launched after their K loop
    (``(True, "", True)``) when the model is ``dense`` (no MoE layer, no block-FP8 weight),
    otherwise on with the skinny matmuls left out (``(True, "matmul", False)``). An explicit
    ``HYSPEC_PDL=0`` or ``=1`` in the environment hands the choice to the process-wide
    setting instead (``(None, "", False)``: every kernel off, or every kernel on with its
    trigger at its start; ``HYSPEC_PDL_SKIP`` is then not read), and otherwise
    ``HYSPEC_PDL_SKIP`` names the families to leave out ("" none) in place of the rule; the
    trigger stays the rule's (late on dense models, at the start on the others, where the
    matmuls under PDL measured slower with the late trigger than with the early one).

    Measured on the H200 (``python bench/runner_ab.py``; every arm bitwise equal): PDL on
    every kernel, each triggering its dependents at its start, made b2's dense step slower
    (x1.044, above) and the block-FP8 80B preset's one-lane decode too
    (bench/results/pdl_ab_qwen3-next-80b-a3b-fp8_h200.json: x1.052), while the bf16 35B MoE
    preset's got faster (pdl_ab_qwen3.5-35b-a3b_h200.json: x0.963). With the skinny matmuls
    left out (``--b pdl=True --b pdl_skip=matmul``, pdlskip_ab_<preset>_h200.json) it was
    faster on all three: b2 decode x0.984 at one lane and x0.995 at 16; the 35B x0.985 more
    than with PDL on every kernel; the 80B decode x0.954, K=3 round x0.979 against no PDL.
    The matmuls back under PDL with the late trigger (``--b pdl_skip= --b pdl_late=1``
    against that, mmlate_ab_<preset>_h200.json): the dense models faster again (b2 decode
    x0.974, K=3 round x0.978, 16 lanes x0.999 / x0.972; the 27B x0.987 / x0.977, 4 lanes
    x0.973 / x0.993), the MoE ones slower (35B x1.025 / x1.011; 80B-FP8 x1.124 / x1.033)."""
    if switch("HYSPEC_PDL") is not None:
        return None, "", False
    skip = os.environ.get("HYSPEC_PDL_SKIP", "" if dense else "matmul")
    families(skip, "HYSPEC_PDL_SKIP")  # a bad name fails here, when the decoder is built
    return True, skip, dense


def launch_kwargs(family: str | None = None) -> dict:
    """Extra kwargs for a Triton launch: ``{"PDL": bool}`` for the kernel's constexpr and
    ``launch_pdl`` when enabled (and ``family``, one of ``FAMILIES``, not skipped); the
    ``matmul`` family's kernels also take ``LATE`` (:func:`matmul_late`)."""
    on = pdl_enabled() and (family is None or family not in current()[1])
    if not on:
        return {"PDL": False}
    if family == "matmul":
        return {"PDL": True, "launch_pdl": True, "LATE": matmul_late()}
    return {"PDL": True, "launch_pdl": True}
