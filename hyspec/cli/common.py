"""What the subcommands share: the help formatter, flag groups derived from the
SamplingParams / SpecOptions dataclasses (so defaults cannot drift), argument parsers for
id and rate lists, the constraint flags, and loading the engine."""

from __future__ import annotations

import argparse
import dataclasses
import os

from hyspec.config import DTYPE_NAMES, SSM_CHOICES
from hyspec.sampling import SamplingParams
from hyspec.speculative.loop import MAX_DRAFT, SpecOptions


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help shows its default (unless the help already says it)."""

    def _get_help_string(self, action):
        return action.help if "(default:" in (action.help or "") else super()._get_help_string(action)


SAMPLING_HELP = {
    "temperature": "0 = greedy",
    "top_k": "keep the k most likely tokens (0 = off)",
    "top_p": "nucleus sampling mass (1 = off)",
    "min_p": "drop tokens below min_p * p_max (0 = off)",
    "repetition_penalty": "divide positive / multiply negative logits of seen tokens (1 = off)",
    "frequency_penalty": "subtract this times the count of each seen token",
    "presence_penalty": "subtract this from every seen token",
    "penalty_last_n": "penalties look at the last N tokens (0 = off, -1 = all)",
    "seed": "random seed (counter-based: same seed, same output)",
    "mode": "rejection sampling, or coupled (Gumbel-max: speculative output equals plain output)",
    "logit_bias": "ID:BIAS[,ID:BIAS...]: add BIAS (-100..100) to token ID's logit before sampling "
                  "(-100 all but bans it) (default: none)",
}


def parse_logit_bias(text: str) -> tuple:
    """--logit-bias ID:BIAS[,ID:BIAS...] -> ((id, bias), ...) (SamplingParams checks the values)."""
    pairs = []
    for part in text.split(","):
        tid, sep, bias = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(tid), float(bias)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"want ID:BIAS[,ID:BIAS...] (e.g. 42:-100), got {part.strip()!r}") from None
    return tuple(pairs)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``PROG: error: MESSAGE (see PROG --help)``,
    exit code 2 (argparse's own print the usage block first); its subparsers are alike."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def parse_ids(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3] (argparse type)."""
    items = text.replace(" ", "").removesuffix(",").split(",")
    if items == [""]:  # (nothing: no ids, as before)
        return []
    try:
        if "" in items:  # ("1,,2": a missing id, not one to drop in silence)
            raise ValueError
        return [int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.9,0.8' -> (0.9, 0.8) (argparse type)."""
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated rates in [0, 1] like 0.9,0.8,0.7, got {text!r}")
    return rates


def json_dumps(obj) -> str:
    """json.dumps with each non-finite float (a perplexity past a float's range: inf) written
    as null: JSON has no Infinity or NaN, and a reader of --json output must parse it."""
    import json

    from hyspec.config import finite_json

    return json.dumps(finite_json(obj), allow_nan=False)


def check_out_file(path, flag: str = "--out") -> None:
    """ValueError naming `flag` when `path` could not be written (a folder, a missing or
    unwritable parent): checked before the work whose results it would hold."""
    import os
    from pathlib import Path

    if path is None:
        return
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {parent} does not exist")
    existed = p.exists()
    try:  # (opened for appending and closed: an existing file keeps its bytes)
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None
    if not existed:
        os.unlink(p)


def check_out_dir(path, flag: str = "--out") -> None:
    """ValueError naming `flag` when the folder `path` could not be made or written into (a
    file is there, or the nearest existing folder above it is not writable): checked before
    the work whose results it would hold. Creates nothing."""
    import os
    from pathlib import Path

    if not str(path).strip():
        raise ValueError(f"{flag} is empty: name a folder (--out . for the current one)")
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: is a file, not a folder")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag} {path}: {probe} is a file, so the folder cannot be made")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write into {probe} (permission denied)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, type=os.path.expanduser, help="checkpoint directory, or a Hugging Face model id (org/name[@revision]: from the local cache, else downloaded) (default: the embedded model)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPE_NAMES,
                   help="weight and activation dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--ssm-dtype", default=None, choices=SSM_CHOICES,
                   help="storage dtype of the Gated DeltaNet state (default: the checkpoint's "
                        "mamba_ssm_dtype, else float32; bfloat16 halves a sequence's state bytes "
                        "and rounds it after every token, which changes the output slightly)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def add_sampling_args(p: argparse.ArgumentParser, recommended: bool = False) -> None:
    """The sampling flags. recommended: the ones a checkpoint's generation_config.json may set
    (hyspec.config.SAMPLING_DEFAULT_FIELDS) default to None, "not given", and take its value
    once the model is loaded (sampling_params), else the usual default."""
    from hyspec.config import SAMPLING_DEFAULT_FIELDS

    group = p.add_argument_group("sampling")
    for f in dataclasses.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "mode":
            group.add_argument("--sampling-mode", dest="mode", default="rejection", choices=["rejection", "coupled"],
                               help=SAMPLING_HELP["mode"])
            continue
        if f.name == "logit_bias":
            group.add_argument(flag, dest=f.name, type=parse_logit_bias, default=(), metavar="ID:BIAS,...",
                               help=SAMPLING_HELP[f.name])
            continue
        default = _flag_default(f)
        if recommended and f.name in SAMPLING_DEFAULT_FIELDS:
            group.add_argument(flag, dest=f.name, type=type(f.default), default=None,
                               help=f"{SAMPLING_HELP.get(f.name) or ''} (default: the checkpoint's "
                                    f"generation_config.json value, else {default:g})".lstrip())
            continue
        group.add_argument(flag, dest=f.name, type=type(f.default), default=default, help=SAMPLING_HELP.get(f.name))


