"""Request validation: the model's limits applied to a parsed request. Every failure is an
APIError carrying the HTTP status and OpenAI's error fields."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from dataclasses import field as dc_field

from hyspec.config import NO_MTP_HEAD
from hyspec.sampling import PENALTY_MAX, TEMPERATURE_MIN, ParamError, SamplingParams, check_logit_bias
from hyspec.speculative.loop import MAX_DRAFT

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOPS = 16
MAX_STOP_CHARS = 1000


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# (OpenAI's own types: a wrong key and an unknown model are invalid_request_error too, told apart by code)
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _finite(name: str, v) -> None:
    if v is not None and not math.isfinite(v):
        raise bad(f"{name} must be a finite number, got {v}", name)


@dataclass
class Limits:
    vocab_size: int
    max_model_len: int
    has_mtp: bool
    default_draft: int
    capacity: int  # max_batch + max_queue
    # the checkpoint's recommended sampling (Engine.sampling_defaults, from its
    # generation_config.json): a request that leaves one of these fields out gets it (as vLLM
    # does), the others OpenAI's defaults (temperature 1, top_p 1)
    sampling_defaults: dict = dc_field(default_factory=dict)


GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
          ("guided_choice", "choice"))


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request asks its output to match: a hyspec.constraints kind, its value, and
    the request field it came from (error messages and `param` name it)."""

    kind: str
    value: object
    param: str
    parts: tuple = ()  # ((label, schema), ...): where a failed schema is built from several (the tools'),
    # the first part that fails alone is the one its error names


