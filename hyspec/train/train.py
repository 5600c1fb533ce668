"""Train the default hyspec model: a small Qwen3.5-style dense hybrid with one MTP layer.

The trainer is split by concern over the ``hyspec.train`` package; this module re-exports
its public names (``from hyspec.train import train as tr``, ``hyspec train``,
``python -m hyspec.train.train``):

* ``model``        architecture defaults, config.json contents, parameter count, init
* ``config``       ``TrainConfig`` (alias ``TrainArgs``): the run's settings and their help
* ``data``         corpus -> token streams, the window sampler, evaluation windows
* ``forward``      the batched training forward and loss (fla or torch GDN recurrence)
* ``evaluate``     held-out loss / perplexity / top-1 (target and MTP)
* ``kernel_check`` fla vs torch GDN paths: the first-batch guard and ``--selfcheck``
* ``checkpoint``   the HF-layout checkpoint (bf16; A_log and dt_bias fp32)
* ``memory``       the up-front memory estimate and the CPU refusal
* ``loop``         optimizer, learning-rate schedule, the training loop, the final write
* ``cli``          the argparse CLI, built from the ``TrainConfig`` fields
"""

from __future__ import annotations

import sys
import types

from hyspec.model.gdn import chunked_scan, l2norm  # noqa: F401
from hyspec.train import forward as _forward
from hyspec.train.checkpoint import (  # noqa: F401
    _keep_fp32,
    checkpoint_tensor_bytes,
    round_to_bf16_,
    save_checkpoint,
)
from hyspec.train.cli import build_parser, main, parse_args  # noqa: F401
from hyspec.train.config import HELP, TrainArgs, TrainConfig  # noqa: F401
from hyspec.train.data import (  # noqa: F401
    VAL_PERCENT,
    WindowSampler,
    eval_windows,
    is_val_doc,
    load_streams,
)
from hyspec.train.evaluate import evaluate  # noqa: F401
from hyspec.train.forward import (  # noqa: F401
    _flat,
    attn_batched,
    batched_hidden,
    batched_logits,
    batched_mtp_hidden,
    chunked_scan_batched,
    fla_kernel,
    gdn_batched,
    layer_batched,
    loss_fn,
    resolve_fla,
)
from hyspec.train.kernel_check import compare_gdn_paths, selfcheck  # noqa: F401
from hyspec.train.loop import _PROCESS_START, TrainingFailed, _param_groups, _sync, lr_at, train  # noqa: F401
from hyspec.train.memory import (  # noqa: F401
    _train_memory_terms,
    available_memory_bytes,
    check_train_memory,
    estimate_train_bytes,
)
from hyspec.train.model import (  # noqa: F401
    DEFAULT_ARCH,
    EOS_ID,
    count_params,
    default_config,
    init_params,
    model_config,
)

# the fla kernel state lives in hyspec.train.forward: reading or setting it here (as tests
# do with monkeypatch) reads or sets it there
_FORWARDED = ("_FLA", "FLA_UNUSABLE_REASON")


def __getattr__(name: str):
    if name in _FORWARDED:
        return getattr(_forward, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Module(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in _FORWARDED:
            setattr(_forward, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name not in _FORWARDED:
            super().__delattr__(name)


sys.modules[__name__].__class__ = _Module

if __name__ == "__main__":  # through the CLI's dispatch: a user error is one line, not a traceback
    from hyspec.cli.dispatch import main as _dispatch

    sys.exit(_dispatch(["train", *sys.argv[1:]]))
