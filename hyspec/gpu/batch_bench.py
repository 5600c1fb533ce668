"""`hyspec bench --batch 1,4,16,64` on a GPU: the BatchDecoder's aggregate throughput per
batch size (plain, and speculative with the forced-acceptance drafter), its memory
(bytes per lane, graph pool), and the batch-invariance check: many prompts of mixed
lengths, each decoded alone vs in a continuously refilled batch with staggered arrivals,
greedy plain and K=3, compared bitwise.

Also runnable alone: ``python -m hyspec.gpu.batch_bench --config b2 --batch 1,4,16,64``.
"""
from __future__ import annotations

import time

import torch

from hyspec.gpu.batch import BatchDecoder
from hyspec.gpu.batch_loop import LaneRequest, run_batch

# issue targets: plain aggregate at batch 16 / 64 over batch 1, forced speculation over plain
# at batch 16, sampled over greedy speculation
TARGETS = {"plain_B16_vs_B1": 12.0, "plain_B64_vs_B1": 35.0, "spec_vs_plain_B16": 1.5, "sampled_vs_greedy_spec": 0.9}


def preset_model(config: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """`hyspec bench`'s model of a preset (random weights, built on the GPU): the model of
    bench/profile_batch.py, bench/runner_ab.py and bench/tile_bench.py."""
    from types import SimpleNamespace

    from hyspec.bench import make_model

    return make_model(SimpleNamespace(model=None, config=config, seed=seed), torch.device("cuda"), dtype)


def random_lanes(model, lanes: int, prompt_len: int, max_len: int, k: int, graphs: bool = True,
                 setup=None) -> BatchDecoder:
    """A BatchDecoder of `lanes` lanes, each prefilled with its own random prompt (the same
    prompts every call: seed 0) and started greedily with k drafts per round; setup(dec),
    when given, runs before the first prefill (e.g. to set runner attributes).  The set-up
    of bench/profile_batch.py and bench/runner_ab.py."""
    d = BatchDecoder(model, max_len, k, lanes, graphs=graphs)
    if setup is not None:
        setup(d)
    g = torch.Generator().manual_seed(0)
    for lane in range(lanes):
        d.prefill_start(lane, torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist(), k)
    return d


def _target(value: float, name: str) -> dict:
    return {"value": round(value, 3), "target": TARGETS[name], "met": value >= TARGETS[name]}  # 3 places: 0.899 is not 0.9


def lane_shape(batch: int, prompt_len: int, new_tokens: int, k: int = 3, inv_batch: int = 16,
               inv_tokens: int = 500) -> tuple[int, int]:
    """(lanes, positions per lane) of gpu_batch_bench's decoder: room for the largest batch and
    the invariance check's batch, each lane long enough for both runs' tokens and K drafts."""
    return max(batch, inv_batch), max(prompt_len, 64) + max(new_tokens, inv_tokens) + k + 8


def gpu_batch_bench(model, batches: list[int], *, prompt_len: int, new_tokens: int, k: int = 3,
                    forced=(0.9, 0.8, 0.7, 0.6), seed: int = 0, inv_prompts: int = 64, inv_tokens: int = 500,
                    inv_batch: int = 16, sampled_extra=(), draft_vocab: int = 0, weight_bytes: int | None = None,
                    bandwidth_gbps: float | None = None, log=print) -> dict:
    """sampled_extra: names of SAMPLED_VARIANTS measured after the sampled speed (figures
    only, no targets); draft_vocab N > 0: forced speculation (k drafts) again at every batch size with a
    reduced draft vocabulary of N ids (figures beside the full-vocabulary ones, no target).
    weight_bytes and bandwidth_gbps (a decode step's weight bytes, the copy bandwidth):
    also each plain step's bandwidth floor and its share of it (bandwidth_floor)."""
    dev = model.device
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    B_max = max(batches)
    slots, max_len = lane_shape(B_max, prompt_len, new_tokens, k, inv_batch, inv_tokens)
    t0 = time.perf_counter()
    dec = BatchDecoder(model, max_len, k, slots)
    sizes = sorted({s for s in dec.sizes if s <= slots})
    # the regimes of the timed runs (greedy; sampled_speed's coupled top-p lanes, every lane
    # speculative), captured up front; the invariance check's capture on first use
    regimes = [sampled_regime()] + [sampled_regime(SAMPLED_VARIANTS[v]) for v in sampled_extra]
    dec.capture(sizes, [k], forced=(False, True), sampled=(False, *regimes), plain=(False,))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    out = {"backend": "cuda-graphs", "slots": slots, "max_len": max_len, "lane_bytes": dec.slot_bytes(),
           "graph_pool_bytes": dec.step_graphs.pool_bytes, "graphs": len(dec.step_graphs.graphs),
           "graphs_ok": not dec.step_graphs.failed,
           "setup_s": time.perf_counter() - t0, "runs": {}}
    log(f"BatchDecoder: {slots} lanes of {max_len} positions, {dec.slot_bytes() / 2**20:.1f} MiB per lane; "
        f"{len(dec.step_graphs.graphs)} graphs captured ({dec.step_graphs.pool_bytes / 2**20:.1f} MiB pool) in {out['setup_s']:.1f} s")
    prompts = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(B_max)]
    rates = tuple(forced)
    references = {}  # B -> each prompt's plain output (the reduced-draft-vocabulary runs reuse them)
    for B in batches:
        plain = [LaneRequest(prompt=p, max_new_tokens=new_tokens) for p in prompts[:B]]
        plain_stats = run_batch(dec, plain, max_batch=B)
        spec = [LaneRequest(prompt=p, max_new_tokens=new_tokens, k=k, reference=r.tokens)
                for p, r in zip(prompts[:B], plain)]
        spec_stats = run_batch(dec, spec, max_batch=B, forced_rates=rates)
        references[B] = [r.tokens for r in plain]
        row = {"plain_tok_s": plain_stats["round_tok_s"], "spec_tok_s": spec_stats["round_tok_s"],
               "spec_vs_plain": spec_stats["round_tok_s"] / plain_stats["round_tok_s"],
               # of the rounds' wall time, the share the host spent waiting for the GPU (near 1: GPU-bound)
               "plain_host_wait": plain_stats["wait_s"] / plain_stats["rounds_s"],
               "spec_host_wait": spec_stats["wait_s"] / spec_stats["rounds_s"],
               "spec_equals_plain": all(a.tokens == b.tokens for a, b in zip(spec, plain)),
               "mean_accepted": sum(r.telemetry.accepted for r in spec) / max(1, sum(r.rounds for r in spec))}
        out["runs"][B] = row
        log(f"B={B:>3}: plain {row['plain_tok_s']:9.1f} tok/s, forced K={k} {row['spec_tok_s']:9.1f} tok/s "
            f"(x{row['spec_vs_plain']:.2f}, {row['mean_accepted']:.2f} accepted/round), spec == plain: "
            f"{row['spec_equals_plain']}; host waiting {row['plain_host_wait']:.0%} / {row['spec_host_wait']:.0%} of the rounds' time")
    base = out["runs"][min(batches)]["plain_tok_s"]
    for row in out["runs"].values():
        row["plain_vs_B1"] = row["plain_tok_s"] / base
    if weight_bytes and bandwidth_gbps:
        try:
            out["floor"] = bandwidth_floor(model.cfg, model.dtype, weight_bytes, bandwidth_gbps, batches,
                                           prompt_len + new_tokens / 2,
                                           {B: r["plain_tok_s"] for B, r in out["runs"].items()})
            log_floor(out["floor"], out["runs"], log)
        except Exception as e:  # noqa: BLE001 - a figure beside the runs: record and go on
            out.setdefault("errors", {})["floor"] = f"{type(e).__name__}: {e}"
            log(f"!! bandwidth floor failed: {e}")
    if draft_vocab:
        try:
            reduced_draft_vocab(model, batches, prompts, references, new_tokens, k, rates, draft_vocab, slots, max_len,
                                out, log)
        except Exception as e:  # noqa: BLE001 - record and go on
            out.setdefault("errors", {})["draft_vocab"] = f"{type(e).__name__}: {e}"
            log(f"!! reduced draft vocabulary failed: {e}")
    try:
        out["sampled"] = sampled_speed(dec, prompts, [b for b in (1, 16) if b in batches] or [min(batches)],
                                       new_tokens, k, rates, log)
    except Exception as e:  # noqa: BLE001 - record and go on
        out.setdefault("errors", {})["sampled"] = f"{type(e).__name__}: {e}"  # (was a new dict: the floor's
        # or draft vocabulary's error before it was lost)
        log(f"!! sampled speed failed: {e}")
    for name in sampled_extra:
        try:
            out.setdefault("sampled_extra", {})[name] = sampled_speed(
                dec, prompts, [b for b in (1, 16) if b in batches] or [min(batches)], new_tokens, k, rates, log,
                variant=SAMPLED_VARIANTS[name], label=name)
        except Exception as e:  # noqa: BLE001
            out.setdefault("errors", {})[f"sampled_{name}"] = f"{type(e).__name__}: {e}"
            log(f"!! sampled {name} failed: {e}")
    if inv_prompts > 0:
        try:
            out["invariance"] = invariance(dec, model, inv_prompts, inv_tokens, inv_batch, k, prompt_len, g, log)
        except Exception as e:  # noqa: BLE001
            out.setdefault("errors", {})["invariance"] = f"{type(e).__name__}: {e}"
            log(f"!! invariance failed: {e}")
    out["targets"] = _targets(out, k)
    for name, t in out["targets"].items():
        log(f"  {name}: {t['value']} (target {t['target']}) {'met' if t['met'] else 'MISSED'}")
    return out


