"""The front door: load a checkpoint (weights + tokenizer) once, then generate or score.

    from hyspec import Engine
    eng = Engine.load("path/to/checkpoint")            # or Engine.load() for the embedded default
    out = eng.generate("def fibonacci(n):", max_new_tokens=64, draft=3)
    print(out.text, out.stats["spec"]["acceptance_length"])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hyspec.decode import GREEDY, GenerationResult, generate_plain
from hyspec.loading import load_model, parse_dtype
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import SamplingParams
from hyspec.spec.loop import SpecOptions, generate_speculative
from hyspec.spec.telemetry import SpecTelemetry
from hyspec.tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
_MASK64 = (1 << 64) - 1


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; pass --model DIR")
    return DEFAULT_MODEL_DIR


def derive_seed(seed: int, i: int) -> int:
    """Seed of sample i of a --num-samples run (sample 0 keeps the given seed): a
    splitmix64 hash, so runs with neighbouring seeds do not share samples."""
    if i == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + i * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class Sample:
    tokens: list[int]
    text: str | None
    stop_reason: str
    stats: dict = field(default_factory=dict)


@dataclass
class Output:
    samples: list[Sample]
    prompt_tokens: list[int]
    stats: dict

    @property
    def tokens(self) -> list[int]:
        return self.samples[0].tokens

    @property
    def text(self) -> str | None:
        return self.samples[0].text

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens, "text": self.text, "stop_reason": self.samples[0].stop_reason,
            "prompt_tokens": self.prompt_tokens,
            "samples": [{"tokens": s.tokens, "text": s.text, "stop_reason": s.stop_reason} for s in self.samples],
            "stats": self.stats,
        }


class Engine:
    def __init__(self, model: HybridLM, tokenizer: Tokenizer | None = None, model_dir: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir

    @classmethod
    def load(cls, path: str | Path | None = None, *, dtype: str = "float32", device: str = "cpu") -> "Engine":
        path = Path(path) if path is not None else default_model_dir()
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        model = load_model(path, dtype=parse_dtype(dtype), device=device)
        tok = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        return cls(model, tok, str(path))

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.model.cfg.eos_token_ids

    # -- generation --------------------------------------------------------------------
    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 64, params: SamplingParams | None = None,
                 draft: int = 0, spec: SpecOptions | None = None, stop_ids=None, ignore_eos: bool = False,
                 num_samples: int = 1, reference: list[int] | None = None, constraint=None) -> Output:
        """draft = 0: plain decoding; draft = K: speculative with K drafts per round (spec
        gives the other drafter options; its k is replaced by `draft`).

        constraint: a hyspec.constraints.Constraint (see Engine.constraint) the output must
        match; each sample runs on its own clone, so the object passed in is not advanced.
        A sample whose constraint allows no further token ends with stop_reason "constraint"."""
        params = params if params is not None else GREEDY
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if draft < 0:
            raise ValueError(f"draft must be >= 0 (0 = plain decoding), got {draft}")
        if draft > 0:
            spec = SpecOptions(**{**(spec.__dict__ if spec else {}), "k": draft})
            if not self.model.has_mtp:
                raise ValueError("this checkpoint has no MTP head (no mtp.* weights), so it cannot speculate; "
                                 "use --draft 0 for plain decoding")
        if constraint is not None:
            self._check_constraint(constraint)
        ids = self.encode(prompt)
        stops = set(() if ignore_eos else self.eos_ids) | set(stop_ids or ())
        samples: list[Sample] = []
        total = SpecTelemetry()
        times = {"prefill_s": 0.0, "decode_s": 0.0}
        for i in range(num_samples):
            p = params if i == 0 else SamplingParams(**{**params.__dict__, "seed": derive_seed(params.seed, i)})
            res = self._run(ids, max_new_tokens, p, spec if draft > 0 else None, stops, reference,
                            None if constraint is None else constraint.clone())
            if "spec" in res.stats:
                total.merge(SpecTelemetry.from_dict(res.stats["spec"]))
            for key in times:
                times[key] += res.stats.get(key, 0.0)
            samples.append(Sample(res.tokens, self.decode(res.tokens), res.stop_reason, res.stats))
        n_gen = sum(len(s.tokens) for s in samples)
        stats = {**samples[0].stats, **times, "generated_tokens": n_gen, "num_samples": num_samples,
                 "decode_tok_s": (n_gen / times["decode_s"]) if times["decode_s"] > 0 else None}
        if draft > 0:
            stats["spec"] = total.to_dict()
        return Output(samples, ids, stats)

    def constraint(self, kind: str, value=None, *, arg: str | None = None):
        """A Constraint for this model (kind: json_schema | json_object | regex | grammar |
        choice); raises ValueError naming the argument when the value is invalid."""
        from hyspec.constraints import make_constraint

        return make_constraint(self, kind, value, arg=arg)

    def _check_constraint(self, constraint) -> None:
        if not hasattr(constraint, "allowed") or not hasattr(constraint, "commit"):
            raise ValueError(f"constraint must be a hyspec.constraints.Constraint, got {type(constraint).__name__}")
        V = getattr(constraint, "vocab_size", self.model.cfg.vocab_size)
        if V != self.model.cfg.vocab_size:
            raise ValueError(f"constraint was built for a vocabulary of {V} tokens; this model has "
                             f"{self.model.cfg.vocab_size}")

    def _run(self, ids, max_new_tokens, params, spec, stops, reference, constraint=None) -> GenerationResult:
        # the CUDA-graph fast path has no mask hook: constrained requests take the core's round driver
        fast = self._fast_path(params) if constraint is None else None
        if spec is None:
            if fast is not None:
                return fast.generate_plain_fast(self.model, ids, max_new_tokens=max_new_tokens, stop_ids=stops)
            return generate_plain(self.model, ids, max_new_tokens=max_new_tokens, params=params, stop_ids=stops,
                                  constraint=constraint)
        if spec.forced_rates is not None and reference is None:
            reference = generate_plain(self.model, ids, max_new_tokens=max_new_tokens + spec.k + 1, params=GREEDY,
                                       stop_ids=()).tokens
        if fast is not None and spec.rollback == "checkpoint" and spec.p_min == 0.0 and spec.prime_pending:
            return fast.generate_speculative_fast(self.model, ids, max_new_tokens=max_new_tokens, opts=spec,
                                                  stop_ids=stops, reference=reference)
        return generate_speculative(self.model, ids, max_new_tokens=max_new_tokens, opts=spec, params=params,
                                    stop_ids=stops, reference=reference, constraint=constraint)

    def _fast_path(self, params: SamplingParams):
        """The CUDA-graph fast path (greedy, no penalties) when running on a GPU."""
        if not self.model.device.type == "cuda" or not params.greedy or params.has_penalties:
            return None
        try:
            from hyspec import gpu
        except ImportError:
            return None
        if not hasattr(gpu, "generate_plain_fast"):
            return None
        return gpu

    # -- scoring -----------------------------------------------------------------------
    @torch.no_grad()
    def score(self, text: str | list[int], *, top_logprobs: int = 0, chunk: int = 512) -> dict:
        """Per-position log-probabilities of each actual next token (teacher forcing).
        logprobs[i-1] = log p(token i | tokens < i) for i >= 1."""
        ids = self.encode(text)
        if len(ids) < 2:
            raise ValueError("scoring needs at least 2 tokens")
        V = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of range for vocabulary size {V}")
        if top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
        model = self.model
        cache = model.new_cache(len(ids))
        lps: list[float] = []
        tops: list[list[list]] = []
        dev = model.device
        for s in range(0, len(ids) - 1, chunk):
            part = ids[s : min(s + chunk, len(ids) - 1)]
            h = model.forward_hidden(torch.tensor(part, device=dev), cache, StepCtx(start=s, chunked=True))
            logp = torch.log_softmax(model.logits(h).double(), dim=-1)  # [t, V]
            nxt = torch.tensor(ids[s + 1 : s + 1 + len(part)], device=dev)
            lps.extend(logp.gather(1, nxt[:, None])[:, 0].tolist())
            if top_logprobs:
                v, i = torch.topk(logp, min(top_logprobs, V), dim=-1)
                for row_v, row_i in zip(v.tolist(), i.tolist()):
                    tops.append([[t, lp] + ([self.tokenizer.decode([t])] if self.tokenizer else [])
                                 for t, lp in zip(row_i, row_v)])
        nll = -sum(lps)
        return {
            "tokens": ids, "logprobs": lps, "top_logprobs": tops if top_logprobs else None,
            "nll": nll, "mean_nll": nll / len(lps), "perplexity": math.exp(nll / len(lps)),
            "scored_tokens": len(lps),
        }
