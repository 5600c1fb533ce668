"""The front door: load a checkpoint (weights + tokenizer) once, then generate or score.

    from hyspec import Engine
    eng = Engine.load("path/to/checkpoint")            # or Engine.load() for the embedded default
    out = eng.generate("def fibonacci(n):", max_new_tokens=64, draft=3)
    print(out.text, out.stats["spec"]["acceptance_length"])
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hyspec.decode import GREEDY, GenerationResult, generate_plain
from hyspec.loading import load_model, parse_dtype
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import ParamError, SamplingParams
from hyspec.spec.loop import MAX_DRAFT, SpecOptions, generate_speculative
from hyspec.spec.telemetry import SpecTelemetry
from hyspec.tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
_MASK64 = (1 << 64) - 1
# counters that add up over the samples of a --num-samples run (the rest is per-run constant)
_SUMMED_STATS = ("generated_tokens", "target_forwards", "mtp_forwards", "direct_tokens", "prefill_s", "decode_s")


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParamError(name, value, "must be an integer")
    if value < lo or (hi is not None and value > hi):
        raise ParamError(name, value, f"must be in {lo}..{hi}" if hi is not None else f"must be >= {lo}")
    return value


def _token_ids(name: str, value) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ParamError(name, value, "must be a list of token ids")
    try:
        return [operator.index(t) for t in value]
    except TypeError:
        raise ParamError(name, value, "must be a list of integer token ids") from None


def check_device(device) -> torch.device:
    """torch.device for 'cpu', 'cuda' or 'cuda:N', with an error naming the argument."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ParamError("device", device, "must be cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ParamError("device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


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
        """stats: totals over all samples (counters and times add up; spec telemetry is
        merged); samples[i].stats: that sample's own."""
        return {
            "tokens": self.tokens, "text": self.text, "stop_reason": self.samples[0].stop_reason,
            "prompt_tokens": self.prompt_tokens,
            "samples": [{"tokens": s.tokens, "text": s.text, "stop_reason": s.stop_reason, "stats": s.stats}
                        for s in self.samples],
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
        check_device(device)
        model = load_model(path, dtype=parse_dtype(dtype), device=device)
        tok = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        return cls(model, tok, str(path))

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, prompt: str | list[int], *, arg: str = "prompt") -> list[int]:
        """Text -> ids with the checkpoint's tokenizer; ids are checked to be integers
        (`arg` names the argument in the error)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if prompt is None or isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
            raise ParamError(arg, prompt, "must be a str or a list of token ids")
        return _token_ids(arg, prompt)

    @property
    def context_length(self) -> int:
        """The model's context (config max_position_embeddings): prompt + new tokens fit in it."""
        return self.model.cfg.max_position_embeddings

    def _check_context(self, n: int, what: str) -> None:
        if n > self.context_length:
            raise ValueError(f"{what} has {n} tokens, more than the model's context of {self.context_length} "
                             f"tokens (max_position_embeddings in config.json)")

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.model.cfg.eos_token_ids

    # -- generation --------------------------------------------------------------------
    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 64, params: SamplingParams | None = None,
                 draft: int = 0, spec: SpecOptions | None = None, stop_ids=None, ignore_eos: bool = False,
                 num_samples: int = 1, reference: list[int] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> Output:
        """draft = 0: plain decoding; draft = K: speculative with K drafts per round (spec
        gives the other drafter options; its k is replaced by `draft`).

        prompt + new tokens must fit in the model's context (max_position_embeddings): a
        longer prompt is an error; max_new_tokens beyond it is capped, and a sample that
        runs into the cap ends with stop_reason "context" (stats: max_new_tokens_capped_to,
        context_length). on_tokens(i, ids), when given, is called with the ids each round
        commits to sample i (streaming). stats are totals over the samples; each sample's
        own are in samples[i].stats."""
        params = params if params is not None else GREEDY
        if not isinstance(params, SamplingParams):
            raise ParamError("params", params, "must be a hyspec.SamplingParams (or None for greedy)")
        if spec is not None and not isinstance(spec, SpecOptions):
            raise ParamError("spec", spec, "must be a hyspec.spec.loop.SpecOptions or None")
        _int_arg("max_new_tokens", max_new_tokens, 0)
        _int_arg("num_samples", num_samples, 1)
        _int_arg("draft", draft, 0, MAX_DRAFT)
        if stop_ids is not None:
            stop_ids = _token_ids("stop_ids", stop_ids)
        if reference is not None:
            reference = _token_ids("reference", reference)
        if on_tokens is not None and not callable(on_tokens):
            raise ParamError("on_tokens", on_tokens, "must be a callable (sample index, token ids) or None")
        if draft > 0:
            spec = SpecOptions(**{**(spec.__dict__ if spec else {}), "k": draft})
            if not self.model.has_mtp:
                raise ValueError("this checkpoint has no MTP head (no mtp.* weights), so it cannot speculate; "
                                 "use --draft 0 for plain decoding")
        ids = self.encode(prompt)
        self._check_context(len(ids), "the prompt")
        room = self.context_length - len(ids)
        capped = max_new_tokens > room
        n_new = min(max_new_tokens, room)
        stops = set(() if ignore_eos else self.eos_ids) | set(stop_ids or ())
        samples: list[Sample] = []
        total = SpecTelemetry()
        for i in range(num_samples):
            p = params if i == 0 else SamplingParams(**{**params.__dict__, "seed": derive_seed(params.seed, i)})
            cb = None if on_tokens is None else (lambda toks, i=i: on_tokens(i, list(toks)))
            res = self._run(ids, n_new, p, spec if draft > 0 else None, stops, reference, cb)
            if "spec" in res.stats:
                total.merge(SpecTelemetry.from_dict(res.stats["spec"]))
            reason = "context" if capped and res.stop_reason == "length" else res.stop_reason
            samples.append(Sample(res.tokens, self.decode(res.tokens), reason, res.stats))
        stats = dict(samples[0].stats)  # per-run constants (prompt_tokens, k, rollback, path...)
        for key in _SUMMED_STATS:
            if any(key in s.stats for s in samples) or key in ("prefill_s", "decode_s"):
                stats[key] = sum(s.stats.get(key, 0) for s in samples)
        if "rollback_extra_bytes_per_round" in stats:
            stats["rollback_extra_bytes_per_round"] = max(s.stats["rollback_extra_bytes_per_round"] for s in samples)
        stats["generated_tokens"] = sum(len(s.tokens) for s in samples)
        stats["num_samples"] = num_samples
        steps = sum(max(len(s.tokens) - 1, 0) for s in samples)  # the first token comes from the prefill
        stats["decode_tok_s"] = steps / stats["decode_s"] if stats["decode_s"] > 0 and steps else None
        if capped:
            stats["max_new_tokens_capped_to"] = n_new
            stats["context_length"] = self.context_length
        if draft > 0:
            stats["spec"] = total.to_dict()
        return Output(samples, ids, stats)

    def _run(self, ids, max_new_tokens, params, spec, stops, reference, on_tokens=None) -> GenerationResult:
        fast = self._fast_path(params)
        if spec is None:
            if fast is not None:
                return fast.generate_plain_fast(self.model, ids, max_new_tokens=max_new_tokens, stop_ids=stops,
                                                on_tokens=on_tokens)
            return generate_plain(self.model, ids, max_new_tokens=max_new_tokens, params=params, stop_ids=stops,
                                  on_tokens=on_tokens)
        if spec.forced_rates is not None and reference is None:
            reference = generate_plain(self.model, ids, max_new_tokens=max_new_tokens + spec.k + 1, params=GREEDY,
                                       stop_ids=()).tokens
        if fast is not None and spec.rollback == "checkpoint" and spec.p_min == 0.0 and spec.prime_pending:
            return fast.generate_speculative_fast(self.model, ids, max_new_tokens=max_new_tokens, opts=spec,
                                                  stop_ids=stops, reference=reference, on_tokens=on_tokens)
        return generate_speculative(self.model, ids, max_new_tokens=max_new_tokens, opts=spec, params=params,
                                    stop_ids=stops, reference=reference, on_tokens=on_tokens)

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
        ids = self.encode(text, arg="text")
        if len(ids) < 2:
            raise ValueError("scoring needs at least 2 tokens")
        self._check_context(len(ids), "the text to score")
        _int_arg("top_logprobs", top_logprobs, 0)
        V = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of range for vocabulary size {V}")
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
