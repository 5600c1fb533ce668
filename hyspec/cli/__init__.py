"""`hyspec` command line: generate, score, replay, make-tiny, bench, train, serve, chat.

Thin by design: parse, call the engine, print. Sampling and drafter flags are derived
from the SamplingParams / SpecOptions dataclasses, so defaults cannot drift.

    dispatch.py    main (the console entry point `hyspec`), build_parser, error lines
    common.py      shared flag groups, HelpFormatter, constraint flags, load_engine
    generate.py    hyspec generate (one prompt, streamed; or --prompts-file)
    score.py       hyspec score
    replay.py      hyspec replay
    make_tiny.py   hyspec make-tiny
    (bench, train, serve and chat live in hyspec/bench/, hyspec/train/, hyspec/server/, hyspec/chat.py)
"""

from __future__ import annotations

from hyspec.cli.common import (
    HelpFormatter,
    add_constraint_args,
    add_model_args,
    add_sampling_args,
    add_spec_args,
    constraint_from_args,
    load_engine,
    parse_ids,
    parse_rates,
)
from hyspec.cli.dispatch import build_parser, main

# the names these had when the CLI was one module (kept for code that imports them)
_ids, _rates, _load = parse_ids, parse_rates, load_engine
_add_model_args, _add_sampling_args, _add_spec_args = add_model_args, add_sampling_args, add_spec_args
_add_constraint_args = add_constraint_args

__all__ = ["main", "build_parser", "HelpFormatter", "constraint_from_args", "load_engine", "parse_ids",
           "parse_rates", "add_model_args", "add_sampling_args", "add_spec_args", "add_constraint_args"]
