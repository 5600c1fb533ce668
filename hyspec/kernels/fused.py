"""Former home of the fused fast-path kernels, kept so old imports work: every name is
re-exported from its op folder (``hyspec/kernels/rmsnorm``, ``attention``, ``gdn``,
``moe``; the shared helpers from ``hyspec.kernels.common``).  New code imports from there.

Patching a name here does not reach the code that uses it: patch the op folder's module
(or the importing module's name) instead.
"""
from __future__ import annotations

from hyspec.kernels.attention import kernel as _attention_kernel
from hyspec.kernels.attention.kernel import (
    ATTN_BLOCK_N,  # noqa: F401
    ATTN_SPLITS,
    attn_decode,
    attn_prep,
    rope_inv_freq,
)
from hyspec.kernels.attention.kernel import launch_combine as _launch_combine  # noqa: F401
from hyspec.kernels.attention.reference import attn_decode_ref, attn_prep_ref
from hyspec.kernels.common import SplitPartials
from hyspec.kernels.common import check_rows as _check_rows  # noqa: F401
from hyspec.kernels.common import p2 as _p2  # noqa: F401
from hyspec.kernels.gdn import kernel as _gdn_kernel
from hyspec.kernels.gdn.kernel import (
    _gdn_blocks,  # noqa: F401
    gdn_conv,
    gdn_replay,
    gdn_step,
)
from hyspec.kernels.gdn.reference import gdn_conv_ref, gdn_step_ref
from hyspec.kernels.moe import kernel as _moe_kernel
from hyspec.kernels.moe.kernel import expert_gemv
from hyspec.kernels.moe.reference import expert_gemv_ref
from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs  # noqa: F401
from hyspec.kernels.rmsnorm import kernel as _rmsnorm_kernel
from hyspec.kernels.rmsnorm.kernel import rmsnorm
from hyspec.kernels.rmsnorm.reference import rmsnorm_ref

__all__ = [
    "rmsnorm", "rmsnorm_ref", "attn_prep", "attn_prep_ref", "attn_decode", "attn_decode_ref",
    "gdn_conv", "gdn_conv_ref", "gdn_step", "gdn_step_ref", "gdn_replay", "expert_gemv", "expert_gemv_ref",
    "rope_inv_freq", "ATTN_SPLITS", "SplitPartials",
]


def _kernels() -> dict:
    """Every kernel the old module built, by its old name (each op builds its own, once per
    Triton mode)."""
    return {**_rmsnorm_kernel._kernels(), **_attention_kernel._kernels(), **_gdn_kernel._kernels(),
            **_moe_kernel._kernels()}
