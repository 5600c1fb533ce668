"""`hyspec score`: per-token log-probabilities of a text (teacher forcing), optionally with
the top alternatives at each position."""

from __future__ import annotations


from hyspec.cli.common import HelpFormatter, add_model_args, json_dumps, load_engine, parse_ids, print_logprob_table


def add_parser(sub) -> None:
    p = sub.add_parser("score", help="per-token log-probabilities of a text", formatter_class=HelpFormatter)
    add_model_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="text to score (with the checkpoint's tokenizer)")
    source.add_argument("--ids", type=parse_ids, help="token ids to score, comma-separated")
    p.add_argument("--top-logprobs", type=int, default=0,
                   help="also show the N most likely tokens at each position (0 = none)")
    p.add_argument("--summary", action="store_true",
                   help="print the summary line alone (NLL, perplexity), not the table of each token's log-probability")


def run(args) -> int:
    if args.summary and args.top_logprobs:
        raise ValueError("--summary prints no table: --top-logprobs does not go with it")
    eng = load_engine(args)
    scored = eng.score(args.text if args.text is not None else args.ids, top_logprobs=args.top_logprobs)
    if args.json:
        print(json_dumps(scored))
        return 0
    if not args.summary:  # (each scored token's row; was printed only with --top-logprobs)
        tops = scored["top_logprobs"] or [[] for _ in scored["logprobs"]]
        entries = [(logprob, [(e[0], e[1]) for e in top]) for logprob, top in zip(scored["logprobs"], tops)]
        print_logprob_table(eng, scored["tokens"][1:], entries, args.top_logprobs)
    # (natural log: the NLL in nats; the first token has no context, so it is not scored)
    print(f"{scored['scored_tokens']} of {len(scored['tokens'])} tokens scored  NLL {scored['nll']:.3f} nats  "
          f"mean {scored['mean_nll']:.4f} nats/token  perplexity {scored['perplexity']:.3f}")
    return 0
