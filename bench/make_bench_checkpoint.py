"""Write the bench's in-memory model (qwen3-next-2b-dense, old name b2: random weights) to a
checkpoint directory that `hyspec serve --model DIR` and `bench/serve_load.py --model DIR`
can load, with a word-level tokenizer.json over its whole vocabulary.

Random weights have no tokenizer of their own and generate ids from the whole 151,936-id
vocabulary, so the tokenizer must decode every id: it maps the words of the load test's
prompts to the first ids and fills the rest with `w<id>` words (whitespace-separated
text; the text is only compared with itself, offline vs served).

    python bench/make_bench_checkpoint.py /tmp/b2 [--config qwen3-next-2b-dense|tiny] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def word_tokenizer(vocab_size: int, texts: list[str]):
    """A WordLevel tokenizer of exactly vocab_size ids: the words of `texts` first (id 0 is
    the unknown word), then w<id> fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>"]
    for t in texts:
        for w in re.findall(r"\w+|[^\w\s]+", t):
            if w not in words:
                words.append(w)
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words[:vocab_size])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--config", default="qwen3-next-2b-dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    from safetensors.torch import save_file

    from hyspec.bench.models import build_config_model
    from hyspec.presets import BENCH_MODELS, canonical_name

    name = canonical_name(args.config)
    if name == "tiny":  # a quick look on the CPU
        from hyspec.tiny import tiny_config

        cfg = tiny_config("qwen3_next", vocab_size=512)
    elif name in BENCH_MODELS:
        cfg = dict(BENCH_MODELS[name])
    else:
        raise SystemExit(f"--config: tiny or one of {sorted(BENCH_MODELS)}, got {args.config!r}")
    model = build_config_model(cfg, torch.device(args.device), getattr(torch, args.dtype), args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=2))
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_load import PROMPTS

    word_tokenizer(cfg["vocab_size"], PROMPTS).save(str(out / "tokenizer.json"))
    print(f"wrote {out}: {sum(t.numel() for t in tensors.values()) / 1e9:.2f} B parameters ({name}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
