"""The speculative loop: draft with the MTP head, verify in one target forward, accept,
commit (rolling the hybrid cache back when needed), refresh the draft KV, emit.

Words (see docs/speculative.md): pending = emitted token not yet run through the target;
bonus = the target's own token at the first rejected position (or after a full accept);
every round emits accepted + 1 tokens and leaves the bonus pending for the next verify.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hyspec.decode import (GREEDY, GenerationResult, check_prompt, check_stop, choose_token, constrained, emit,
                           target_probs)
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import (SamplingParams, apply_penalties, coupled_speculative, coupled_token, draft_token,
                             greedy_token, speculative_sample)
from hyspec.spec.drafter import ForcedDrafter, MTPDrafter
from hyspec.spec.rollback import make_rollback
from hyspec.spec.telemetry import SpecTelemetry

MAX_DRAFT = 16


@dataclass(frozen=True)
class SpecOptions:
    """k: drafts per round (1..16). rollback: checkpoint | rescan | replay. p_min: stop
    drafting when the drafter's probability for its token falls below this. adaptive:
    next round's k = clamp(accepted + 1, adaptive_floor, k). hidden: which target hidden
    seeds the MTP head ("post" final-norm, the Qwen convention, or "pre").
    forced_rates: use the forced-acceptance drafter with these per-depth rates.
    prime_pending: start with the prefill's token pending (False: the first round verifies
    drafts only, the 'no pending' form used when continuing a session)."""

    k: int = 3
    rollback: str = "checkpoint"
    p_min: float = 0.0
    adaptive: bool = False
    adaptive_floor: int = 1
    hidden: str = "post"
    forced_rates: tuple[float, ...] | None = None
    forced_seed: int = 0
    prime_pending: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= MAX_DRAFT:
            raise ValueError(f"draft length k must be an integer in 1..{MAX_DRAFT}, got {self.k!r} "
                             f"(use --draft 0 for plain decoding)")
        make_rollback(self.rollback)
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), got {self.p_min}")
        if not 1 <= self.adaptive_floor <= self.k:
            raise ValueError(f"adaptive_floor must be in 1..k={self.k}, got {self.adaptive_floor}")
        if self.hidden not in ("post", "pre"):
            raise ValueError(f"hidden must be 'post' or 'pre', got {self.hidden!r}")


class _Chooser:
    """Drafter-side token choice for one round, mirroring the target's transformation."""

    def __init__(self, params: SamplingParams, history: list[int], want_prob: bool, constraint=None) -> None:
        self.params, self.history = params, history
        self.want_prob = want_prob  # greedy drafts need their probability only for p_min
        self.constraint = constraint  # drafts come from the drafter's row masked after the earlier drafts
        self.drafts: list[int] = []

    def __call__(self, logits: torch.Tensor, j: int, position: int):
        hist = self.history + self.drafts[:j]
        p = self.params
        if self.constraint is not None:
            logits = constrained(logits, self.constraint, self.drafts[:j])
            if logits is None or not bool(torch.isfinite(logits).any()):  # (a reduced draft vocabulary
                return None, None, 0.0  # may score none of the allowed tokens)
        if p.greedy:
            lg = apply_penalties(logits, hist, p) if p.has_penalties else logits
            tok = greedy_token(lg)
            prob = float(torch.softmax(lg.double(), -1)[tok]) if self.want_prob else 1.0
            self._push(j, tok)
            return tok, None, prob
        q = target_probs(logits, hist, p)  # the same filters as the target row
        tok = coupled_token(q, p.seed, position) if p.mode == "coupled" else draft_token(q, p.seed, position)
        self._push(j, tok)
        return tok, q, float(q[tok])

    def _push(self, j: int, tok: int) -> None:
        del self.drafts[j:]
        self.drafts.append(tok)


def _mask_rows(rows: torch.Tensor, drafts: list[int], constraint) -> tuple[torch.Tensor, list[bool]]:
    """Verify row j masked by the constraint's state after drafts[:j]. A row where it allows
    nothing keeps its logits (it is reached only when every draft before it is accepted,
    and then the round ends there with stop_reason "constraint"); returns (rows, dead)."""
    if constraint is None:
        return rows, [False] * rows.shape[0]
    out, dead = [], []
    for j in range(rows.shape[0]):
        m = constrained(rows[j], constraint, drafts[:j])
        dead.append(m is None)
        out.append(rows[j] if m is None else m)
    return torch.stack(out), dead


