"""`hyspec bench --batch 1,4,16`: aggregate decode throughput of the engine core's scheduler
at several batch sizes (plain, and speculative with the forced-acceptance drafter), the
batch-invariance check (each sequence's tokens in a batch == its tokens alone), and the
slot memory accounting."""

from __future__ import annotations

import time

import torch

from hyspec.core.request import Request
from hyspec.core.scheduler import Scheduler
from hyspec.core.slots import slot_bytes
from hyspec.speculative.loop import SpecOptions


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _run(model, reqs, batch: int) -> tuple[float, int]:
    """Prefill every request first, then time the rounds: (decode seconds, tokens emitted in them)."""
    sched = Scheduler(model, max_batch=batch)
    for r in reqs:
        sched.submit(r)
    while sched.waiting or sched.prefilling:
        sched.step()
    before = sum(len(r.tokens) for r in reqs)
    _sync(model.device)
    t0 = time.perf_counter()
    sched.run()
    _sync(model.device)
    return time.perf_counter() - t0, sum(len(r.tokens) for r in reqs) - before


def batch_bench(model, batches: list[int], *, prompt_len: int, new_tokens: int, k: int = 3,
                forced=(0.9, 0.8, 0.7, 0.6), seed: int = 0, log=print) -> dict:
    dev = model.device
    ctx = prompt_len + new_tokens + k + 2
    per = slot_bytes(model.cfg, model.dtype, ctx, model.has_mtp)
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
    out = {"context_len": ctx, "slot_bytes": per, "free_bytes": free,
           "slots_that_fit_free_memory": (free // per["total"]) if free else None, "backend": "reference", "runs": {}}
    log(f"slot at {ctx} tokens: {per['total'] / 2**20:.2f} MiB (KV {per['kv'] / 2**20:.2f}, draft KV "
        f"{per['draft_kv'] / 2**20:.2f}, linear state {per['linear'] / 2**20:.2f})"
        + (f"; {out['slots_that_fit_free_memory']} fit in the {free / 2**30:.1f} GiB free" if free else ""))
    g = torch.Generator().manual_seed(seed)
    B_max = max(batches)
    prompts = [torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(B_max)]
    alone = {}
    for B in batches:
        plain = [Request(prompt_ids=p, max_new_tokens=new_tokens) for p in prompts[:B]]
        t_plain, n_plain = _run(model, plain, B)
        row = {"plain_tok_s": n_plain / t_plain}
        if model.has_mtp and k > 0:
            spec = [Request(prompt_ids=p, max_new_tokens=new_tokens, draft=k,
                            spec=SpecOptions(k=k, forced_rates=tuple(forced)), reference=r.tokens)
                    for p, r in zip(prompts[:B], plain)]
            t_spec, n_spec = _run(model, spec, B)
            row["spec_tok_s"] = n_spec / t_spec
            row["spec_vs_plain"] = row["spec_tok_s"] / row["plain_tok_s"]
            row["spec_equals_plain"] = all(s.tokens == p.tokens for s, p in zip(spec, plain))
        for i, r in enumerate(plain):
            alone.setdefault(i, r.tokens)
        row["batch_invariant"] = all(r.tokens == alone[i] for i, r in enumerate(plain))
        out["runs"][B] = row
        log(f"B={B:>3}: plain {row['plain_tok_s']:9.1f} tok/s"
            + (f", forced K={k} {row['spec_tok_s']:9.1f} tok/s (x{row['spec_vs_plain']:.2f}), spec == plain: "
               f"{row['spec_equals_plain']}" if "spec_tok_s" in row else "")
            + f", tokens equal to smaller batches: {row['batch_invariant']}")
    base = out["runs"][min(batches)]["plain_tok_s"]
    for B, row in out["runs"].items():
        row["plain_vs_smallest_batch"] = row["plain_tok_s"] / base
    return out
