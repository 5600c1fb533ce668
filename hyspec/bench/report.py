"""What a bench run prints and writes: log lines, the GPU memory report, the GPU targets
judged on the exact variant, the final table, the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hyspec.files import write_whole


def log(*parts) -> None:
    print(*parts, flush=True)


def si(x: float) -> str:
    """3 significant figures with a k / M / G prefix (a 10 M model is not '0.000 B')."""
    for divisor, unit in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= divisor:
            return f"{x / divisor:.3g}{unit}"
    return f"{x:.3g} "


def write_json(path: str | None, result: dict) -> None:
    """Write the results to `path` (after each part of a run): written beside it and moved over
    it, so a failed write (a full disk) or a Ctrl-C during it leaves the last part's file whole,
    not a truncated JSON (a symbolic link stays a link: the file it points to is replaced; a
    device or a pipe, /dev/stdout, is written to as it is)."""
    if path:
        p = Path(path)
        # a device or a pipe is written as it is; so is a link in /dev or /proc, /dev/stdout: an open
        # file's, resolved "/proc/PID/fd/pipe:[N]" (no file: a pipe's results were "No such file or
        # directory") or, a file's, one replaced there that the link no longer leads to
        direct = p.exists() and (not p.is_file() or p.is_symlink() and str(p.absolute()).startswith(("/dev/", "/proc/")))
        text = json.dumps(result, indent=1, default=str)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if direct:
                p.write_text(text)
            else:  # (hyspec.files.write_whole: its mode stays, a link's target is replaced)
                write_whole(p, lambda f: f.write(text.encode()))
        except OSError as e:  # (a full disk named no file: "[Errno 28] No space left on device")
            raise OSError(f"--out {path}: cannot write the results ({e.strerror or e})") from None


def memory_report(model, dev, lengths) -> dict:
    """Peak GPU memory so far, bytes of the weights, and how many sequence slots of each
    length fit in what is free (hyspec.core.slots.slot_bytes per slot)."""
    from hyspec.presets import slots_that_fit
    from hyspec.quant import weight_bytes

    free, total = torch.cuda.mem_get_info(dev)
    return {"weights_bytes": weight_bytes(model), "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "allocated_bytes": torch.cuda.memory_allocated(dev), "free_bytes": free, "total_bytes": total,
            "slots": [slots_that_fit(model.cfg, model.dtype, length, free, bool(model.has_mtp)) for length in lengths]}


def format_memory(m: dict) -> str:
    gb = 1e9
    return (f"memory: weights {m['weights_bytes'] / gb:.2f} GB, "
            f"peak allocated {m['peak_allocated_bytes'] / gb:.2f} GB, "
            f"free {m['free_bytes'] / gb:.2f} of {m['total_bytes'] / gb:.2f} GB -> " + ", ".join(
                f"{s['slots']} slots of {s['length']} tokens" for s in m["slots"]))


# The goals each preset is judged by (issues 14 and 15): plain decode as a fraction of the
# roofline (for MoE presets the active-bytes roofline: shared weights + the routed experts a
# step reads), the verify of 4 rows against one row (dense b2 only: an MoE verify reads more
# experts, judged by its own bytes roofline instead), the forced K=3 speed-up and its share
# of the run's cost-model ceiling, and bitwise exactness over prompts x tokens.
# b2: issue 14's table (verify t=4 <= 1.08 of a decode step, forced K=3 >= x1.97 over plain;
# until session 23 the bench judged 1.10 and x1.9, the goals of the first wave)
_B2_TARGETS = dict(plain_roofline_frac=0.75, stretch=0.85, verify_t4_rel=1.08, forced_k3_speedup=1.97,
                   forced_k3_ceiling_frac=0.9, exact_prompts=4, exact_tokens=2000)
PRESET_TARGETS = {
    "b2": _B2_TARGETS,
    "qwen3-next-2b-dense": _B2_TARGETS,  # b2's descriptive name
    "qwen3.5-27b": dict(plain_roofline_frac=0.75, forced_k3_speedup=2.3, exact_prompts=2, exact_tokens=1000),
    "qwen3.5-35b-a3b": dict(plain_roofline_frac=0.60, moe_verify_roofline_frac=0.60, forced_k3_ceiling_frac=0.9,
                            exact_prompts=2, exact_tokens=1000),
    "qwen3-next-80b-a3b-fp8": dict(plain_roofline_frac=0.60, moe_verify_roofline_frac=0.60,
                                   forced_k3_ceiling_frac=0.9, exact_prompts=2, exact_tokens=1000),
}


def preset_targets(config: str | None) -> dict:
    """The target set of a bench config (a preset name or alias); other configs (tiny,
    default model, a checkpoint) are judged like b2."""
    from hyspec.presets import canonical_name

    name = canonical_name(config.split(" (")[0]) if config else "b2"  # "b2 (fp8)": b2's goals
    return PRESET_TARGETS.get(name, PRESET_TARGETS["b2"])  # b2 = qwen3-next-2b-dense: the fallback


def _at(d: dict, k: int):
    """d[k] for an int key, also when d came back from JSON (string keys)."""
    return d.get(k, d.get(str(k)))


def targets(result: dict) -> dict:
    """The GPU goals of the run's preset (PRESET_TARGETS), judged on the exact variant (a
    live result or one read back from its JSON file)."""
    exact = result.get("variants", {}).get("exact")
    if not exact:
        return {}
    goal = preset_targets(result.get("meta", {}).get("config"))
    out = {}
    frac = exact["plain"]["roofline_frac"]
    out["plain_roofline_frac"] = {"value": frac, "target": goal["plain_roofline_frac"],
                                  "met": frac >= goal["plain_roofline_frac"]}
    if "stretch" in goal:
        out["plain_roofline_frac"]["stretch"] = goal["stretch"]
    if "verify_t4_rel" in goal:
        verify4 = _at(exact["verify_rel"], 4)
        out["verify_t4_rel"] = {"value": verify4, "target": goal["verify_t4_rel"],
                                "met": verify4 is not None and verify4 <= goal["verify_t4_rel"]}
    if "moe_verify_roofline_frac" in goal and "moe" in exact:
        g = goal["moe_verify_roofline_frac"]
        for t, r in exact["moe"]["by_rows"].items():
            if int(t) > 1 and r.get("roofline_frac") is not None:
                out[f"moe_verify_t{t}_roofline_frac"] = {"value": r["roofline_frac"], "target": g,
                                                         "met": r["roofline_frac"] >= g}
    forced3 = _at(exact["spec"].get("forced", {}), 3)
    if forced3:
        if "forced_k3_speedup" in goal:
            out["forced_k3_speedup"] = {"value": forced3["speedup"], "target": goal["forced_k3_speedup"],
                                        "met": forced3["speedup"] >= goal["forced_k3_speedup"]}
        g = goal.get("forced_k3_ceiling_frac")
        out["forced_k3_ceiling_frac"] = {"value": forced3["ceiling_frac"], "ceiling": forced3["ceiling"],
                                         "target": g, "met": g is None or (forced3["ceiling_frac"] or 0) >= g}
    dv = _at((result.get("draft_vocab") or {}).get("spec", {}).get("forced", {}), 3)
    if dv:
        out["forced_k3_speedup_draft_vocab"] = {
            "value": dv["speedup"], "ceiling": dv["ceiling"], "draft_vocab": result["draft_vocab"]["size"],
            "draft_step_ms": result["draft_vocab"]["draft_step_ms"],
            "draft_step_ms_full_vocab": exact["draft_step_ms"], "target": 2.2, "met": dv["speedup"] >= 2.2}
    exactness = result.get("exactness")
    if exactness:
        n, tokens = len(exactness["prompts"]), exactness["tokens"]
        enough = n >= goal["exact_prompts"] and tokens >= goal["exact_tokens"]
        out["exactness"] = {"value": exactness["all_equal"], "tokens": tokens, "prompts": n,
                            "target": f"{goal['exact_prompts']} x {goal['exact_tokens']} tokens bitwise",
                            "met": bool(exactness["all_equal"]) and enough}
        if "coupled_all_equal" in exactness:
            c = exactness["coupled"]
            out["exactness_coupled"] = {
                "value": exactness["coupled_all_equal"], "tokens": tokens, "prompts": n,
                "sampling": f"coupled, T={c['temperature']}, top-p {c['top_p']}, a seed per prompt",
                "target": f"{goal['exact_prompts']} x {goal['exact_tokens']} tokens bitwise",
                "met": bool(exactness["coupled_all_equal"]) and enough}
    return out


def ceil_text(ceiling) -> str:
    """A cost-model ceiling for the table: 'n/a' when the run did not time the K+1-row verify."""
    return f"x{ceiling:.2f}" if ceiling else "n/a"


def print_table(result: dict) -> None:
    meta = result["meta"]
    log("\n" + "=" * 78)
    state = meta.get("ssm_dtype")
    state = f" (state {state})" if state and state not in ("float32", "float64") else ""
    log(f"hyspec bench  {meta['device']}  {meta['config']}  {meta['dtype']}{state}  prompt {meta['prompt_len']} "
        f"new {meta['new_tokens']}")
    log(f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s; step reads "
        f"{si(result['model']['weight_bytes_per_step'])}B; roofline {result['roofline_ms']:.3f} ms = "
        f"{result['roofline_tok_s']:.0f} tok/s")
    for name, v in result.get("variants", {}).items():
        log(f"-- {name}: plain {v['plain']['tok_s']:.1f} tok/s ({100 * v['plain']['roofline_frac']:.1f}% roofline); "
            f"step {v['decode_step_ms']:.3f} ms ({100 * v['decode_step_roofline_frac']:.1f}%); "
            f"draft step {v['draft_step_ms']:.3f} ms")
        log("   verify/t1: " + " ".join(f"t{t}={x:.2f}" for t, x in v["verify_rel"].items()))
        for drafter, by_k in v["spec"].items():
            log(f"   {drafter:6s}: " + "  ".join(
                f"K{K} {e['tok_s']:.0f} tok/s x{e['speedup']:.2f} (L {e['acceptance_length']:.2f}, ceil "
                f"{ceil_text(e.get('ceiling'))}){'' if e['tokens_equal_plain'] else ' !='}" for K, e in by_k.items()))
        if "moe" in v:  # routed experts counted on the device (hyspec.bench.variants.moe_figures)
            log("   MoE experts read/layer (counted): " + "  ".join(
                f"t{t}={r['experts_per_layer']:.1f} (unif. {r['expected_uniform']:.1f}) {si(r['bytes_per_step'])}B "
                f"roofline {r['roofline_ms']:.3f} ms" for t, r in v["moe"]["by_rows"].items()))
    if "draft_vocab" in result:
        v = result["draft_vocab"]
        f3 = v["spec"].get("forced", {}).get(3, {})
        log(f"-- draft vocabulary {v['size']} ({v['ids']}): plain {v['plain']['tok_s']:.1f} tok/s; draft step "
            f"{v['draft_step_ms']:.3f} ms; forced K3 x{f3.get('speedup', 0):.2f} (ceil {ceil_text(f3.get('ceiling'))})"
            f"{'' if f3.get('tokens_equal_plain', True) else ' !='}")
    if "exactness" in result:
        e = result["exactness"]
        log(f"-- exactness: {len(e['prompts'])} prompts x {e['tokens']} tokens, K=3 forced + MTP == plain: "
            f"{e['all_equal']}" + (f"; coupled sampling (T={e['coupled']['temperature']}, top-p "
                                  f"{e['coupled']['top_p']}): {e['coupled_all_equal']}" if "coupled" in e else ""))
    if "hf" in result:
        hf = result["hf"]
        if "skipped" in hf:
            log(f"-- transformers generate: skipped ({hf['skipped']})")
        else:
            log(f"-- transformers generate: {hf.get('decode_tok_s', 0):.1f} tok/s (fla: {hf.get('fla_importable')})"
                + (f"; hyspec plain x{hf['hyspec_plain_vs_hf']:.1f} of it" if "hyspec_plain_vs_hf" in hf else ""))
    if "memory" in result:
        log("-- " + format_memory(result["memory"]))
    for name, target in result.get("targets", {}).items():
        log(f"   target {name}: {target['value']} (target {target.get('target')}) "
            f"{'MET' if target['met'] else 'missed'}")
    if result.get("errors"):
        log(f"errors: {list(result['errors'])}")
    log("=" * 78)
