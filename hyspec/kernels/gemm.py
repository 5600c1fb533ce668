"""Former home of the skinny matmul, kept so old imports work: it now lives in
:mod:`hyspec.kernels.matmul` (``kernel.py``, ``config.py``, ``reference.py``).

The config tables are the very objects of :mod:`hyspec.kernels.matmul.config`:
``TUNED`` / ``BUILTIN`` mutated here, ``set_tuned`` and ``_config_cached.cache_clear``
act there.
"""
from __future__ import annotations

from hyspec.kernels.common import triton_available
from hyspec.kernels.matmul.config import (  # noqa: F401
    _MIN_K_PER_SPLIT,
    _TARGET_PROGRAMS,
    BUILTIN,
    TUNED,
    SkinnyConfig,
    _cdiv,
    _config_cached,
    set_tuned,
    skinny_config,
)
from hyspec.kernels.matmul.kernel import (  # noqa: F401
    _REDUCE_BLOCK,
    BLOCK_T,
    MAX_SKINNY_ROWS,
    _kernels,
    linear,
    skinny_matmul,
)
from hyspec.kernels.matmul.reference import skinny_matmul_ref

__all__ = [
    "skinny_matmul_ref",
    "skinny_matmul",
    "skinny_config",
    "SkinnyConfig",
    "linear",
    "triton_available",
    "MAX_SKINNY_ROWS",
    "TUNED",
    "set_tuned",
]