def reduced_draft_vocab(model, batches, prompts, references, new_tokens, k, rates, size, slots, max_len, out,
                        log) -> None:
    """Forced speculation (k drafts) at each batch size on a decoder whose drafter scores `size` ids (the first
    ones: random weights have no corpus to rank by; hyspec.speculative.drafter.first_ids_draft_vocab),
    against the full run's plain outputs (references: B -> tokens per prompt) and rates
    (the drafter's vocabulary changes only the drafts, and the forced drafter proposes the
    same tokens); its output must equal those plain outputs."""
    from hyspec.speculative.drafter import first_ids_draft_vocab

    with first_ids_draft_vocab(model, size):
        dec = BatchDecoder(model, max_len, k, slots)
        dec.capture(sorted({s for s in dec.sizes if s <= max(batches)}), [k], forced=(True,), decode=False)
        for B in batches:
            row = out["runs"][B]
            spec = [LaneRequest(prompt=p, max_new_tokens=new_tokens, k=k, reference=ref)
                    for p, ref in zip(prompts[:B], references[B])]
            st = run_batch(dec, spec, max_batch=B, forced_rates=rates)
            row["spec_dv_tok_s"] = st["round_tok_s"]
            row["spec_dv_vs_plain"] = st["round_tok_s"] / row["plain_tok_s"]
            row["spec_dv_equals_plain"] = all(a.tokens == ref for a, ref in zip(spec, references[B]))
            log(f"B={B:>3}: forced K={k} with a {size}-id draft vocabulary {st['round_tok_s']:9.1f} tok/s "
                f"(x{row['spec_dv_vs_plain']:.2f} over plain), spec == plain: {row['spec_dv_equals_plain']}")
        out["draft_vocab"] = size
        del dec