def check_response_format(rf) -> ConstraintSpec | None:
    """OpenAI's response_format: text (or absent) -> None; json_object; json_schema with
    json_schema.schema (name / strict / description are accepted; the schema is always
    enforced, strict or not)."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ConstraintSpec("json_object", None, "response_format")
    if rf.type == "json_schema":
        js = rf.json_schema
        if not isinstance(js, dict):
            raise bad("response_format of type 'json_schema' needs a json_schema object "
                      '({"name": ..., "schema": {...}})', "response_format")
        schema = js.get("schema")
        if schema is None:
            raise bad("response_format.json_schema.schema is missing (the JSON schema the output must match)",
                      "response_format")
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema must be a JSON object (a JSON schema), got "
                      f"{type(schema).__name__}", "response_format")
        if "name" in js and not isinstance(js["name"], str):
            raise bad("response_format.json_schema.name must be a string", "response_format")
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise bad("response_format.json_schema.strict must be a boolean", "response_format")
        return ConstraintSpec("json_schema", schema, "response_format")
    raise bad(f"unknown response_format type {rf.type!r} (text | json_object | json_schema)", "response_format")


def constraint_spec(req, extra: ConstraintSpec | None = None) -> ConstraintSpec | None:
    """The request's one output constraint (response_format, a guided_* extension, or
    `extra`: a forced tool call), or None; two or more is a 400."""
    found = [] if extra is None else [extra]
    rf = check_response_format(req.response_format)
    if rf is not None:
        found.append(rf)
    for field, kind in GUIDED:
        v = getattr(req, field, None)
        if v is not None:
            found.append(ConstraintSpec(kind, v, field))
    if len(found) > 1:
        names = ", ".join(f.param for f in found)
        raise bad(f"at most one output constraint per request; this one has {names}", found[1].param)
    return found[0] if found else None


def check_prompt_ids(ids: list[int], lim: Limits, param: str, scoring: bool = False, where: str = "") -> None:
    """scoring: an echo request that generates nothing (max_tokens 0) may fill the whole context.
    where: which prompt of several ("prompt 2: "), for the message."""
    if not ids:
        raise bad(f"{where}the prompt is empty: give at least one token", param)
    badids = [t for t in ids if not 0 <= t < lim.vocab_size]
    if badids:
        raise bad(f"{where}token id(s) {badids[:5]} out of range for vocabulary size {lim.vocab_size}", param)
    if len(ids) > lim.max_model_len or (len(ids) == lim.max_model_len and not scoring):
        raise bad(f"{where}the prompt is {len(ids)} tokens, "
                  f"{'as long as' if len(ids) == lim.max_model_len else 'longer than'}"
                  f" the model's context of {lim.max_model_len} tokens (at least one must be left to generate)", param)


def requested_max_tokens(req) -> tuple[int | None, str]:
    """(the request's token limit, the field it came from): OpenAI's newer max_completion_tokens
    wins over max_tokens."""
    if getattr(req, "max_completion_tokens", None) is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def max_new_tokens(req, prompt_len: int, lim: Limits, default: int | None, allow_zero: bool, where: str = "") -> int:
    mt, name = requested_max_tokens(req)
    room = lim.max_model_len - prompt_len
    if mt is None:
        return min(default, room) if default is not None else room
    if mt < (0 if allow_zero else 1):
        raise bad(f"{name} must be at least {0 if allow_zero else 1}, got {mt}", name)
    if mt > room:
        raise bad(f"{where}{name}={mt} is too large: the prompt has {prompt_len} tokens and the context holds "
                  f"{lim.max_model_len}, so at most {room} can be generated", name)
    return mt


def sampling(req, lim: Limits) -> tuple[SamplingParams, int, int]:
    """(SamplingParams of sample 0, n, draft K)."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _finite(name, getattr(req, name))
    rec = lim.sampling_defaults
    t = rec.get("temperature", 1.0) if req.temperature is None else req.temperature
    if t < 0 or 0 < t < TEMPERATURE_MIN:
        raise bad(f"temperature must be 0 (greedy) or >= {TEMPERATURE_MIN:g}, got {t}", "temperature")
    if req.temperature is not None and t > 2.0:  # (a checkpoint's recommendation is the checkpoint's)
        raise bad(f"temperature must be at most 2 (OpenAI's range), got {t}", "temperature")
    top_p = rec.get("top_p", 1.0) if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = rec.get("top_k", 0) if req.top_k is None else 0 if req.top_k == -1 else req.top_k
    if top_k < 0:
        raise bad(f"top_k must be >= 0, or -1 / 0 for off, got {req.top_k}", "top_k")
    min_p = rec.get("min_p", 0.0) if req.min_p is None else req.min_p
    if not 0.0 <= min_p < 1.0:
        raise bad(f"min_p must be in [0, 1), got {min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise bad(f"{name} must be in [-2, 2], got {v}", name)
    rp = rec.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty
    if not 1 / PENALTY_MAX <= rp <= PENALTY_MAX:
        raise bad(f"repetition_penalty must be in [{1 / PENALTY_MAX:g}, {PENALTY_MAX:g}] (1 = off), got {rp}",
                  "repetition_penalty")
    pln = 64 if req.penalty_last_n is None else req.penalty_last_n
    if pln < -1:
        raise bad(f"penalty_last_n must be >= -1, got {pln}", "penalty_last_n")
    n = 1 if req.n is None else req.n
    limit = min(MAX_N, lim.capacity)
    if not 1 <= n <= limit:
        raise bad(f"n must be in 1..{limit}, got {n}", "n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad("best_of other than n is not supported", "best_of")
    bias = ()
    if req.logit_bias:
        try:
            biased = SamplingParams(logit_bias=req.logit_bias)
            check_logit_bias(biased, lim.vocab_size)  # (the scheduler's check, answered here as a 400)
        except ParamError as e:
            raise bad(f"logit_bias {e.shown}: {e.why}", "logit_bias") from None
        except ValueError as e:
            raise bad(str(e), "logit_bias") from None
        bias = biased.logit_bias
    seed = req.seed
    if seed is None:
        seed = 0 if t == 0 else secrets.randbits(63)
    elif not -(1 << 63) <= seed < (1 << 64):
        raise bad("seed must fit in 64 bits", "seed")
    else:  # a negative seed is the unsigned one with the same 64 bits (OpenAI clients send signed ints)
        seed &= (1 << 64) - 1
    draft = lim.default_draft if req.draft is None else req.draft
    if not 0 <= draft <= MAX_DRAFT:
        raise bad(f"draft must be in 0..{MAX_DRAFT} (0 = no speculation), got {draft}", "draft")
    if draft > 0 and not lim.has_mtp:
        draft = 0 if req.draft is None else draft
        if draft:
            raise bad(f"{NO_MTP_HEAD}, so it cannot speculate: use draft=0", "draft")
    for tid in req.stop_token_ids or []:
        if not 0 <= tid < lim.vocab_size:
            raise bad(f"stop_token_ids: {tid} is out of range for vocabulary size {lim.vocab_size}",
                      "stop_token_ids")
    params = SamplingParams(temperature=float(t), top_k=top_k, top_p=float(top_p), min_p=float(min_p),
                            repetition_penalty=float(rp), frequency_penalty=float(req.frequency_penalty or 0.0),
                            presence_penalty=float(req.presence_penalty or 0.0), penalty_last_n=pln, seed=seed,
                            mode=req.sampling_mode or "rejection", logit_bias=bias)
    return params, n, draft


# vLLM's request fields that hyspec does not implement and that would change the output:
# (field, the values besides null that mean "off", why / what to do instead). Set to anything else they
# are a 400 naming the field, so a request migrating from vLLM is never answered as if
# they had not been sent.
UNSUPPORTED = (
    ("min_tokens", (0,), "EOS and stop strings are never suppressed"),
    ("prompt_logprobs", (), "use echo with logprobs (/v1/completions) for the prompt's logprobs"),
    ("use_beam_search", (False,), "there is no beam search"),
    ("truncate_prompt_tokens", (), "send a prompt that fits"),
    ("skip_special_tokens", (True,), "special tokens are always left out of the text"),
    ("return_tokens_as_token_ids", (False,), "use return_token_ids for the generated ids"),
    ("bad_words", ([],), ""),
    ("allowed_token_ids", (), "use guided_choice / guided_regex / guided_grammar"),
    ("logits_processors", ([],), ""),
    ("structured_outputs", (), "use response_format or guided_json / guided_regex / guided_choice / "
                               "guided_grammar"),
    ("guided_whitespace_pattern", (), "JSON is generated compact"),
    ("extra_body", ({},), "extra_body is the openai client's argument: its fields go at the top level of "
                          "the request body"),  # (an empty one drops nothing)
)
UNSUPPORTED_CHAT = (
    ("chat_template", (), "the server's template is set with --chat-template"),
    ("continue_final_message", (False,), ""),
    ("echo", (False,), "echo is a /v1/completions field"),
    ("documents", ([],), ""),
)


def refuse_unsupported(req, fields=UNSUPPORTED) -> None:
    for name, off, hint in fields:
        v = getattr(req, name, None)
        if v is not None and not any(v == o and type(v) is type(o) for o in off):
            raise APIError(400, f"{name} is not supported{': ' + hint if hint else ''}", param=name,
                           code="unsupported_value")


def stop_strings(req) -> list[str]:
    s = req.stop
    if s is None:
        return []
    stops = [x for x in ([s] if isinstance(s, str) else s) if x]
    if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
        raise bad(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    return stops
