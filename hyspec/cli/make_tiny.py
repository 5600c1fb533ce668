"""`hyspec make-tiny`: write a random tiny checkpoint (mtp.* weights and a tokenizer) of one
model family, for tests and quick experiments (hyspec.tiny)."""

from __future__ import annotations

import os
from pathlib import Path

from hyspec.cli.common import HelpFormatter

FP8_BLOCK_DEFAULT = "128,128"


def add_parser(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a random tiny checkpoint (with mtp.* weights and a tokenizer)",
                       formatter_class=HelpFormatter)
    p.add_argument("--arch", required=True, choices=["qwen3_next", "qwen3_5", "qwen3_5_moe"],
                   help="model family (required)")
    p.add_argument("--out", required=True, type=os.path.expanduser,
                   help="output directory (required; an earlier make-tiny checkpoint there, with the make_tiny.json "
                        "it leaves, is replaced; another checkpoint is refused)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--vocab-size", type=int, default=512,
                   help="vocabulary size (>= 300: with a tokenizer.json, trained on a short sample: about 380 "
                        "tokens at most; larger ids decode to nothing)")
    p.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--init-std", type=float, default=0.02, help="weight scale (larger = more peaked logits)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* weights")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="also write a reduced draft vocabulary (mtp.d2t) of N ids")
    p.add_argument("--fp8", action="store_true",
                   help="block-FP8 weights like Qwen's -FP8 checkpoints (float8_e4m3fn + weight_scale_inv, "
                        "quantization_config in config.json)")
    p.add_argument("--fp8-block", default=FP8_BLOCK_DEFAULT, help="weight_block_size for --fp8, as ROWS,COLS")
    p.add_argument("--experts", default="stacked", choices=["stacked", "per_expert"],
                   help="MoE expert layout: stacked gate_up_proj/down_proj or per-expert keys (the MoE families; "
                        "qwen3_5 is dense and has none)")


MAX_PARAMS = 2_000_000_000  # make-tiny's checkpoints are for tests: about 8 GB in fp32 at most


def estimated_params(arch: str, vocab_size: int, hidden: int, layers: int) -> int:
    """The checkpoint's parameter count, from two small layer counts (models on the meta
    device: no memory), without building a model of `layers` layers."""
    from hyspec.tiny import tiny_config
    from hyspec.train.model import count_params

    p4, p8 = (count_params(tiny_config(arch, vocab_size=vocab_size, hidden=hidden, layers=n)) for n in (4, 8))
    return p4 + (layers - 4) * (p8 - p4) // 4


def run(args) -> int:
    import math

    from hyspec.tiny import make_tiny

    if not (math.isfinite(args.init_std) and args.init_std > 0):
        raise ValueError(f"--init-std must be a positive number, got {args.init_std}")
    if args.draft_vocab and args.no_mtp:
        raise ValueError("--draft-vocab needs the MTP head: it cannot go with --no-mtp")
    if not 0 <= args.draft_vocab <= args.vocab_size:
        raise ValueError(f"--draft-vocab must be in 0..--vocab-size ({args.vocab_size}; 0: none), got "
                         f"{args.draft_vocab}")
    for flag, v in (("--vocab-size", args.vocab_size), ("--hidden-size", args.hidden_size), ("--layers", args.layers)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if not 0 <= args.seed < 2**64:
        raise ValueError(f"--seed must be in 0..2**64 - 1, got {args.seed}")
    from hyspec.cli.common import check_out_dir
    from hyspec.tiny import MADE_BY_MAKE_TINY

    check_out_dir(args.out)
    out_dir = Path(args.out)
    if out_dir.is_dir() and not (out_dir / MADE_BY_MAKE_TINY).is_file():
        held = sorted(p.name for p in out_dir.iterdir()
                      if p.name in ("config.json", "tokenizer.json") or p.name.endswith(".safetensors"))
        if held:  # (a trained or downloaded checkpoint: replacing its weights would lose them)
            raise ValueError(f"--out {args.out}: holds a checkpoint ({', '.join(held[:3])}"
                             f"{', ...' if len(held) > 3 else ''}) without the {MADE_BY_MAKE_TINY} make-tiny leaves "
                             f"beside its own: give a new or empty folder (one an older hyspec's make-tiny wrote: "
                             f"remove it first)")
    if args.fp8_block != FP8_BLOCK_DEFAULT and not args.fp8:
        raise ValueError("--fp8-block applies with --fp8")
    params = estimated_params(args.arch, args.vocab_size, args.hidden_size, args.layers)
    if params > MAX_PARAMS:
        raise ValueError(f"make-tiny writes small test checkpoints: this one would hold about {params / 1e9:.1f} B "
                         f"parameters ({4 * params / 1e9:.0f} GB in fp32), more than {MAX_PARAMS / 1e9:.0f} B: "
                         f"lower --layers / --hidden-size / --vocab-size")
    out = make_tiny(args.arch, args.out, seed=args.seed, vocab_size=args.vocab_size, hidden=args.hidden_size,
                    layers=args.layers, std=args.init_std, with_mtp=not args.no_mtp,
                    draft_vocab=args.draft_vocab, fp8=args.fp8, fp8_block=fp8_block(args.fp8_block),
                    experts=args.experts)
    print(f"wrote {args.arch} {'FP8 ' if args.fp8 else ''}checkpoint to {out}")
    return 0


def fp8_block(text: str) -> tuple[int, int]:
    """--fp8-block ROWS,COLS: two positive integers (checked before anything is written)."""
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 2 or min(parts) < 1:
        raise ValueError(f"--fp8-block: expected two positive integers ROWS,COLS, got {text!r}")
    return parts
