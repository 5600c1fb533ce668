"""`hyspec` command line: generate, score, replay, make-tiny, bench, train, serve, chat.

Thin by design: parse, call the engine, print. Sampling and drafter flags are derived
from the SamplingParams / SpecOptions dataclasses, so defaults cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

from hyspec.config import DTYPE_NAMES
from hyspec.sampling import ParamError, SamplingParams
from hyspec.speculative.loop import MAX_DRAFT, SpecOptions


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help shows its default (unless the help already says it)."""

    def _get_help_string(self, action):
        return action.help if "(default:" in (action.help or "") else super()._get_help_string(action)


_SAMPLING_HELP = {
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
}


def _ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {s!r}") from None


def _rates(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates like 0.9,0.8,0.7, got {s!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                   help="weight dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    for f in dataclasses.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "mode":
            g.add_argument("--sampling-mode", dest="mode", default="rejection", choices=["rejection", "coupled"],
                           help=_SAMPLING_HELP["mode"])
            continue
        default = 0.0 if f.name == "temperature" else f.default
        g.add_argument(flag, dest=f.name, type=type(f.default), default=default, help=_SAMPLING_HELP.get(f.name))


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    d = SpecOptions()
    g.add_argument("--draft", type=int, default=0, help=f"drafts per round K (0 = plain decoding, 1..{MAX_DRAFT})")
    g.add_argument("--rollback", default=d.rollback, choices=["checkpoint", "rescan", "replay"],
                   help="how linear-attention state is rolled back after a partial accept")
    g.add_argument("--p-min", type=float, default=d.p_min, help="stop drafting below this draft probability")
    g.add_argument("--adaptive", action="store_true", help="next K = clamp(accepted + 1, floor, K)")
    g.add_argument("--adaptive-floor", type=int, default=d.adaptive_floor, help="smallest K with --adaptive")
    g.add_argument("--hidden", default=d.hidden, choices=["post", "pre"],
                   help="target hidden that seeds the MTP head (post final norm: Qwen convention)")
    g.add_argument("--forced-rates", type=_rates, default=None,
                   help="testing/benchmarking: forced-acceptance drafter with these per-depth rates")


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constraints (the output must match; needs llguidance)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE_OR_JSON", help="a JSON schema: a .json file or JSON text")
    x.add_argument("--constrain-json", action="store_true", help="any JSON object")
    x.add_argument("--regex", help="a regular expression (Rust regex syntax) the whole output matches")
    x.add_argument("--grammar", metavar="FILE.lark", help="a Lark grammar file (llguidance's Lark dialect)")
    x.add_argument("--choice", metavar="A,B,C", help="exactly one of these comma-separated strings")


def constraint_from_args(eng, args):
    """The Constraint the generate flags ask for (None without one); errors name the flag."""
    from pathlib import Path

    if getattr(args, "json_schema", None) is not None:
        return eng.constraint("json_schema", args.json_schema, arg="--json-schema")
    if getattr(args, "constrain_json", False):
        return eng.constraint("json_object", arg="--constrain-json")
    if getattr(args, "regex", None) is not None:
        return eng.constraint("regex", args.regex, arg="--regex")
    if getattr(args, "grammar", None) is not None:
        p = Path(args.grammar)
        if not p.is_file():
            raise ValueError(f"--grammar: no such file {args.grammar!r}")
        return eng.constraint("grammar", p.read_text(encoding="utf-8"), arg=f"--grammar {args.grammar}")
    if getattr(args, "choice", None) is not None:
        return eng.constraint("choice", [c for c in args.choice.split(",")], arg="--choice")
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (plain or speculative)", formatter_class=HelpFormatter,
                       description="Generate a completion: the prompt, then the text as rounds commit.\n"
                                   "prompt + new tokens must fit in the model's context (max_position_embeddings);\n"
                                   "--max-new-tokens beyond it is capped (stop_reason 'context').")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    src.add_argument("--prompts-file", help="JSONL, one request per line: {\"prompt\": ...} or {\"prompt_ids\": [...]}, "
                     "optional max_new_tokens, draft and sampling fields (temperature, seed, top_p, ...); "
                     "one JSON result per line, in input order")
    g.add_argument("--out", default=None, help="with --prompts-file: write the results here instead of stdout")
    g.add_argument("--max-batch", type=int, default=16, help="with --prompts-file: sequences decoded together")
    g.add_argument("--max-new-tokens", type=int, default=64, help="token limit (capped at the model's context)")
    g.add_argument("--stop-ids", type=_ids, default=None, help="extra stop token ids")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop on the checkpoint's EOS ids")
    g.add_argument("--num-samples", type=int, default=1, help="independent completions (seeds derived from --seed)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: split the layers over this many processes (GPUs); see docs/multi-gpu.md")
    g.add_argument("--lanes", type=int, default=1,
                   help="with --pp and several requests (--prompts-file, --num-samples): batch groups that alternate "
                        "through the stages, so each stage works on one while the next works on another")
    g.add_argument("--optimistic", action="store_true",
                   help="with --pp: while the last stage resolves a round, the first stages already run the "
                        "next round's verify on a guess (every draft accepted, the bonus guessed by the drafter); "
                        "used when the guess was right, rolled back otherwise (output unchanged). Pauses after "
                        "3 misses in a row; telemetry on stderr / in --json stats['fork'] (docs/multi-gpu.md)")
    g.add_argument("--no-stream", action="store_true",
                   help="print the text when generation ends instead of as it is generated")
    _add_sampling_args(g)
    _add_spec_args(g)
    _add_constraint_args(g)

    s = sub.add_parser("score", help="per-token log-probabilities of a text", formatter_class=HelpFormatter)
    _add_model_args(s)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to score (with the checkpoint's tokenizer)")
    src.add_argument("--ids", type=_ids, help="token ids to score, comma-separated")
    s.add_argument("--top-logprobs", type=int, default=0,
                   help="also show the N most likely tokens at each position (a table; 0 = off)")

    r = sub.add_parser("replay", help="teacher-forced MTP acceptance over a text file", formatter_class=HelpFormatter)
    _add_model_args(r)
    r.add_argument("--text-file", required=True, help="UTF-8 text file to replay (required)")
    r.add_argument("--k", type=int, default=4, help="deepest draft depth measured")
    r.add_argument("--stride", type=int, default=1, help="draft from every N-th position")
    r.add_argument("--chunk", type=int, default=512, help="target forward chunk length")
    r.add_argument("--hidden", default="post", choices=["post", "pre"], help="target hidden that seeds the MTP head")
    r.add_argument("--max-tokens", type=int, default=None, help="only the first N tokens of the file (None: all)")

    t = sub.add_parser("make-tiny", help="write a random tiny checkpoint (with mtp.* weights and a tokenizer)",
                       formatter_class=HelpFormatter)
    t.add_argument("--arch", required=True, choices=["qwen3_next", "qwen3_5", "qwen3_5_moe"],
                   help="model family (required)")
    t.add_argument("--out", required=True, help="output directory (required)")
    t.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    t.add_argument("--vocab-size", type=int, default=512, help="vocabulary size (>= 300: with a tokenizer.json)")
    t.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    t.add_argument("--layers", type=int, default=4, help="decoder layers")
    t.add_argument("--init-std", type=float, default=0.02, help="weight scale (larger = more peaked logits)")
    t.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* weights")
    t.add_argument("--draft-vocab", type=int, default=0, help="also write a reduced draft vocabulary (mtp.d2t) of N ids")
    t.add_argument("--fp8", action="store_true",
                   help="block-FP8 weights like Qwen's -FP8 checkpoints (float8_e4m3fn + weight_scale_inv, "
                        "quantization_config in config.json)")
    t.add_argument("--fp8-block", default="128,128", help="weight_block_size for --fp8, as ROWS,COLS")
    t.add_argument("--experts", default="stacked", choices=["stacked", "per_expert"],
                   help="MoE expert layout: stacked gate_up_proj/down_proj or per-expert keys")

    sub.add_parser("bench", help="speed benchmark (see `hyspec bench --help`)", add_help=False)
    sub.add_parser("train", help="train the small default model (see `hyspec train --help`)", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `hyspec serve --help`)", add_help=False)
    sub.add_parser("chat", help="interactive chat with a kept session state (see `hyspec chat --help`)",
                   add_help=False)
    return ap


def _load(args):
    import torch

    from hyspec.engine import Engine

    from hyspec import parallel

    if parallel.ACTIVE is not None:  # a --pp run: this process is the pipeline driver (the last stage)
        eng = parallel.active_engine(args.model, dtype=args.dtype, device=args.device)
        eng.lanes = getattr(args, "lanes", 1)
        eng.optimistic = getattr(args, "optimistic", False)
    else:
        if getattr(args, "optimistic", False):
            raise ValueError("--optimistic forks pipeline stages: it needs --pp N with N >= 2")
        eng = Engine.load(args.model, dtype=args.dtype, device=args.device)
    if eng.model.device.type == "cpu" and sum(p.numel() for p in eng.model.parameters()) < 50_000_000:
        torch.set_num_threads(1)  # small matrices: extra threads only add synchronisation cost
    return eng


_LINE_KEYS = {"prompt", "prompt_ids", "max_new_tokens", "draft"} | {f.name for f in dataclasses.fields(SamplingParams)}


def _read_prompts_file(path: str, args) -> list[dict]:
    """Parse and check every line before anything runs; errors name the line."""
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)}
    reqs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            unknown = sorted(set(obj) - _LINE_KEYS)
            if unknown:
                raise ValueError(f"{path}:{n}: unknown field(s) {unknown}; known: {sorted(_LINE_KEYS)}")
            if ("prompt" in obj) == ("prompt_ids" in obj):
                raise ValueError(f"{path}:{n}: give exactly one of \"prompt\" or \"prompt_ids\"")
            try:
                params = SamplingParams(**{**base, **{k: v for k, v in obj.items() if k in base}})
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            mnt, k = obj.get("max_new_tokens", args.max_new_tokens), obj.get("draft", args.draft)
            for name, v in (("max_new_tokens", mnt), ("draft", k)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"{path}:{n}: {name} must be an integer >= 0, got {v!r}")
            reqs.append({"prompt": obj.get("prompt", obj.get("prompt_ids")), "max_new_tokens": mnt,
                         "params": params, "draft": k, "line": n})
    if not reqs:
        raise ValueError(f"{path}: no requests in the file")
    return reqs


