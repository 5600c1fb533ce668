"""Former home of the Philox row kernel, kept so old imports work: it now lives in
:mod:`hyspec.kernels.rng` (``kernel.py``, ``reference.py``)."""
from __future__ import annotations

from hyspec.kernels.rng.kernel import _BLOCK, u01_rows  # noqa: F401

__all__ = ["u01_rows"]