SAMPLED = dict(temperature=0.8, top_p=0.95)


# more sampled settings for --sampled-extra (overrides of the coupled T=0.8 / top-p 0.95 lanes)
SAMPLED_VARIANTS = {
    "rejection": dict(mode="rejection"),  # the default mode: accept tests, residual and bonus draws
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.1),  # coupled, penalty window 64
    "top_k": dict(top_k=50),  # coupled, top-k 50 then top-p 0.95
}


def sampled_regime(variant=None):
    """The sampling regime (graph key) of sampled_speed's requests."""
    from hyspec.gpu.sampling import SampledGraphKey
    from hyspec.sampling import SamplingParams

    return SampledGraphKey.of([SamplingParams(seed=0, **{"mode": "coupled", **SAMPLED, **(variant or {})})])


def sampled_speed(dec, prompts, batches, new_tokens, k, rates, log, variant=None, label="") -> dict:
    """Sampled (T=0.8, top-p 0.95, coupled mode, per-request seeds; variant: overrides) vs
    greedy on the same prompts: plain, and speculative with the forced drafter proposing
    each run's own plain output (coupled speculative output equals plain output, so both see
    the forced profile's acceptance; rejection mode's does not: its acceptance differs)."""
    from hyspec.sampling import SamplingParams

    out = {}
    for B in batches:
        params = [SamplingParams(seed=i, **{"mode": "coupled", **SAMPLED, **(variant or {})}) for i in range(B)]
        greedy_plain = [LaneRequest(prompt=p, max_new_tokens=new_tokens) for p in prompts[:B]]
        tps_greedy_plain = run_batch(dec, greedy_plain, max_batch=B)["round_tok_s"]
        greedy_spec = [LaneRequest(prompt=p, max_new_tokens=new_tokens, k=k, reference=r.tokens)
                       for p, r in zip(prompts, greedy_plain)]
        tps_greedy_spec = run_batch(dec, greedy_spec, max_batch=B, forced_rates=rates)["round_tok_s"]
        sampled_plain = [LaneRequest(prompt=p, max_new_tokens=new_tokens, params=q) for p, q in zip(prompts, params)]
        tps_sampled_plain = run_batch(dec, sampled_plain, max_batch=B)["round_tok_s"]
        sampled_spec = [LaneRequest(prompt=p, max_new_tokens=new_tokens, k=k, params=q, reference=r.tokens)
                        for p, q, r in zip(prompts, params, sampled_plain)]
        tps_sampled_spec = run_batch(dec, sampled_spec, max_batch=B, forced_rates=rates)["round_tok_s"]
        acc_g = sum(r.telemetry.accepted for r in greedy_spec) / max(1, sum(r.rounds for r in greedy_spec))
        acc_s = sum(r.telemetry.accepted for r in sampled_spec) / max(1, sum(r.rounds for r in sampled_spec))
        out[B] = {"greedy_plain_tok_s": tps_greedy_plain, "sampled_plain_tok_s": tps_sampled_plain,
                  "greedy_spec_tok_s": tps_greedy_spec, "sampled_spec_tok_s": tps_sampled_spec,
                  "sampled_vs_greedy_spec": tps_sampled_spec / tps_greedy_spec,
                  "sampled_vs_greedy_plain": tps_sampled_plain / tps_greedy_plain,
                  "accepted_per_round_greedy": acc_g, "accepted_per_round_sampled": acc_s,
                  "sampled_spec_equals_sampled_plain": all(a.tokens == b.tokens
                                                           for a, b in zip(sampled_spec, sampled_plain))}
        log(f"B={B:>3} sampled (T=0.8, top-p 0.95{', ' + label if label else ''}): plain {tps_sampled_plain:9.1f} tok/s (greedy "
            f"{tps_greedy_plain:9.1f}), forced K={k} {tps_sampled_spec:9.1f} tok/s (greedy {tps_greedy_spec:9.1f}; "
            f"x{tps_sampled_spec / tps_greedy_spec:.2f}; accepted/round {acc_s:.2f} vs {acc_g:.2f})")
    return out