def _flag_default(f: dataclasses.Field):
    """A sampling flag's default: SamplingParams' own, but greedy (temperature 0) on the command line."""
    return 0.0 if f.name == "temperature" else f.default


def sampling_params(args, recommended: dict | None = None) -> SamplingParams:
    """SamplingParams of the flags; a flag left at None (add_sampling_args(recommended=True))
    takes recommended's value (the checkpoint's: Engine.sampling_defaults), else the flag's
    usual default (temperature 0: greedy)."""
    values = {}
    for f in dataclasses.fields(SamplingParams):
        v = getattr(args, f.name)
        if v is None:
            v = (recommended or {}).get(f.name, _flag_default(f))
        values[f.name] = v
    return SamplingParams(**values)


def add_spec_args(p: argparse.ArgumentParser, forced_rates: bool = True) -> None:
    group = p.add_argument_group("speculative decoding")
    defaults = SpecOptions()
    group.add_argument("--draft", type=int, default=0,
                       help=f"drafts per round K (0 = plain decoding, 1..{MAX_DRAFT})")
    group.add_argument("--rollback", default=defaults.rollback, choices=["checkpoint", "rescan", "replay"],
                       help="how linear-attention state is rolled back after a partial accept")
    group.add_argument("--p-min", type=float, default=defaults.p_min,
                       help="stop drafting below this draft probability")
    group.add_argument("--adaptive", action="store_true", help="next K = clamp(accepted + 1, floor, K)")
    group.add_argument("--adaptive-floor", type=int, default=defaults.adaptive_floor,
                       help="smallest K with --adaptive")
    group.add_argument("--hidden", default=defaults.hidden, choices=["post", "pre"],
                       help="target hidden that seeds the MTP head (post final norm: Qwen convention)")
    if not forced_rates:
        return
    group.add_argument("--forced-rates", type=parse_rates, default=None,
                       help="testing/benchmarking: forced-acceptance drafter with these per-depth rates (the "
                            "last one holds for deeper drafts; rates beyond K are unused)")


def check_spec_flags(args) -> None:
    """The speculative flags' values checked when nothing speculates too (a bad --p-min is
    an error, not ignored), against the largest K."""
    SpecOptions(k=MAX_DRAFT, rollback=args.rollback, p_min=args.p_min, adaptive=args.adaptive,
                adaptive_floor=args.adaptive_floor, hidden=args.hidden)


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("constraints (the output must match; needs llguidance)")
    one_of = group.add_mutually_exclusive_group()
    one_of.add_argument("--json-schema", type=os.path.expanduser, metavar="FILE_OR_JSON", help="a JSON schema: a .json file or JSON text")
    one_of.add_argument("--constrain-json", action="store_true", help="any JSON object")
    one_of.add_argument("--regex", help="a regular expression (Rust regex syntax) the whole output matches")
    one_of.add_argument("--grammar", type=os.path.expanduser, metavar="FILE.lark", help="a Lark grammar file (llguidance's Lark dialect)")
    one_of.add_argument("--choice", metavar="A,B,C", help="exactly one of these comma-separated strings")


