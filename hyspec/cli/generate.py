"""`hyspec generate`: one prompt (streamed as rounds commit) or a JSONL file of requests
decoded together (`--prompts-file`, one JSON result per line in input order).

Ctrl-C: one prompt stops after the round in flight and its output is written as usual
(stop_reason "cancelled"; a second Ctrl-C stops at once); a prompts file writes the lines
finished so far. Either exits 130."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time

from hyspec.cli.common import (
    HelpFormatter,
    add_constraint_args,
    add_model_args,
    add_sampling_args,
    add_spec_args,
    check_out_file,
    check_spec_flags,
    constraint_from_args,
    decode_rate,
    fork_telemetry,
    load_engine,
    parse_ids,
    print_logprob_table,
    speed_lines,
)
from hyspec.config import no_mtp_error
from hyspec.core.scheduler import check_prompt, check_stop
from hyspec.engine import stop_list
from hyspec.interrupt import stop_on_ctrl_c
from hyspec.sampling import ParamError, SamplingParams
from hyspec.speculative.loop import MAX_DRAFT, SpecOptions


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text (plain or speculative)", formatter_class=HelpFormatter,
                       description="Generate a completion: the prompt, then the text as rounds commit.\n"
                                   "prompt + new tokens must fit in the model's context (max_position_embeddings);\n"
                                   "--max-new-tokens beyond it is capped (stop_reason 'context').")
    add_model_args(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", type=parse_ids, help="prompt token ids, comma-separated")
    source.add_argument("--prompts-file", type=os.path.expanduser, help="JSONL, one request per line: {\"prompt\": ...}, "
                        "{\"prompt_ids\": [...]} or {\"messages\": [...]} (a chat request: rendered with the chat "
                        "template; optional tools, tool_choice, parallel_tool_calls, chat_template_kwargs; the "
                        "result gets the reply as \"message\"), optional max_new_tokens, draft, logprobs, stop, "
                        "sampling fields (temperature, seed, top_p, ...) and one constraint (json_schema, "
                        "json_object: true, regex, grammar: Lark text, choice: [...]); one JSON result per line, in "
                        "input order")
    p.add_argument("--out", default=None, type=os.path.expanduser, help="with --prompts-file: write the results here instead of stdout")
    p.add_argument("--max-batch", type=int, default=16, help="with --prompts-file: sequences decoded together")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token limit (capped at the model's context)")
    p.add_argument("--stop-ids", type=parse_ids, default=None, help="extra stop token ids")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeatable): a sample ends at the token that completes it, its text "
                        "before it (stop_reason 'stop'; the text is printed once the sample ends)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop on the checkpoint's EOS ids")
    p.add_argument("--num-samples", type=int, default=1, help="independent completions (seeds derived from --seed)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: split the layers over this many processes (GPUs); see docs/multi-gpu.md")
    p.add_argument("--lanes", type=int, default=1,
                   help="with --pp and several requests (--prompts-file, --num-samples): batch groups that alternate "
                        "through the stages, so each stage works on one while the next works on another")
    p.add_argument("--optimistic", action="store_true",
                   help="with --pp: while the last stage resolves a round, the first stages already run the "
                        "next round's verify on a guess (every draft accepted, the bonus guessed by the drafter); "
                        "used when the guess was right, rolled back otherwise (output unchanged). Pauses after "
                        "3 misses in a row; telemetry on stderr / in --json stats['fork'] (docs/multi-gpu.md)")
    p.add_argument("--no-stream", action="store_true",
                   help="print the text when generation ends instead of as it is generated")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each generated token's log-probability (the model's raw distribution, before temperature "
                        "and filters) and its N most likely alternatives: a table after the text, or 'logprobs' / "
                        "'top_logprobs' in --json and --prompts-file results (a line may set its own)")
    add_sampling_args(p)
    add_spec_args(p)
    add_constraint_args(p)


# ---------------------------------------------------------------------------- --prompts-file
CHAT_KEYS = {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}  # with "messages" only
# a line's own constraint (at most one; it replaces the flag's for that line): the Python kinds,
# each with the value Engine.constraint takes ("json_object": true; "grammar": Lark text, not a file)
CONSTRAINT_KEYS = ("json_schema", "json_object", "regex", "grammar", "choice")
LINE_KEYS = {"prompt", "prompt_ids", "messages", "max_new_tokens", "draft", "logprobs", "stop"} | CHAT_KEYS | {
    f.name for f in dataclasses.fields(SamplingParams)} | set(CONSTRAINT_KEYS)


def _line_constraint(obj: dict, where: str, checked: set[str]):
    """(kind, value) of a line's own constraint, checked without the model (each distinct one
    once: `checked` holds those seen); None without one."""
    kinds = [k for k in CONSTRAINT_KEYS if k in obj]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise ValueError(f"{where}: one constraint per line, got {kinds}")
    kind, value = kinds[0], obj[kinds[0]]
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{where}: \"json_object\" must be true (any JSON object), got {value!r}")
        value = None
    key = json.dumps([kind, value])  # (not sort_keys: a schema's property order is its output's)
    if key not in checked:
        from hyspec.constraints import grammar_for

        try:
            grammar_for(kind, value, arg=f'"{kind}"')  # (the value's shape: a schema, non-empty strings, ...)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        checked.add(key)
    return kind, value


def read_prompts_file(path: str, args) -> list[dict]:
    """Parse and check every line before anything runs; errors name the line."""
    import os

    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)}
    requests, checked = [], set()  # (checked: the lines' distinct constraints, each validated once)
    if path != "-" and (not os.path.exists(path) or os.path.isdir(path)):  # (a pipe or /dev/stdin is fine)
        raise ValueError(f"--prompts-file {path}: " + ("is a directory" if os.path.isdir(path) else "no such file"))
    if path == "-" and (sys.stdin is None or sys.stdin.closed):
        raise ValueError("--prompts-file -: standard input is closed")
    with (open(sys.stdin.fileno(), "rb", closefd=False) if path == "-" else open(path, "rb")) as f:
        # lines end in \n, \r\n or \r, as text mode reads them (a JSON string's raw U+2028 ends none)
        for line_no, raw in enumerate(f.read().splitlines(), 1):
            try:  # (the first line may open with a BOM: editors on Windows write one)
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text ({e.reason} at byte {e.start + 1} of the line)") \
                    from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            except ValueError as e:  # (an integer past Python's 4,300-digit limit)
                raise ValueError(f"{path}:{line_no}: not valid JSON here ({e})") from None
            except RecursionError:
                raise ValueError(f"{path}:{line_no}: not valid JSON here (nested too deeply)") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
            unknown = sorted(set(obj) - LINE_KEYS)
            if unknown:
                raise ValueError(f"{path}:{line_no}: unknown field(s) {unknown}; known: {sorted(LINE_KEYS)}")
            if sum(k in obj for k in ("prompt", "prompt_ids", "messages")) != 1:
                raise ValueError(f"{path}:{line_no}: give exactly one of \"prompt\", \"prompt_ids\" or \"messages\"")
            chat_only = sorted(CHAT_KEYS & set(obj))
            if chat_only and "messages" not in obj:
                raise ValueError(f"{path}:{line_no}: {chat_only} go with \"messages\" (a chat request)")
            if obj.get("chat_template_kwargs") is not None and not isinstance(obj["chat_template_kwargs"], dict):
                raise ValueError(f"{path}:{line_no}: \"chat_template_kwargs\" must be an object or null")
            if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
                raise ValueError(f"{path}:{line_no}: \"prompt\" must be a non-empty string, got {obj['prompt']!r}")
            ids = obj.get("prompt_ids")
            if "prompt_ids" in obj and not (isinstance(ids, list) and ids and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                raise ValueError(f"{path}:{line_no}: \"prompt_ids\" must be a non-empty list of integer token ids, "
                                 f"got {ids!r}")
            try:
                params = SamplingParams(**{**base, **{k: v for k, v in obj.items() if k in base}})
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: {e}") from None
            limit, draft = obj.get("max_new_tokens", args.max_new_tokens), obj.get("draft", args.draft)
            for name, value in (("max_new_tokens", limit), ("draft", draft)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{path}:{line_no}: {name} must be an integer >= 0, got {value!r}")
            if draft > MAX_DRAFT:
                raise ValueError(f"{path}:{line_no}: draft must be in 0..{MAX_DRAFT} (0 = plain decoding), got {draft}")
            logprobs = obj.get("logprobs", args.logprobs)
            if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
                raise ValueError(f"{path}:{line_no}: logprobs must be null or an integer >= 0, got {logprobs!r}")
            stop = obj.get("stop", args.stop)
            try:
                stop = stop_list(stop)
            except ParamError as e:  # (stop_list's reason: not strings, or a lone surrogate)
                raise ValueError(f"{path}:{line_no}: \"stop\" {e.shown}: {e.why}") from None
            chat = None
            if "messages" in obj:  # the checks that need no model, before it loads
                from hyspec.chat_template import normalize_messages
                from hyspec.tools import check_tools

                try:
                    normalize_messages(obj["messages"])
                    check_tools(obj.get("tools"), obj.get("tool_choice"), obj.get("parallel_tool_calls"))
                except ValueError as e:
                    raise ValueError(f"{path}:{line_no}: {e}") from None
                chat = {"messages": obj["messages"], "tools": obj.get("tools"), "tool_choice": obj.get("tool_choice"),
                        "parallel_tool_calls": obj.get("parallel_tool_calls"),
                        "template_kwargs": obj.get("chat_template_kwargs")}
            own = _line_constraint(obj, f"{path}:{line_no}", checked)
            requests.append({"prompt": obj.get("prompt", obj.get("prompt_ids")), "max_new_tokens": limit,
                             "params": params, "draft": draft, "logprobs": logprobs, "line": line_no, "chat": chat,
                             "stop": stop, "own_constraint": own,
                             "own": {k for k in ("draft", "stop") if k in obj}})  # (else the flag's value)
    if not requests:
        raise ValueError(f"{path}: no requests in the file")
    return requests


def _common_checks(args) -> None:
    if args.logprobs is not None and args.logprobs < 0:
        raise ValueError(f"--logprobs must be >= 0 (the alternatives listed per token), got {args.logprobs}")
    if args.pp < 1:
        raise ValueError(f"--pp must be >= 1, got {args.pp}")
    if args.lanes < 1:
        raise ValueError(f"--lanes must be >= 1, got {args.lanes}")
    if args.max_batch is not None and args.max_batch < 1:  # (used with --prompts-file; checked always)
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_new_tokens < 0:  # (every line's default: the flag's error, not line 1's)
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.lanes > 1 and args.pp < 2:  # (as --optimistic: not ignored in silence)
        raise ValueError("--lanes alternates batch groups through pipeline stages: it needs --pp N with N >= 2")
    if args.lanes > 1 and getattr(args, "optimistic", False):  # (the fork was switched off in silence)
        raise ValueError("--optimistic does not go with --lanes: the fork runs the pipeline's one lane")


def _same_regular_file(out: str, prompts_file: str) -> bool:
    """Whether --out names the regular file the prompts are read from (standard input's, for
    "-"); a terminal or pipe both read and written is no hazard."""
    import os
    import stat

    try:
        a = os.stat(out)
        b = os.fstat(0) if prompts_file == "-" else os.stat(prompts_file)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _file_options(args):
    """(requests, speculative options) of a --prompts-file run; ValueError on a bad line or option."""
    import os

    _common_checks(args)
    check_spec_flags(args)
    if args.num_samples != 1:
        raise ValueError("--num-samples applies to one --prompt; with --prompts-file repeat a line per sample "
                         "(each with its own seed)")
    if args.forced_rates is not None:  # (its reference is one prompt's plain greedy run)
        raise ValueError("--forced-rates applies to one --prompt (the forced drafter replays that prompt's plain "
                         "greedy continuation); not with --prompts-file")
    if args.pp > 1 and not os.path.isfile(args.prompts_file):  # (the launcher would read a pipe, the ranks find it empty)
        raise ValueError(f"--prompts-file {args.prompts_file}: --pp's ranks each read the file: give a regular file "
                         "(not standard input or a pipe)")
    # the flags' own values, the defaults of every line: a bad one is the flag's error, not a line's
    SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)})
    if args.draft < 0 or args.draft > MAX_DRAFT:
        raise ValueError(f"--draft must be in 0..{MAX_DRAFT} (0 = plain decoding), got {args.draft}")
    if args.out is not None:
        check_out_file(args.out)
        if _same_regular_file(args.out, args.prompts_file):  # (it was emptied before being read)
            raise ValueError(f"--out {args.out} is the --prompts-file: the results would overwrite the prompts; "
                             "give another file")
    requests = read_prompts_file(args.prompts_file, args)
    spec = None
    if any(r["draft"] > 0 for r in requests):
        kmax = max(r["draft"] for r in requests)  # (a line drafting fewer than the floor takes its K as the
        spec = SpecOptions(k=kmax, rollback=args.rollback, p_min=args.p_min,  # floor, whatever the others draft)
                           adaptive=args.adaptive, adaptive_floor=min(args.adaptive_floor, kmax), hidden=args.hidden)
    return requests, spec


def run_file(args) -> int:
    from tqdm import tqdm

    requests, spec = _file_options(args)
    eng = load_engine(args)
    constraint = constraint_from_args(eng, args)  # one constraint for every line (each its own clone)
    built: dict[str, object] = {}  # the lines' own constraints, each distinct one built once
    # the flags' values no model can run: the flag named (no line asked for them)
    if args.draft > 0 and not eng.model.has_mtp and any(r["draft"] and "draft" not in r["own"] for r in requests):
        raise no_mtp_error(f": --draft {args.draft} cannot run; use --draft 0 for plain decoding")
    if args.stop and eng.tokenizer is None and any(r["stop"] and "stop" not in r["own"] for r in requests):
        raise ValueError("--stop: stop strings need the checkpoint's tokenizer.json (use --stop-ids instead)")
    for r in requests:  # every line's ids against the vocabulary before anything runs (encoded once)
        r["constraint"], r["turn"] = constraint, None
        try:
            if r["own_constraint"] is not None:  # the line's own, in place of the flag's
                kind, value = r["own_constraint"]
                key = json.dumps([kind, value])  # (not sort_keys: a schema's property order is its output's)
                if key not in built:
                    built[key] = eng.constraint(kind, value, arg=f'"{kind}"')
                r["constraint"] = built[key]
            if r["chat"] is not None:  # rendered with the chat template, tools checked, as the server does
                r["turn"] = eng.prepare_chat(**r["chat"], constraint=r["constraint"])
                r["prompt"], r["constraint"] = r["turn"].prompt, r["turn"].constraint
            if r["draft"] > 0 and not eng.model.has_mtp:  # (the line's own "draft": the flag's was checked above)
                raise no_mtp_error(f", so it cannot speculate: the line's \"draft\": {r['draft']} (0 decodes plainly)")
            if r["stop"] and eng.tokenizer is None:
                raise ValueError("the line's \"stop\": stop strings need the checkpoint's tokenizer.json (use "
                                 "--stop-ids instead)")
            r["prompt"] = eng.encode(r["prompt"])
            check_prompt(r["prompt"], eng.model.cfg.vocab_size)
            eng._cap(r["prompt"], r["max_new_tokens"])  # the context: too long, or no room left
        except ValueError as e:
            raise ValueError(f"{args.prompts_file}:{r['line']}: {e}") from None
    if args.stop_ids:
        try:
            check_stop(args.stop_ids, eng.model.cfg.vocab_size)
        except ValueError as e:
            raise ValueError(f"--stop-ids: {e}") from None
    stops = set(args.stop_ids or ()) | (set() if args.ignore_eos else set(eng.eos_ids))
    # --out opened at the first result: an error before any (a check of generate_batch's) leaves it as it was
    sink = None if args.out else sys.stdout
    finished_early: dict[int, object] = {}  # outputs that wait for an earlier line to finish
    failed: list[int] = []  # lines whose request ended in error (each written with its "error")
    written = 0
    bar = tqdm(total=len(requests), desc="generate", unit="req", file=sys.stderr, disable=None)

    def open_out():
        try:
            return open(args.out, "w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--out {args.out}: cannot write it ({e.strerror or e})") from None

    def write(i, output) -> None:
        nonlocal sink
        row = {"index": i, "line": requests[i]["line"], "tokens": output.tokens, "text": output.text,
               "stop_reason": output.samples[0].stop_reason, "stats": output.stats}
        if "error" in output.stats:  # this line's own failure (its constraint could not go on)
            row["error"] = output.stats["error"]
            failed.append(requests[i]["line"])
        turn = requests[i]["turn"]
        if turn is not None:
            cut = requests[i]["stop"] if row["stop_reason"] == "stop" else ()
            row["message"] = turn.message(output.tokens, stops, cut)
        if output.logprobs is not None:
            d = output.to_dict()
            row["logprobs"], row["top_logprobs"] = d["logprobs"], d["top_logprobs"]
        if sink is None:
            sink = open_out()
        try:
            # (on a terminal the bar on stderr is cleared for a line to stdout, then drawn under it: the line
            # was glued to the bar's text)
            with tqdm.external_write_mode(file=sink) if sink is sys.stdout else contextlib.nullcontext():
                sink.write(json.dumps(row) + "\n")
                sink.flush()
        except OSError as e:  # (a full disk: "[Errno 28] No space left on device" named no file)
            if sink is sys.stdout:
                raise
            raise ValueError(f"--out {args.out}: cannot write it ({e.strerror or e})") from None

    def finished(i, out) -> None:  # write results in input order as soon as the prefix is complete
        nonlocal written
        if str(out.stats.get("error", "")).startswith("KeyboardInterrupt"):
            return  # cut off by Ctrl-C: not a result (nor a failure of the line's own)
        finished_early[i] = out
        bar.update(1)
        while written in finished_early:
            write(written, finished_early.pop(written))
            written += 1

    try:
        eng.generate_batch([r["prompt"] for r in requests], max_new_tokens=[r["max_new_tokens"] for r in requests],
                           params=[r["params"] for r in requests], draft=[r["draft"] for r in requests], spec=spec,
                           stop_ids=args.stop_ids, ignore_eos=args.ignore_eos, max_batch=args.max_batch,
                           on_finish=finished, constraint=[r["constraint"] for r in requests],
                           logprobs=[r["logprobs"] for r in requests], stop=[r["stop"] for r in requests])
    except KeyboardInterrupt:  # the lines finished so far are written, those after an unfinished one
        for i in sorted(finished_early):  # too (each row names its line); the unfinished ones are not
            write(i, finished_early[i])
        if args.out and sink is None:  # none finished: --out holds this run's rows, none (not an earlier run's)
            try:
                sink = open_out()
            except ValueError:
                pass
        raise
    finally:
        bar.close()
        if args.out and sink is not None:
            try:
                sink.close()
            except OSError:  # (the failed write's bytes, flushed again: the error is the one above)
                pass
    fork = fork_telemetry(eng)
    if fork is not None:
        print(fork.summary_line(), file=sys.stderr)
    if failed:  # every other line's result is written; the run still reports the failures
        print(f"hyspec generate: error: {len(failed)} of {len(requests)} line(s) ended in error (line(s) "
              f"{', '.join(map(str, failed[:10]))}{' ...' if len(failed) > 10 else ''} of {args.prompts_file}; "
              f"see each result's \"error\")", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- one prompt
class StreamPrinter:
    """Prints each sample as its tokens arrive: the prompt first, then the completion.

    Incremental detokenisation: the text of the tokens since `decoded_from` is decoded
    again and only what is new beyond the last printed token is written; while the text
    ends in an incomplete UTF-8 sequence (U+FFFD) nothing is written, so byte tokens that
    make up one character come out together."""

    def __init__(self, eng, prompt_ids: list[int], prompt_text: str | None, num_samples: int, out=None) -> None:
        self.eng, self.num_samples, self.out = eng, num_samples, out or sys.stdout
        self.tokenizer = eng.tokenizer
        self.prompt = prompt_text if prompt_text is not None else (
            self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else ",".join(map(str, prompt_ids)) + " |")
        self.current = -1  # the sample being printed

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _start(self, sample: int) -> None:
        if self.current >= 0:
            self._flush(final=True)
            self._write("\n")
        self.current, self.ids, self.decoded_from, self.printed = sample, [], 0, 0
        if self.num_samples > 1:
            self._write(f"--- sample {sample} ---\n")
        self._write(self.prompt)

    def _flush(self, final: bool) -> None:
        if self.tokenizer is None:
            new = self.ids[self.printed:]
            if new:
                self._write(" " + ",".join(map(str, new)) if self.printed == 0 else "," + ",".join(map(str, new)))
            self.printed = len(self.ids)
            return
        if self.printed == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self.decoded_from : self.printed])
        text = self.tokenizer.decode(self.ids[self.decoded_from :])
        if text.endswith("\ufffd") and not final:
            return  # part of a character: wait for the rest of its bytes
        if len(text) >= len(before) and text.startswith(before):
            self._write(text[len(before):])
            self.decoded_from, self.printed = self.printed, len(self.ids)
        elif final:
            self._write(text)
            self.printed = len(self.ids)

    def __call__(self, sample: int, tokens: list[int]) -> None:
        while self.current < sample:
            self._start(self.current + 1)
        self.ids.extend(tokens)
        self._flush(final=False)

    def finish(self) -> None:
        while self.current < self.num_samples - 1:
            self._start(self.current + 1)
        self._flush(final=True)
        self._write("\n")


def _options(args):
    """(sampling params, speculative options) of a one-prompt run; ValueError on a bad option."""
    if args.prompt is None and args.prompt_ids is None:
        raise ValueError("give --prompt TEXT, --prompt-ids 1,2,3 or --prompts-file FILE.jsonl")
    _common_checks(args)
    if args.out is not None:
        raise ValueError("--out writes the results of --prompts-file; for one prompt use --json > FILE")
    if args.draft < 0 or args.draft > MAX_DRAFT:
        raise ValueError(f"--draft must be in 0..{MAX_DRAFT} (0 = plain decoding), got {args.draft}")
    params = SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)})
    spec = None
    if args.draft > 0:
        spec = SpecOptions(k=args.draft, rollback=args.rollback, p_min=args.p_min, adaptive=args.adaptive,
                           adaptive_floor=args.adaptive_floor, hidden=args.hidden, forced_rates=args.forced_rates)
    elif args.forced_rates is not None:
        raise ValueError("--forced-rates needs --draft K > 0")
    else:
        check_spec_flags(args)
    return params, spec


def check(args) -> None:
    """The checks of the options that need no model: `--pp N` runs them before it starts its
    ranks, so a bad option fails at once (the ranks run them again)."""
    if args.prompts_file is not None:
        _file_options(args)
    else:
        _options(args)


def _notes(args, params: SamplingParams) -> None:
    """One stderr line for an option that cannot change this run's output (it ran silently)."""
    if args.num_samples > 1 and params.greedy:
        print(f"hyspec generate: note: --num-samples {args.num_samples} with greedy decoding (temperature 0) gives "
              f"{args.num_samples} equal samples; set --temperature to sample", file=sys.stderr)
    if args.draft == 0:
        d = SpecOptions()
        unused = [flag for flag, value, default in (("--rollback", args.rollback, d.rollback),
                                                    ("--p-min", args.p_min, d.p_min),
                                                    ("--adaptive", args.adaptive, d.adaptive),
                                                    ("--adaptive-floor", args.adaptive_floor, d.adaptive_floor),
                                                    ("--hidden", args.hidden, d.hidden)) if value != default]
        if unused:
            print(f"hyspec generate: note: {', '.join(unused)} only act with --draft K > 0 (this run decodes "
                  "plainly)", file=sys.stderr)