def _cmd_generate_file(args) -> int:
    from tqdm import tqdm

    reqs = _read_prompts_file(args.prompts_file, args)
    spec = None
    if any(r["draft"] > 0 for r in reqs):
        spec = SpecOptions(k=max(r["draft"] for r in reqs), rollback=args.rollback, p_min=args.p_min,
                           adaptive=args.adaptive, hidden=args.hidden)
    eng = _load(args)
    constraint = constraint_from_args(eng, args)  # one constraint for every line (each its own clone)
    sink = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    done: dict[int, object] = {}
    written = 0
    bar = tqdm(total=len(reqs), desc="generate", unit="req", file=sys.stderr, disable=None)

    def finished(i, out) -> None:  # write results in input order as soon as the prefix is complete
        nonlocal written
        done[i] = out
        bar.update(1)
        while written in done:
            o = done.pop(written)
            row = {"index": written, "tokens": o.tokens, "text": o.text, "stop_reason": o.samples[0].stop_reason,
                   "stats": o.stats}
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            written += 1

    try:
        eng.generate_batch([r["prompt"] for r in reqs], max_new_tokens=[r["max_new_tokens"] for r in reqs],
                           params=[r["params"] for r in reqs], draft=[r["draft"] for r in reqs], spec=spec,
                           stop_ids=args.stop_ids, ignore_eos=args.ignore_eos, max_batch=args.max_batch,
                           on_finish=finished, constraint=constraint)
    finally:
        bar.close()
        if args.out:
            sink.close()
    fork = _fork_stats(eng)
    if fork is not None:
        print(fork.summary_line(), file=sys.stderr)
    return 0