def invariance(dec, model, n_prompts, n_tokens, batch, k, prompt_len, g, log) -> dict:
    """Each prompt alone (lane 0, batch size 1) vs all of them through `batch` lanes with
    staggered arrivals and mixed prompt lengths: greedy plain and K=3 (the MTP drafter)."""
    V = model.cfg.vocab_size
    lens = torch.randint(max(1, prompt_len // 8), max(prompt_len, 2) + 1, (n_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, V, (L,), generator=g).tolist() for L in lens]
    from hyspec.sampling import SamplingParams

    out = {"prompts": n_prompts, "tokens": n_tokens, "batch": batch}
    n_s, t_s = max(1, n_prompts // 4), max(1, n_tokens * 2 // 5)  # sampled: a quarter of the prompts, 2/5 the tokens
    for name, kk, sampled in (("plain", 0, False), (f"k{k}", k, False), ("sampled_plain", 0, True),
                              (f"sampled_k{k}", k, True)):
        ps = prompts[:n_s] if sampled else prompts
        nt = t_s if sampled else n_tokens

        def par(i):
            return SamplingParams(seed=1000 + i, mode="coupled" if i % 2 else "rejection", **SAMPLED) if sampled else None

        t0 = time.perf_counter()
        alone = []
        for i, p in enumerate(ps):
            r = LaneRequest(prompt=p, max_new_tokens=nt, k=kk, params=par(i))
            run_batch(dec, [r], max_batch=1)
            alone.append(r.tokens)
        t_alone = time.perf_counter() - t0
        # arrivals: four at a time every 7 rounds; mixed prompt lengths
        reqs = [LaneRequest(prompt=p, max_new_tokens=nt, k=kk, params=par(i), arrival=7 * (i // 4))
                for i, p in enumerate(ps)]
        t0 = time.perf_counter()
        run_batch(dec, reqs, max_batch=batch)
        t_batch = time.perf_counter() - t0
        equal = sum(r.tokens == a for r, a in zip(reqs, alone))
        out[name] = {"equal": equal, "all_equal": equal == len(ps), "prompts": len(ps), "tokens": nt,
                     "alone_s": t_alone, "batched_s": t_batch}
        log(f"invariance {name}: {equal}/{len(ps)} sequences bitwise equal alone vs batched "
            f"({len(ps)} x {nt} tokens; alone {t_alone:.1f} s, batched {t_batch:.1f} s)")
    return out


def bandwidth_floor(cfg, dtype, weight_bytes: int, bandwidth_gbps: float, batches, ctx_mean: float,
                    plain_tok_s: dict | None = None) -> dict:
    """The least time a plain decode step of B lanes can take at the copy bandwidth: the
    weights read once, and per lane its recurrent state (conv windows and the Gated DeltaNet
    state: hyspec.core.slots.slot_bytes' "linear") read and written and its keys and values
    read at the run's mean context (the MTP head's KV is not read by a plain step).  With
    the measured plain tok/s per B: the share of that floor each step reaches, and the
    ratio over the smallest batch that equal shares would give (floor_1 * B / floor_B): a
    batch ratio above it means the bigger step runs closer to its floor."""
    from hyspec.core.slots import slot_bytes

    lane = 2 * slot_bytes(cfg, dtype, 0, with_mtp=False)["linear"] + slot_bytes(cfg, dtype, round(ctx_mean),
                                                                                 with_mtp=False)["kv"]
    bw = bandwidth_gbps * 1e9
    b0 = min(batches)
    floor = {B: (weight_bytes + B * lane) / bw * 1e3 for B in batches}
    out = {"weight_bytes": int(weight_bytes), "lane_bytes": int(lane), "bandwidth_GBps": bandwidth_gbps,
           "ctx_mean": ctx_mean, "runs": {}}
    for B in batches:
        row = {"floor_ms": floor[B], "ratio_at_equal_share": floor[b0] * B / (b0 * floor[B])}
        if plain_tok_s and B in plain_tok_s:
            row["plain_ms"] = B / plain_tok_s[B] * 1e3
            row["share_of_floor"] = floor[B] / row["plain_ms"]
        out["runs"][B] = row
    return out


def log_floor(fl: dict, runs: dict, log=print) -> None:
    """One line per batch size of a bandwidth_floor result beside the runs' plain figures."""
    b0 = min(fl["runs"])
    for B, r in fl["runs"].items():
        log(f"B={B:>3}: plain step floor {r['floor_ms']:.3f} ms (weights {fl['weight_bytes'] / 1e9:.2f} GB + "
            f"{B} x {fl['lane_bytes'] / 1e6:.1f} MB of state and KV at {fl['bandwidth_GBps']:.0f} GB/s), measured "
            f"{r['plain_ms']:.3f} ms = {r['share_of_floor']:.1%} of it; equal shares would give "
            f"x{r['ratio_at_equal_share']:.2f} of batch {b0} (measured x{runs[B]['plain_tok_s'] / runs[b0]['plain_tok_s']:.2f})")


def _targets(out, k) -> dict:
    runs = out["runs"]
    t = {}
    if 1 in runs and 16 in runs:
        t["plain_B16_vs_B1"] = _target(runs[16]["plain_vs_B1"], "plain_B16_vs_B1")
    if 1 in runs and 64 in runs:
        t["plain_B64_vs_B1"] = _target(runs[64]["plain_vs_B1"], "plain_B64_vs_B1")
    if 16 in runs:
        t[f"spec_K{k}_vs_plain_B16"] = _target(runs[16]["spec_vs_plain"], "spec_vs_plain_B16")
    inv = out.get("invariance")
    if inv:
        ok = all(inv[x]["all_equal"] for x in ("plain", f"k{k}"))
        t["batch_invariance_greedy"] = {"value": ok, "target": True, "met": ok}
        ok = all(inv[x]["all_equal"] for x in ("sampled_plain", f"sampled_k{k}"))
        t["batch_invariance_seeded_sampling"] = {"value": ok, "target": True, "met": ok}
    smp = out.get("sampled", {})
    for B, row in smp.items():
        t[f"sampled_vs_greedy_spec_B{B}"] = _target(row["sampled_vs_greedy_spec"], "sampled_vs_greedy_spec")
    return t


def main(argv=None) -> int:
    import argparse
    import json
    import sys

    from hyspec.provenance import git_state

    ap = argparse.ArgumentParser(prog="python -m hyspec.gpu.batch_bench")
    ap.add_argument("--config", default="b2")
    ap.add_argument("--batch", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--inv-prompts", type=int, default=64)
    ap.add_argument("--inv-tokens", type=int, default=500)
    ap.add_argument("--inv-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampled-extra", default="", help=f"comma-separated: {', '.join(SAMPLED_VARIANTS)}")
    ap.add_argument("--draft-vocab", type=int, default=0, help="also forced speculation with a reduced draft vocabulary")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from types import SimpleNamespace

    from hyspec.bench import make_model

    model = make_model(SimpleNamespace(model=None, config=args.config, seed=args.seed), torch.device("cuda"),
                       torch.bfloat16)
    res = gpu_batch_bench(model, [int(b) for b in args.batch.split(",")], prompt_len=args.prompt_len,
                          new_tokens=args.new_tokens, seed=args.seed, inv_prompts=args.inv_prompts,
                          inv_tokens=args.inv_tokens, inv_batch=args.inv_batch,
                          sampled_extra=[v for v in args.sampled_extra.split(",") if v], draft_vocab=args.draft_vocab)
    res["git"] = git_state()
    res["device"] = torch.cuda.get_device_name()
    res["argv"] = argv
    res["command"] = "python3 -m hyspec.gpu.batch_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