def _accept(params: SamplingParams, rows: torch.Tensor, drafts: list[int], q_rows, history: list[int],
            position: int) -> tuple[int, int]:
    """rows [k+1, V] target logits for the positions position..position+k (already masked
    by a constraint). Returns (accepted drafts n, next token)."""
    k = len(drafts)
    if params.greedy:
        for j in range(k + 1):
            lg = rows[j]
            if params.has_penalties:
                lg = apply_penalties(lg, history + drafts[:j], params)
            tok = greedy_token(lg)
            if j == k or tok != drafts[j]:
                return j, tok
    p_rows = torch.stack([target_probs(rows[j], history + drafts[:j], params) for j in range(k + 1)])
    if params.mode == "coupled":
        return coupled_speculative(p_rows, drafts, params.seed, position)
    if k == 0:
        return speculative_sample(p_rows, p_rows[:0], [], params.seed, position)
    return speculative_sample(p_rows, q_rows, drafts, params.seed, position)


@torch.no_grad()
def generate_speculative(model: HybridLM, prompt: list[int], *, max_new_tokens: int, opts: SpecOptions,
                         params: SamplingParams | None = None, stop_ids=(), reference: list[int] | None = None,
                         telemetry: SpecTelemetry | None = None, constraint=None) -> GenerationResult:
    """`constraint` (hyspec.constraints.Constraint, advanced in place): drafts are drawn from
    the drafter's rows masked by its state after the earlier drafts, verify row j is masked
    by its state after drafts[:j], acceptance and residual use the masked distributions, and
    after each round it has consumed the emitted tokens."""
    params = params if params is not None else GREEDY
    check_prompt(prompt, model.cfg.vocab_size)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stops = check_stop(stop_ids, model.cfg.vocab_size)
    if not model.has_mtp:
        raise ValueError("this checkpoint has no MTP head (no mtp.* weights), so it cannot speculate; "
                         "use --draft 0 for plain decoding")
    tel = telemetry if telemetry is not None else SpecTelemetry()
    P = len(prompt)
    max_len = P + max_new_tokens + opts.k + 2
    if opts.forced_rates is not None:
        if reference is None:
            raise ValueError("the forced-acceptance drafter needs a reference continuation")
        drafter = ForcedDrafter(model, max_len, list(prompt) + list(reference), list(opts.forced_rates),
                                seed=opts.forced_seed, hidden=opts.hidden)
    else:
        drafter = MTPDrafter(model, max_len, hidden=opts.hidden)
    rollback = make_rollback(opts.rollback)
    cache = model.new_cache(max_len)
    dev = model.device
    t0 = time.perf_counter()

    # ---- prefill ---------------------------------------------------------------------
    pre, post = model.forward_states(torch.tensor(prompt, device=dev), cache, StepCtx(start=0, chunked=True))
    seed_h = post if opts.hidden == "post" else pre  # [P, H] hiddens that seed the drafter
    last_logits = model.logits(post[-1:])  # [1, V] target row predicting position P
    out: list[int] = []
    pending: int | None = None
    reason = "length"
    direct = 0  # tokens taken from an already-known target row, without a verify
    first = constrained(last_logits[0], constraint)
    if first is None:
        reason = "constraint"
    elif opts.prime_pending or P < 2:
        pending = choose_token(first, list(prompt), params, P)
        out.append(pending)
        if constraint is not None:
            constraint.commit([pending])
        direct += 1
        # draft rows 0..P-1: (prompt[1:] + pending) paired with hiddens 0..P-1
        fill_tokens, fill_h, fill_start = list(prompt[1:]) + [pending], seed_h, 0
    else:
        fill_tokens, fill_h, fill_start = list(prompt[1:]), seed_h[:-1], 0
    h_last = seed_h[-1:]  # hidden at cache.pos - 1
    if pending is not None and pending in stops:
        reason = "eos"
    t1 = time.perf_counter()
    k_next = opts.k
    extra_bytes = 0

    # ---- rounds ----------------------------------------------------------------------
    while reason not in ("eos", "constraint") and len(out) < max_new_tokens:
        remaining = max_new_tokens - len(out)
        k = min(k_next, remaining - 1)  # every round also emits one token of the target's own
        history = list(prompt) + out
        base = cache.pos  # absolute position of the first verify token
        first_draft_pos = base + (1 if pending is not None else 0)
        chooser = _Chooser(params, history, want_prob=opts.p_min > 0.0, constraint=constraint)
        drafts, q_rows, _ = drafter.propose(fill_tokens, fill_h, fill_start, k, first_draft_pos, chooser,
                                            opts.p_min)
        if pending is None and not drafts:  # nothing to verify: take the known row's token
            row = constrained(last_logits[0], constraint)
            if row is None:
                reason = "constraint"
                break
            tok = choose_token(row, history, params, base)
            pending = tok
            out.append(tok)
            if constraint is not None:
                constraint.commit([tok])
            direct += 1
            fill_tokens, fill_h, fill_start = [tok], h_last, base - 1
            if tok in stops:
                reason = "eos"
            continue

        # verify [pending?, d1..dk] in one forward, keeping what rollback needs
        snap = cache.snapshot()
        vtok = ([pending] if pending is not None else []) + drafts
        ctx = StepCtx(start=base, exact=True, record=rollback.record)
        vpre, vpost = model.forward_states(torch.tensor(vtok, device=dev), cache, ctx)
        vlogits = model.logits(vpost, ctx)  # [T, V]; row r predicts position base + r + 1
        extra_bytes = max(extra_bytes, cache.record_nbytes() + snap.nbytes())
        rows = vlogits if pending is not None else torch.cat([last_logits, vlogits])  # rows for d1..dk, bonus
        mrows, dead = _mask_rows(rows, drafts, constraint)
        n, bonus = _accept(params, mrows, drafts, q_rows, history, first_draft_pos)
        tel.record_round(len(drafts), n)
        if dead[n]:  # every draft accepted, and the constraint allows nothing after them
            before = len(out)
            reason = "eos" if emit(out, drafts[:n], stops, max_new_tokens) else "constraint"
            constraint.commit(out[before:])
            break

        # commit the first j verify rows (pending + accepted drafts)
        j = n + (1 if pending is not None else 0)
        if j == len(vtok):
            cache.clear_records()  # full accept: the cache is already right
        elif j == 0:
            cache.restore(snap)  # no pending and nothing accepted: fold the round away
        else:
            rollback.keep(model, cache, snap, j, vtok)
        vseed = vpost if opts.hidden == "post" else vpre
        # draft rows for the committed tokens get the target's true hiddens, then the new pending
        fill_tokens = vtok[:j] + [bonus]
        fill_h = torch.cat([h_last, vseed[:j]])
        fill_start = base - 1
        if j > 0:
            h_last = vseed[j - 1 : j]
        last_logits = rows[n : n + 1]
        pending = bonus

        before = len(out)
        if emit(out, drafts[:n] + [bonus], stops, max_new_tokens):
            reason = "eos"
        if constraint is not None:
            constraint.commit(out[before:])
        if opts.adaptive:
            k_next = max(opts.adaptive_floor, min(n + 1, opts.k))
    t2 = time.perf_counter()
    stats = {
        "prompt_tokens": P, "generated_tokens": len(out), "prefill_s": t1 - t0, "decode_s": t2 - t1,
        "decode_tok_s": (len(out) - 1) / (t2 - t1) if len(out) > 1 and t2 > t1 else None,
        "target_forwards": tel.rounds, "mtp_forwards": drafter.forwards, "k": opts.k,
        "direct_tokens": direct,  # generated = direct + accepted + rounds (unless EOS/limit cut a round)
        "rollback": opts.rollback, "rollback_extra_bytes_per_round": extra_bytes,
        "spec": tel.to_dict(),
    }
    return GenerationResult(out[:max_new_tokens], reason, stats)