def _fork_stats(eng):
    """The pipeline driver's optimistic-fork telemetry (hyspec/parallel/fork.py) when
    --optimistic is on, else None."""
    backend = getattr(eng, "backend", None)
    if not getattr(eng, "optimistic", False) or not hasattr(backend, "driver"):
        return None
    return backend.driver.fork_tel


class _Printer:
    """Prints each sample as its tokens arrive: the prompt first, then the completion.

    Incremental detokenisation: the text of the tokens since `start` is decoded again
    and only what is new beyond the last printed token is written; while the text ends
    in an incomplete UTF-8 sequence (U+FFFD) nothing is written, so byte tokens that
    make up one character come out together."""

    def __init__(self, eng, prompt_ids: list[int], prompt_text: str | None, num_samples: int, out=None) -> None:
        self.eng, self.n, self.out = eng, num_samples, out or sys.stdout
        self.tok = eng.tokenizer
        self.prompt = prompt_text if prompt_text is not None else (
            self.tok.decode(prompt_ids) if self.tok is not None else ",".join(map(str, prompt_ids)) + " |")
        self.cur = -1

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _start(self, i: int) -> None:
        if self.cur >= 0:
            self._flush(final=True)
            self._write("\n")
        self.cur, self.ids, self.start, self.done = i, [], 0, 0
        if self.n > 1:
            self._write(f"--- sample {i} ---\n")
        self._write(self.prompt)

    def _flush(self, final: bool) -> None:
        if self.tok is None:
            new = self.ids[self.done:]
            if new:
                self._write(" " + ",".join(map(str, new)) if self.done == 0 else "," + ",".join(map(str, new)))
            self.done = len(self.ids)
            return
        if self.done == len(self.ids):
            return
        before = self.tok.decode(self.ids[self.start : self.done])
        text = self.tok.decode(self.ids[self.start :])
        if text.endswith("\ufffd") and not final:
            return  # part of a character: wait for the rest of its bytes
        if len(text) >= len(before) and text.startswith(before):
            self._write(text[len(before):])
            self.start, self.done = self.done, len(self.ids)
        elif final:
            self._write(text)
            self.done = len(self.ids)

    def __call__(self, i: int, tokens: list[int]) -> None:
        while self.cur < i:
            self._start(self.cur + 1)
        self.ids.extend(tokens)
        self._flush(final=False)

    def finish(self) -> None:
        while self.cur < self.n - 1:
            self._start(self.cur + 1)
        self._flush(final=True)
        self._write("\n")