def run(args) -> int:
    if args.prompts_file is not None:
        return run_file(args)
    params, spec = _options(args)
    _notes(args, params)
    eng = load_engine(args)
    constraint = constraint_from_args(eng, args)  # a bad constraint fails here, before any generation
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    ids = eng.encode(prompt)
    check_prompt(ids, eng.model.cfg.vocab_size)  # (before the printer decodes it)
    if args.stop_ids:
        try:
            check_stop(args.stop_ids, eng.model.cfg.vocab_size)
        except ValueError as e:
            raise ValueError(f"--stop-ids: {e}") from None
    printer = None
    if not args.json:
        printer = StreamPrinter(eng, ids, args.prompt, args.num_samples)
    # samples decode together in one batch, so their tokens interleave: stream only a single sample
    # (and not with stop strings: the text is cut inside the token that completes one)
    stream = printer is not None and not args.no_stream and args.num_samples == 1 and not args.stop
    t0 = time.perf_counter()
    try:
        # a first Ctrl-C ends the generation after the round in flight: what it made is written
        # as usual (stop_reason "cancelled"), exit 130; a second one stops at once
        with stop_on_ctrl_c({}) as pressed:
            out = eng.generate(prompt, max_new_tokens=args.max_new_tokens, params=params, draft=args.draft,
                               spec=spec, stop_ids=args.stop_ids, ignore_eos=args.ignore_eos,
                               num_samples=args.num_samples, on_tokens=printer if stream else None,
                               constraint=constraint, logprobs=args.logprobs, stop=args.stop,
                               cancel=lambda: pressed["sigint"])
    except BaseException:
        if stream and printer.current >= 0:  # the streamed text ends its line before the error's (it was glued
            printer._flush(final=True)  # onto it: "x = abhyspec generate: error: ...")
            printer._write("\n")
        raise
    fork = fork_telemetry(eng)
    if fork is not None:
        out.stats["fork"] = fork.to_dict()
    code = 130 if any(x.stop_reason == "cancelled" for x in out.samples) else 0  # (the shell's status for Ctrl-C)
    if args.json:
        print(json.dumps(out.to_dict()), flush=True)
        if code:
            print("hyspec: interrupted (Ctrl-C): the output so far is written (stop_reason \"cancelled\")",
                  file=sys.stderr)
        return code
    if not stream:
        for i, sample in enumerate(out.samples):
            if sample.stop_reason == "stop" and args.stop:  # the text before the stop string
                printer._start(i)
                printer._write(sample.text)
            else:
                printer(i, sample.tokens)
    printer.finish()
    if out.logprobs is not None:
        print_logprobs(eng, out, args.logprobs)
    stats = out.stats
    lines = speed_lines(stats)
    if stats["num_samples"] > 1:  # (the samples' own times overlap: their sums say little) the call's wall time
        wall = time.perf_counter() - t0
        lines[0] = (f"[{stats['generated_tokens']} tokens over {stats['num_samples']} samples in {wall:.2f} s: "
                    f"{stats['generated_tokens'] / wall:.1f} tok/s together, decode {decode_rate(stats)} per sample]")
    if "max_new_tokens_capped_to" in stats:
        lines.insert(1, f"[--max-new-tokens {args.max_new_tokens} capped to {stats['max_new_tokens_capped_to']}: "
                        f"prompt + completion must fit in the model's context of {stats['context_length']} tokens]")
    for line in lines:
        print(line, file=sys.stderr)
    if fork is not None:
        print(fork.summary_line(), file=sys.stderr)
    if code:
        print("hyspec: interrupted (Ctrl-C): the output so far is written above", file=sys.stderr)
    return code


def print_logprobs(eng, out, top: int) -> None:
    """A table per sample (hyspec.cli.common.print_logprob_table)."""
    for i, (sample, entries) in enumerate(zip(out.samples, out.logprobs)):
        print_logprob_table(eng, sample.tokens, entries, top, prefix=f"sample {i}: " if len(out.samples) > 1 else "")
