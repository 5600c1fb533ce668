"""`hyspec replay`: teacher-forced MTP acceptance over a text file
(hyspec.speculative.replay): how often the drafter's K guesses would be accepted there."""

from __future__ import annotations

import os
import sys
import time

from hyspec.cli.common import HelpFormatter, add_model_args, json_dumps, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="teacher-forced MTP acceptance over a text file", formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--text-file", required=True, type=os.path.expanduser,
                   help="UTF-8 text file to replay (required; - reads standard input)")
    p.add_argument("--k", type=int, default=4, help="deepest draft depth measured")
    p.add_argument("--stride", type=int, default=1, help="draft from every N-th position")
    p.add_argument("--chunk", type=int, default=512, help="target forward chunk length")
    p.add_argument("--hidden", default="post", choices=["post", "pre"], help="target hidden that seeds the MTP head")
    p.add_argument("--max-tokens", type=int, default=None, help="only the first N tokens of the file (None: all)")


class ProgressBar:
    """`[####....] done/total` on stderr, redrawn at most every 0.2 s (and at the end)."""

    def __init__(self, width: int = 30) -> None:
        self.width, self.last_draw = width, 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.time()
        if done < total and now - self.last_draw < 0.2:
            return
        self.last_draw = now
        filled = int(self.width * done / max(total, 1))
        print(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}", end="" if done < total else "\n",
              file=sys.stderr, flush=True)


def run(args) -> int:
    from hyspec.speculative.replay import replay_acceptance

    if args.text_file != "-":  # ("-": standard input; a pipe or <(...) is not a regular file, and is read)
        if os.path.isdir(args.text_file):
            raise ValueError(f"--text-file {args.text_file} is a directory: give a text file")
        if not os.path.exists(args.text_file):
            raise ValueError(f"--text-file {args.text_file} does not exist")
    elif sys.stdin is None or sys.stdin.closed:  # (`<&-`: there is nothing to read)
        raise ValueError("--text-file -: standard input is closed")
    from hyspec.speculative.loop import MAX_DRAFT

    for flag, value, low, high in (("--k", args.k, 1, MAX_DRAFT), ("--stride", args.stride, 1, None),
                                   ("--chunk", args.chunk, 1, None)):  # (the flag named, before the model loads)
        if value < low or (high is not None and value > high):
            raise ValueError(f"{flag} must be {'in %d..%d' % (low, high) if high else '>= %d' % low}, got {value}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens: must be >= 2 (a replay needs a token to draft from and one to check), "
                         f"got {args.max_tokens}")
    eng = load_engine(args)
    if not eng.model.has_mtp:  # (before reading the text: its length is beside the point then)
        from hyspec.config import no_mtp_error

        raise no_mtp_error(": there is nothing to replay")
    if eng.tokenizer is None:
        raise ValueError("replay needs a checkpoint with a tokenizer.json: --text-file is text")
    try:  # the text as its bytes are (a CRLF file's \r kept: the model reads what the file holds)
        if args.text_file == "-":
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
        else:
            with open(args.text_file, "rb") as f:
                data = f.read()
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text-file {args.text_file} is not UTF-8 text ({e.reason} at byte {e.start + 1})") from None
    ids = eng.encode(text)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if len(ids) > eng.context_length:
        raise ValueError(f"--text-file {args.text_file} has {len(ids)} tokens, more than the model's context of "
                         f"{eng.context_length} tokens: replay a prefix with --max-tokens {eng.context_length}")
    report = replay_acceptance(eng.model, ids, k=args.k, stride=args.stride, chunk=args.chunk, hidden=args.hidden,
                               progress=None if args.json else ProgressBar())
    if args.json:
        print(json_dumps(report))
        return 0
    print(f"{report['tokens']} tokens, target perplexity {report['perplexity']:.3f}; "
          f"{report['positions']} draft positions (stride {report['stride']}, K={report['k']})")
    if not report["positions"]:  # (the JSON's rates are 0 then, as SpecTelemetry's are without rounds)
        print(f"no draft position to judge: a position needs the K + 2 = {report['k'] + 2} tokens from it in the "
              f"text; give a longer text or a smaller --k")
        return 0
    print("depth                      " + "".join(f"{d + 1:>8}" for d in range(report["k"])))
    for label, rates in (("accepted vs text", report), ("accepted vs target greedy", report["vs_target"])):
        print(f"{label:<27}" + "".join(f"{x:8.3f}" for x in rates["accept_rate_at"]))
        print(f"{'  acceptance length, K=d':<27}" + "".join(f"{x:8.3f}" for x in rates["acceptance_length"]))
    return 0