def _cmd_generate(args) -> int:
    if args.prompts_file is not None:
        return _cmd_generate_file(args)
    if args.prompt is None and args.prompt_ids is None:
        raise ValueError("give --prompt TEXT, --prompt-ids 1,2,3 or --prompts-file FILE.jsonl")
    if args.draft < 0 or args.draft > MAX_DRAFT:
        raise ValueError(f"--draft must be in 0..{MAX_DRAFT} (0 = plain decoding), got {args.draft}")
    params = SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)})
    spec = None
    if args.draft > 0:
        spec = SpecOptions(k=args.draft, rollback=args.rollback, p_min=args.p_min, adaptive=args.adaptive,
                           adaptive_floor=min(args.adaptive_floor, args.draft), hidden=args.hidden,
                           forced_rates=args.forced_rates)
    elif args.forced_rates is not None:
        raise ValueError("--forced-rates needs --draft K > 0")
    eng = _load(args)
    constraint = constraint_from_args(eng, args)  # a bad constraint fails here, before any generation
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    printer = None
    if not args.json:
        printer = _Printer(eng, eng.encode(prompt), args.prompt, args.num_samples)
    # samples decode together in one batch, so their tokens interleave: stream only a single sample
    stream = printer is not None and not args.no_stream and args.num_samples == 1
    out = eng.generate(prompt, max_new_tokens=args.max_new_tokens, params=params, draft=args.draft, spec=spec,
                       stop_ids=args.stop_ids, ignore_eos=args.ignore_eos, num_samples=args.num_samples,
                       on_tokens=printer if stream else None, constraint=constraint)
    fork = _fork_stats(eng)
    if fork is not None:
        out.stats["fork"] = fork.to_dict()
    if args.json:
        print(json.dumps(out.to_dict()))
        return 0
    if not stream:
        for i, smp in enumerate(out.samples):
            printer(i, smp.tokens)
    printer.finish()
    st = out.stats
    rate = f"{st['decode_tok_s']:.1f} tok/s" if st.get("decode_tok_s") else "n/a"
    per = f" over {st['num_samples']} samples" if st["num_samples"] > 1 else ""
    print(f"[{st['generated_tokens']} tokens{per}, prefill {st['prefill_s']*1e3:.0f} ms, decode {rate}]",
          file=sys.stderr)
    if "max_new_tokens_capped_to" in st:
        print(f"[--max-new-tokens {args.max_new_tokens} capped to {st['max_new_tokens_capped_to']}: prompt + "
              f"completion must fit in the model's context of {st['context_length']} tokens]", file=sys.stderr)
    if "spec" in st:
        from hyspec.speculative.telemetry import SpecTelemetry

        print(SpecTelemetry.from_dict(st["spec"]).summary_line(), file=sys.stderr)
    if fork is not None:
        print(fork.summary_line(), file=sys.stderr)
    return 0


def _cmd_score(args) -> int:
    eng = _load(args)
    res = eng.score(args.text if args.text is not None else args.ids, top_logprobs=args.top_logprobs)
    if args.json:
        print(json.dumps(res))
        return 0
    if args.top_logprobs:
        def show(t: int) -> str:
            s = repr(eng.tokenizer.decode([t])) if eng.tokenizer is not None else str(t)
            return s if len(s) <= 14 else s[:13] + "~"

        print(f"{'pos':>5}  {'token':<14} {'logprob':>8}   top {args.top_logprobs} (token logprob)")
        for i, (lp, top) in enumerate(zip(res["logprobs"], res["top_logprobs"]), start=1):
            alts = "  ".join(f"{show(e[0])} {e[1]:.2f}" for e in top)
            print(f"{i:>5}  {show(res['tokens'][i]):<14} {lp:>8.3f}   {alts}")
    print(f"{res['scored_tokens']} tokens  NLL {res['nll']:.3f}  mean {res['mean_nll']:.4f}  "
          f"perplexity {res['perplexity']:.3f}")
    return 0