def constraint_from_args(eng, args):
    """The Constraint the generate flags ask for (None without one); errors name the flag."""
    from pathlib import Path

    if getattr(args, "json_schema", None) is not None:
        schema = args.json_schema
        if not schema.strip():
            raise ValueError("--json-schema: the value is empty: give a schema file or JSON text")
        if not schema.strip().startswith(("{", "[")) and schema.strip() not in ("true", "false"):
            if Path(schema).is_dir():
                raise ValueError(f"--json-schema: {schema!r} is a directory, not a schema file")
            if not Path(schema).is_file():
                raise ValueError(f"--json-schema: {schema!r} is neither JSON text nor an existing file")
            schema = Path(schema)  # the library reads it (a str would be taken as JSON text)
        return eng.constraint("json_schema", schema, arg="--json-schema")
    if getattr(args, "constrain_json", False):
        return eng.constraint("json_object", arg="--constrain-json")
    if getattr(args, "regex", None) is not None:
        return eng.constraint("regex", args.regex, arg="--regex")
    if getattr(args, "grammar", None) is not None:
        from hyspec.config import read_text_file

        text = read_text_file(args.grammar, "--grammar")
        return eng.constraint("grammar", text, arg=f"--grammar {args.grammar}")
    if getattr(args, "choice", None) is not None:
        return eng.constraint("choice", [c for c in args.choice.split(",")], arg="--choice")
    return None


def fork_telemetry(eng):
    """The pipeline driver's optimistic-fork telemetry (hyspec/parallel/fork.py
    ForkTelemetry) when --optimistic is on, else None."""
    backend = getattr(eng, "backend", None)
    if not getattr(eng, "optimistic", False) or not hasattr(backend, "driver"):
        return None
    return backend.driver.fork_tel


def decode_rate(stats: dict) -> str:
    return f"{stats['decode_tok_s']:.1f} tok/s" if stats.get("decode_tok_s") else "n/a"


def speed_lines(stats: dict) -> list[str]:
    """A generation's figures as `hyspec generate` prints them after one prompt (and `hyspec
    chat --verbose` after each reply): tokens, prefill, decode rate; the speculative loop's
    telemetry when it drafted."""
    lines = [f"[{stats['generated_tokens']} tokens, prefill {stats['prefill_s']*1e3:.0f} ms, "
             f"decode {decode_rate(stats)}]"]
    if "spec" in stats:
        from hyspec.speculative.telemetry import SpecTelemetry

        lines.append(SpecTelemetry.from_dict(stats["spec"]).summary_line())
    return lines


def load_engine(args):
    """The Engine of --model / --dtype / --device (the pipeline driver's under --pp)."""
    import torch

    from hyspec import parallel
    from hyspec.engine import Engine

    if parallel.ACTIVE is not None:  # a --pp run: this process is the pipeline driver (the last stage)
        eng = parallel.active_engine(args.model, dtype=args.dtype, device=args.device,
                                     ssm_dtype=getattr(args, "ssm_dtype", None))
        eng.lanes = getattr(args, "lanes", 1)
        eng.optimistic = getattr(args, "optimistic", False)
    else:
        if getattr(args, "optimistic", False):
            raise ValueError("--optimistic forks pipeline stages: it needs --pp N with N >= 2")
        eng = Engine.load(args.model, dtype=args.dtype, device=args.device, ssm_dtype=getattr(args, "ssm_dtype", None))
    if eng.model.device.type == "cpu" and sum(p.numel() for p in eng.model.parameters()) < 50_000_000:
        torch.set_num_threads(1)  # small matrices: extra threads only add synchronisation cost
    return eng


def print_logprob_table(eng, tokens, entries, top: int, prefix: str = "") -> None:
    """One row per token: its position, the token, its log-probability and the top
    alternatives (entries: (logprob, [(id, logprob), ...]) per token). `hyspec score
    --top-logprobs` and `hyspec generate --logprobs` print this."""
    def show(token_id: int) -> str:
        s = repr(eng.tokenizer.decode([token_id])) if eng.tokenizer is not None else str(token_id)
        return s if len(s) <= 14 else s[:13] + "~"

    entries = list(entries)
    top = min(top, max((len(alts) for _, alts in entries), default=top))  # a vocabulary smaller than N lists all
    print(f"{prefix}{'pos':>5}  {'token':<14} {'logprob':>8}" + (f"   top {top} (token logprob)" if top else ""))
    pad = " " * len(prefix)
    for j, (tok, (logprob, alts)) in enumerate(zip(tokens, entries), start=1):
        alternatives = "  ".join(f"{show(a)} {v:.2f}" for a, v in alts)
        print(f"{pad}{j:>5}  {show(tok):<14} {logprob:>8.3f}   {alternatives}".rstrip())


def tool_main(prog: str, body, argv=None) -> int:
    """Run a module tool's `body(argv)` (`python -m hyspec.train.corpus`, ...) with the CLI's
    error form: a bad value or file is one `PROG: error: ...` line and exit code 2, no
    traceback."""
    import sys

    try:
        return body(argv)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
