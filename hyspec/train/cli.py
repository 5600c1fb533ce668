"""``hyspec train`` / ``python -m hyspec.train.train``: the flags are built from the
``TrainConfig`` fields (name, type, default) and ``config.HELP``; the ``arch`` dict field
becomes one int flag per ``DEFAULT_ARCH`` key. ``--selfcheck`` runs the GPU self-check.

One command on a GPU machine reproduces ``hyspec/default_model``::

    python -m hyspec.train.train --corpus data/pystdlib_corpus.jsonl.xz \\
        --tokenizer data/tokenizer/tokenizer.json --out DIR --minutes 7.5 [--device cuda] [--seed 0]

It prints a loss-curve line every ``--log-every`` steps, evaluates held-out loss /
perplexity / top-1 accuracy (target and MTP) after training, and writes an HF-layout
checkpoint: config.json, generation_config.json, model.safetensors (bf16; A_log and
dt_bias kept fp32), tokenizer.json and train_log.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields

from hyspec.train.config import CHOICES, HELP, TrainConfig, flag
from hyspec.train.kernel_check import selfcheck
from hyspec.train.loop import INTERRUPTED, TrainingFailed, train
from hyspec.train.model import DEFAULT_ARCH

DESCRIPTION = ("Train the default hyspec hybrid model (+MTP head). "
               "On the CPU the run is refused up front when its estimated memory does not fit.")


def build_parser() -> argparse.ArgumentParser:
    from hyspec.cli import HelpFormatter
    from hyspec.cli.common import OneLineParser

    ap = OneLineParser(prog="hyspec train", description=DESCRIPTION, formatter_class=HelpFormatter)
    for f in fields(TrainConfig):
        if f.name == "arch":
            for k, v in DEFAULT_ARCH.items():
                ap.add_argument(flag(k), type=int, default=v, help=f"model: {k}")
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        if isinstance(default, bool):
            if default:
                ap.add_argument(flag("no_" + f.name), dest=f.name, action="store_false", help=HELP[f.name])
            else:
                ap.add_argument(flag(f.name), action="store_true", help=HELP[f.name])
            continue
        kw = {"choices": CHOICES[f.name]} if f.name in CHOICES else {}
        if f.name == "minutes":  # None: the default budget, or none when --steps is given
            ap.add_argument(flag(f.name), type=float, default=None, help=HELP[f.name])
            continue
        if not isinstance(default, str):
            kw["type"] = type(default)
        ap.add_argument(flag(f.name), default=default, help=HELP[f.name], **kw)
    ap.add_argument("--selfcheck", action="store_true", help="compare the fla and torch GDN paths and exit")
    return ap


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """A TrainConfig, or the argparse Namespace when --selfcheck was given."""
    ns = build_parser().parse_args(argv)
    if ns.selfcheck:
        return ns  # type: ignore[return-value]
    kw = {f.name: getattr(ns, f.name) for f in fields(TrainConfig) if f.name != "arch"}
    kw["arch"] = {k: getattr(ns, k) for k in DEFAULT_ARCH}
    return TrainConfig(**kw)  # (minutes None: the default budget, or none with --steps)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if isinstance(a, argparse.Namespace):
        import torch

        from hyspec.train import forward

        device = a.device or "cuda"
        if not device.startswith("cuda") or not torch.cuda.is_available():  # (tracebacks: no CUDA / no fla)
            raise ValueError("--selfcheck compares fla's CUDA kernels with the torch path: it needs a CUDA device")
        if forward.fla_kernel() is None:
            raise ValueError(f"--selfcheck: fla's kernel is unusable here: {forward.FLA_UNUSABLE_REASON}")
        print(json.dumps(selfcheck(device), indent=1))
        return 0
    try:
        res = train(a, log=lambda s: print(s, flush=True))
    except TrainingFailed as e:  # the run failed (not the user's flags): exit 1, as a run stopped early
        print(f"hyspec train: error: {e}", file=sys.stderr)
        return 130 if f"({INTERRUPTED})" in str(e) else 1  # (a Ctrl-C before the first step ended)
    if res["stopped"] == INTERRUPTED:  # written, as the user asked; the shell's status for Ctrl-C
        print(f"hyspec train: training interrupted (Ctrl-C) at step {res['steps']}; {a.out} holds the weights "
              f"of step {res['chosen_step']}", file=sys.stderr)
        return 130
    if res["stopped"] not in ("steps", "time budget"):
        print(f"hyspec train: training stopped early ({res['stopped']}); {a.out} holds the weights of step "
              f"{res['chosen_step']}", file=sys.stderr)
        return 1
    return 0