def _progress_bar(done: int, total: int, _state={"t": 0.0}) -> None:
    now = time.time()
    if done < total and now - _state["t"] < 0.2:
        return
    _state["t"] = now
    width = 30
    fill = int(width * done / max(total, 1))
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total}", end="" if done < total else "\n",
          file=sys.stderr, flush=True)


def _cmd_replay(args) -> int:
    from hyspec.speculative.replay import replay_acceptance

    if os.path.isdir(args.text_file):
        raise ValueError(f"--text-file {args.text_file} is a directory: give a text file")
    if not os.path.isfile(args.text_file):
        raise ValueError(f"--text-file {args.text_file} does not exist")
    eng = _load(args)
    try:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--text-file {args.text_file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    ids = eng.encode(text)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    if len(ids) > eng.context_length:
        raise ValueError(f"--text-file {args.text_file} has {len(ids)} tokens, more than the model's context of "
                         f"{eng.context_length} tokens: replay a prefix with --max-tokens {eng.context_length}")
    res = replay_acceptance(eng.model, ids, k=args.k, stride=args.stride, chunk=args.chunk, hidden=args.hidden,
                            progress=None if args.json else _progress_bar)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['tokens']} tokens, target perplexity {res['perplexity']:.3f}; "
          f"{res['positions']} draft positions (stride {res['stride']}, K={res['k']})")
    print("depth                      " + "".join(f"{d + 1:>8}" for d in range(res["k"])))
    for label, r in (("accepted vs text", res), ("accepted vs target greedy", res["vs_target"])):
        print(f"{label:<27}" + "".join(f"{x:8.3f}" for x in r["accept_rate_at"]))
        print(f"{'  acceptance length, K=d':<27}" + "".join(f"{x:8.3f}" for x in r["acceptance_length"]))
    return 0


def _cmd_make_tiny(args) -> int:
    from hyspec.tiny import make_tiny

    out = make_tiny(args.arch, args.out, seed=args.seed, vocab_size=args.vocab_size, hidden=args.hidden_size,
                    layers=args.layers, std=args.init_std, with_mtp=not args.no_mtp,
                    draft_vocab=args.draft_vocab, fp8=args.fp8,
                    fp8_block=tuple(int(x) for x in args.fp8_block.split(",")), experts=args.experts)
    print(f"wrote {args.arch} {'FP8 ' if args.fp8 else ''}checkpoint to {out}")
    return 0


# Python argument / option names -> the flags a user types
_FLAGS = {"mode": "--sampling-mode", "k": "--draft", "prompt": "--prompt / --prompt-ids"}


def _flag(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _error_message(e: Exception) -> str:
    if isinstance(e, ParamError):
        return f"argument {_flag(e.field)}: {e.why} (got {e.value!r})"
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.strerror}: {e.filename}"
    return str(e)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"hyspec: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point. User errors (bad values, missing files) end in one `hyspec CMD:
    error: ...` line and exit code 2, never a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else None
    old_format = warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        if cmd in ("generate", "bench", "serve") and "--pp" in " ".join(argv):
            from hyspec import parallel

            pp = parallel.pp_from_argv(argv)
            if pp > 1 and parallel.ACTIVE is None and cmd != "bench":  # the pipeline bench starts its own ranks
                return parallel.run_cli(argv, pp, main)
        if cmd == "bench":
            from hyspec.bench import main as bench_main

            return bench_main(argv[1:])
        if cmd == "train":
            from hyspec.train.train import main as train_main

            return train_main(argv[1:])
        if cmd == "serve":
            from hyspec.server import main as serve_main

            return serve_main(argv[1:])
        if cmd == "chat":
            from hyspec.chat import main as chat_main

            return chat_main(argv[1:])
        args = build_parser().parse_args(argv)
        handlers = {"generate": _cmd_generate, "score": _cmd_score, "replay": _cmd_replay,
                    "make-tiny": _cmd_make_tiny}
        return handlers[args.cmd](args)
    except (ValueError, OSError, ImportError) as e:
        print(f"hyspec {cmd}: error: {_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nhyspec: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = old_format


if __name__ == "__main__":
    sys.exit(main())
