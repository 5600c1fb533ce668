"""Replay a text through the target and its MTP head to measure draft acceptance offline.

``replay_acceptance`` answers "how well would the MTP head draft on *this* text?" without
running the speculative loop: the target runs once over the whole text with teacher
forcing (in chunks, so long files fit in memory), and at every ``stride``-th position the
MTP head drafts K tokens greedily, exactly as a round of the loop would from that point.

Indexing (the draft-KV layout of ``hyspec.speculative.drafter``)::

    text      t_0  t_1  t_2  t_3  ...
    target    h_0  h_1  h_2  ...          h_i = hidden of row i (it predicts t_{i+1})
    draft KV  row i = (t_{i+1}, h_i)      its MTP output predicts t_{i+2}

A replay "position" i is the round that drafts from row i: d_1 comes from row i's MTP
output, d_2 from chaining (d_1, MTP hidden) at row i+1, and so on up to d_K at row
i+K-1. Draft d_j is compared with the real token t_{i+1+j}; depth j counts as accepted
iff d_1..d_j all equal t_{i+2}..t_{i+j+1} (teacher-forced greedy acceptance). Positions
with i+K+1 >= len(text) are skipped (not all K drafts could be judged).

The chained drafts of position i overwrite draft KV rows i+1..i+K-1, which later
positions need with their true values. Those rows are saved before the chain and put
back after it, so every position sees the true rows 0..i (what the loop's refill gives)
and its own chain above them (attention at row r only reads rows <= r).

Drafting at i needs the target's greedy predictions up to row i+K (for the optional
"vs target" metric), so a position is judged once the target has run that far: positions
wait in a small queue (at most one chunk plus K) with their MTP hidden row.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import torch

from hyspec.config import no_mtp_error
from hyspec.decode import check_prompt
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import int_in
from hyspec.speculative.drafter import draft_logits, draft_vocab
from hyspec.speculative.loop import MAX_DRAFT
from hyspec.speculative.telemetry import SpecTelemetry

Progress = Callable[[int, int], None]


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL), inf where that overflows a float (a mean NLL above ~709.78 nats)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def check_finite_logits(logits: torch.Tensor, start: int, dtype) -> None:
    """ValueError where the forward gave NaN or inf logits (activations that overflow the
    model's dtype, e.g. float16): scores and perplexities of them would be NaN."""
    bad = ~torch.isfinite(logits).all(dim=-1)
    if bool(bad.any()):
        first = start + int(bad.nonzero()[0, 0])
        name = str(dtype).removeprefix("torch.")
        why = ("its activations overflow that dtype (load it in float32 or bfloat16)" if name == "float16" else
               "its activations overflow (load it in float32)" if name == "bfloat16" else
               "its activations overflow even this dtype: the checkpoint's weights may be damaged")
        raise ValueError(f"the model's logits are not finite (NaN or inf) from position {first} on, in {name}: {why}")


def _prefix_len(drafts: list[int], reference: list[int]) -> int:
    """How many leading drafts equal the reference tokens (the accepted count)."""
    n = 0
    for drafted, wanted in zip(drafts, reference):
        if drafted != wanted:
            break
        n += 1
    return n


def _rates(accepted_at: list[int], n: int, k: int) -> dict:
    """Per-depth summary from counts of positions accepting at least d+1 drafts."""
    through = [a / n if n else 0.0 for a in accepted_at]  # P(d_1..d_{d+1} all accepted)
    conditional = []
    for d in range(k):
        reached = n if d == 0 else accepted_at[d - 1]
        conditional.append(accepted_at[d] / reached if reached else 0.0)
    # a round drafting K' tokens accepts min(a, K'), whose mean is sum_{d<K'} P(a > d)
    acceptance_length = [1.0 + sum(through[:depth]) for depth in range(1, k + 1)]
    return {"accepted_at": list(accepted_at), "accept_rate_at": through, "conditional_rate_at": conditional,
            "acceptance_length": acceptance_length}


@torch.no_grad()
def replay_acceptance(model: HybridLM, ids: list[int], *, k: int = 4, stride: int = 1, chunk: int = 512,
                      hidden: str = "post", progress: Progress | None = None,
                      return_drafts: bool = False) -> dict:
    """Teacher-forced draft acceptance of the MTP head over `ids` (see the module doc).

    k: drafts per position (1..16); stride: draft at every stride-th position; chunk:
    target/MTP rows per forward; hidden: "post" (final-norm, the Qwen convention) or "pre"
    target hiddens seed the MTP head; progress(done, total): called after each chunk with
    the number of text tokens processed; return_drafts: also return every position's K
    drafts (otherwise a chain stops as soon as its outcome is decided).

    Returns a JSON-able dict:
      tokens, positions (judged positions), k, stride, chunk, hidden;
      nll (mean target negative log-likelihood per next token, nats), nll_sum,
      nll_tokens (= tokens - 1), perplexity, target_top1 (share of rows whose argmax is the
      real next token);
      drafted_at, accepted_at, accept_rate_at (P(accept through depth d)),
      conditional_rate_at (P(accept d | accepted d-1)), acceptance_length (list; entry
      K'-1 is 1 + sum_{d<K'} accept_rate_at[d], the implied tokens per round with K'
      drafts), tau (mean accepted drafts at K = k);
      telemetry: SpecTelemetry.to_dict() with one round of k drafts per position;
      vs_target: the same rates when drafts are judged against the target's own greedy
      prediction of each token (teacher-forced) instead of the text (given the text
      before it, not the drafts: past a draft that equals the target's token and not the
      text's, it is not what greedy speculation from that prefix would accept);
      per_position: {"position": [...], "accepted": [...], "accepted_vs_target": [...]};
      drafts (only with return_drafts): [[d_1..d_k] per position];
      mtp_forwards, seconds.
    """
    checked = (int_in(k, 1, MAX_DRAFT), int_in(stride, 1), int_in(chunk, 1))  # (numpy integers as Python ints)
    if checked[0] is None:
        raise ValueError(f"k (drafts per position) must be an integer in 1..{MAX_DRAFT}, got {k!r}")
    if checked[1] is None:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    if checked[2] is None:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    k, stride, chunk = checked
    if hidden not in ("post", "pre"):
        raise ValueError(f"hidden must be 'post' or 'pre', got {hidden!r}")
    if not model.has_mtp:
        raise no_mtp_error(": there is nothing to replay")
    ids = [int(t) for t in ids]
    if len(ids) < 2:
        raise ValueError(f"the text must have at least 2 tokens to replay, got {len(ids)}")
    check_prompt(ids, model.cfg.vocab_size)

    t0 = time.perf_counter()
    n_tokens = len(ids)
    dev = model.device
    token_ids = torch.tensor(ids, device=dev, dtype=torch.long)
    cache = model.new_cache(n_tokens)
    # chained rows reach i+k-1 <= n_tokens-3; the fill reaches row n_tokens-2
    draft_kv = model.new_draft_kv(n_tokens)
    vocab = draft_vocab(model)
    forwards = 0

    nll_sum = 0.0
    top1 = 0
    greedy = [-1] * (n_tokens + 1)  # greedy[p] = target argmax of row p-1 (its prediction of t_p)
    vs_text = SpecTelemetry()  # drafts judged against the text
    vs_target = SpecTelemetry()  # drafts judged against the target's greedy tokens
    positions: list[int] = []
    accepted: list[int] = []
    accepted_vs_target: list[int] = []
    drafts_out: list[list[int]] = []
    # positions waiting for their judgement: (position i, MTP hidden of row i [1, H], first draft d_1)
    queue: deque[tuple[int, torch.Tensor, int]] = deque()

    def judge(i: int, mtp_row: torch.Tensor, draft: int) -> None:
        nonlocal forwards
        text = ids[i + 2 : i + 2 + k]
        target = greedy[i + 2 : i + 2 + k]
        drafts = [draft]
        if k > 1:
            lo, hi = i + 1, i + k  # draft KV rows the chain overwrites
            saved_k, saved_v = draft_kv.k[:, lo:hi].clone(), draft_kv.v[:, lo:hi].clone()
            mtp_hidden = mtp_row
            for j in range(1, k):
                if not return_drafts and _prefix_len(drafts, text) < j and _prefix_len(drafts, target) < j:
                    break  # both prefixes already broken: deeper drafts cannot count
                mtp_hidden = model.mtp_hidden(torch.tensor([draft], device=dev), mtp_hidden, StepCtx(start=i + j),
                                              draft_kv)
                forwards += 1
                draft = int(torch.argmax(draft_logits(model, mtp_hidden, vocab)[0]))
                drafts.append(draft)
            draft_kv.k[:, lo:hi] = saved_k
            draft_kv.v[:, lo:hi] = saved_v
        n_text, n_target = _prefix_len(drafts, text), _prefix_len(drafts, target)
        vs_text.record_round(k, n_text)
        vs_target.record_round(k, n_target)
        positions.append(i)
        accepted.append(n_text)
        accepted_vs_target.append(n_target)
        if return_drafts:
            drafts_out.append(drafts)

    start = 0
    while start < n_tokens:
        end = min(start + chunk, n_tokens)
        hidden_pre, hidden_post = model.forward_states(token_ids[start:end], cache,
                                                       StepCtx(start=start, chunked=True))
        logits = model.logits(hidden_post)  # [T, V]; row r predicts t_{start+r+1}
        check_finite_logits(logits, start, model.dtype)
        predictions = torch.argmax(logits, dim=-1).tolist()
        for r, predicted in enumerate(predictions):
            greedy[start + r + 1] = predicted
        rows_end = min(end, n_tokens - 1)  # rows with a real next token (and a draft KV pair)
        n_rows = rows_end - start
        if n_rows > 0:
            next_ids = token_ids[start + 1 : rows_end + 1]  # [n_rows]
            logprobs = (logits[:n_rows].gather(1, next_ids[:, None])[:, 0]
                        - torch.logsumexp(logits[:n_rows], dim=-1))
            nll_sum -= float(logprobs.double().sum())
            top1 += int((torch.tensor(predictions[:n_rows], device=dev) == next_ids).sum())
            seed = (hidden_post if hidden == "post" else hidden_pre)[:n_rows]
            # fills draft KV rows start..rows_end-1
            mtp_rows = model.mtp_hidden(next_ids, seed, StepCtx(start=start), draft_kv)
            forwards += 1
            chunk_positions = [i for i in range(start + (-start) % stride, rows_end, stride) if i + k + 1 < n_tokens]
            if chunk_positions:  # first drafts of the chunk's positions in one head matmul
                rows = torch.tensor(chunk_positions, device=dev) - start
                first_drafts = torch.argmax(draft_logits(model, mtp_rows[rows], vocab), dim=-1).tolist()
                queue.extend((i, mtp_rows[i - start : i - start + 1], d)
                             for i, d in zip(chunk_positions, first_drafts))
        # judge every queued position whose K drafts' targets are all known (rows <= i+k done)
        while queue and queue[0][0] + k + 1 <= end:
            judge(*queue.popleft())
        del logits, hidden_pre, hidden_post
        start = end
        if progress is not None:
            progress(start, n_tokens)
    assert not queue

    n_positions = len(positions)
    text_rates = _rates(vs_text.accepted_at + [0] * (k - len(vs_text.accepted_at)), n_positions, k)
    target_rates = _rates(vs_target.accepted_at + [0] * (k - len(vs_target.accepted_at)), n_positions, k)
    n_scored = n_tokens - 1
    nll = nll_sum / n_scored
    out = {
        "tokens": n_tokens, "positions": n_positions, "k": k, "stride": stride, "chunk": chunk, "hidden": hidden,
        "nll": nll, "nll_sum": nll_sum, "nll_tokens": n_scored, "perplexity": perplexity(nll),
        "target_top1": top1 / n_scored,
        "drafted_at": [n_positions] * k,
        **text_rates,
        "tau": vs_text.tau,
        "telemetry": vs_text.to_dict(),
        "vs_target": {**target_rates, "tau": vs_target.tau},
        "per_position": {"position": positions, "accepted": accepted, "accepted_vs_target": accepted_vs_target},
        "mtp_forwards": forwards,
        "seconds": time.perf_counter() - t0,
    }
    if return_drafts:
        out["drafts"] = drafts_out
    return out


__all__ = ["replay_acceptance", "perplexity", "check_finite_logits"]
