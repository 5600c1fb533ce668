"""What a bench run prints and writes: log lines, the GPU memory report, the GPU targets
judged on the exact variant, the final table, the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def log(*parts) -> None:
    print(*parts, flush=True)


def si(x: float) -> str:
    """3 significant figures with a k / M / G prefix (a 10 M model is not '0.000 B')."""
    for divisor, unit in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= divisor:
            return f"{x / divisor:.3g}{unit}"
    return f"{x:.3g} "


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str))


def memory_report(model, dev, lengths) -> dict:
    """Peak GPU memory so far, bytes of the weights, and how many sequence slots of each
    length fit in what is free (hyspec.core.slots.slot_bytes per slot)."""
    from hyspec.presets import slots_that_fit

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                        if n.endswith(("_scale_inv", "_scale_rows")))  # block-FP8 scales
    free, total = torch.cuda.mem_get_info(dev)
    return {"weights_bytes": weight_bytes, "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "allocated_bytes": torch.cuda.memory_allocated(dev), "free_bytes": free, "total_bytes": total,
            "slots": [slots_that_fit(model.cfg, model.dtype, length, free) for length in lengths]}


def format_memory(m: dict) -> str:
    gb = 1e9
    return (f"memory: weights {m['weights_bytes'] / gb:.2f} GB, "
            f"peak allocated {m['peak_allocated_bytes'] / gb:.2f} GB, "
            f"free {m['free_bytes'] / gb:.2f} of {m['total_bytes'] / gb:.2f} GB -> " + ", ".join(
                f"{s['slots']} slots of {s['length']} tokens" for s in m["slots"]))


def targets(result: dict) -> dict:
    """The GPU goals, judged on the exact variant: plain decode at >= 75% of the roofline,
    verify of 4 rows <= 1.10x one row, forced K=3 speed-up >= 1.9 and >= 90% of its
    ceiling, bitwise exactness."""
    exact = result.get("variants", {}).get("exact")
    if not exact:
        return {}
    out = {}
    out["plain_roofline_frac"] = {"value": exact["plain"]["roofline_frac"], "target": 0.75, "stretch": 0.85,
                                  "met": exact["plain"]["roofline_frac"] >= 0.75}
    verify4 = exact["verify_rel"].get(4)
    out["verify_t4_rel"] = {"value": verify4, "target": 1.10, "met": verify4 is not None and verify4 <= 1.10}
    forced3 = exact["spec"].get("forced", {}).get(3)
    if forced3:
        out["forced_k3_speedup"] = {"value": forced3["speedup"], "target": 1.9, "met": forced3["speedup"] >= 1.9}
        out["forced_k3_ceiling_frac"] = {"value": forced3["ceiling_frac"], "ceiling": forced3["ceiling"],
                                         "target": 0.9, "met": (forced3["ceiling_frac"] or 0) >= 0.9}
    dv = (result.get("draft_vocab") or {}).get("spec", {}).get("forced", {}).get(3)
    if dv:
        out["forced_k3_speedup_draft_vocab"] = {
            "value": dv["speedup"], "ceiling": dv["ceiling"], "draft_vocab": result["draft_vocab"]["size"],
            "draft_step_ms": result["draft_vocab"]["draft_step_ms"],
            "draft_step_ms_full_vocab": exact["draft_step_ms"], "target": 2.2, "met": dv["speedup"] >= 2.2}
    exactness = result.get("exactness")
    if exactness:
        out["exactness"] = {"value": exactness["all_equal"], "tokens": exactness["tokens"],
                            "prompts": len(exactness["prompts"]), "met": exactness["all_equal"]}
    return out


def print_table(result: dict) -> None:
    meta = result["meta"]
    log("\n" + "=" * 78)
    log(f"hyspec bench  {meta['device']}  {meta['config']}  {meta['dtype']}  prompt {meta['prompt_len']} "
        f"new {meta['new_tokens']}")
    log(f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s; step reads "
        f"{si(result['model']['weight_bytes_per_step'])}B; roofline {result['roofline_ms']:.3f} ms = "
        f"{result['roofline_tok_s']:.0f} tok/s")
    for name, v in result.get("variants", {}).items():
        log(f"-- {name}: plain {v['plain']['tok_s']:.1f} tok/s ({100 * v['plain']['roofline_frac']:.1f}% roofline); "
            f"step graph {v['decode_step_ms']:.3f} ms ({100 * v['decode_step_roofline_frac']:.1f}%); "
            f"draft step {v['draft_step_ms']:.3f} ms")
        log("   verify/t1: " + " ".join(f"t{t}={x:.2f}" for t, x in v["verify_rel"].items()))
        for drafter, by_k in v["spec"].items():
            log(f"   {drafter:6s}: " + "  ".join(
                f"K{K} {e['tok_s']:.0f} tok/s x{e['speedup']:.2f} (L {e['acceptance_length']:.2f}, ceil "
                f"x{e['ceiling'] or 0:.2f}){'' if e['tokens_equal_plain'] else ' !='}" for K, e in by_k.items()))
        if "moe" in v:  # routed experts counted on the device (hyspec.bench.variants.moe_figures)
            log("   MoE experts read/layer (counted): " + "  ".join(
                f"t{t}={r['experts_per_layer']:.1f} (unif. {r['expected_uniform']:.1f}) {si(r['bytes_per_step'])}B "
                f"roofline {r['roofline_ms']:.3f} ms" for t, r in v["moe"]["by_rows"].items()))
    if "draft_vocab" in result:
        v = result["draft_vocab"]
        f3 = v["spec"].get("forced", {}).get(3, {})
        log(f"-- draft vocabulary {v['size']} ({v['ids']}): plain {v['plain']['tok_s']:.1f} tok/s; draft step "
            f"{v['draft_step_ms']:.3f} ms; forced K3 x{f3.get('speedup', 0):.2f} (ceil x{f3.get('ceiling') or 0:.2f})"
            f"{'' if f3.get('tokens_equal_plain', True) else ' !='}")
    if "exactness" in result:
        e = result["exactness"]
        log(f"-- exactness: {len(e['prompts'])} prompts x {e['tokens']} tokens, K=3 forced + MTP == plain: "
            f"{e['all_equal']}")
    if "hf" in result:
        hf = result["hf"]
        log(f"-- transformers generate: {hf.get('decode_tok_s', 0):.1f} tok/s (fla: {hf.get('fla_importable')})")
    if "memory" in result:
        log("-- " + format_memory(result["memory"]))
    for name, target in result.get("targets", {}).items():
        log(f"   target {name}: {target['value']} (target {target.get('target')}) "
            f"{'MET' if target['met'] else 'missed'}")
    if result.get("errors"):
        log(f"errors: {list(result['errors'])}")
    log("=" * 78)
