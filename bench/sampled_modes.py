"""Sampled and penalised requests on the GPU lanes by sampling mode: greedy, greedy with a
repetition penalty (the README's first command), rejection (the default sampling mode) and
coupled, plain and speculative, side by side in one run, in two arms: "kernels", the
round's few uniform draws in one Triton launch each (``hyspec.kernels.rng.u01_at``) and the
penalty window's pushes in one launch each (``hyspec.kernels.window``), and "torch_ops",
both as the torch ops they ran as before (~250 launches per draw, ~30 per pushed token:
``HYSPEC_U01_KERNEL=0 HYSPEC_WINDOW_KERNEL=0``).  GPU only.

    python bench/sampled_modes.py --out bench/results/sampled_modes_h200.json

Part 1, the embedded default model (bf16, trained MTP head: real acceptance): one request
of `--new-tokens` after a `--prompt-tokens` held-out prompt through Engine.generate per
(mode, K, arm), the median decode tok/s of `--repeats` runs (the lane's own clock), rounds
and accepted drafts, whether both arms give the same tokens (they must: the draws are
bit-identical), and the CUDA-graph replay time of each of the round's graphs.

Part 2, `--config` (b2 by default: random weights, built on the device): a K=3 round and a
plain decode step of 1 and `--lanes` lanes as back-to-back CUDA-graph replays (draft + verify
+ commit) per mode and arm.  A sampled round over a greedy round's time is sampled ÷ greedy
speculative tok/s at the same acceptance (issue 14's row, target >= 0.9, printed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hyspec.gpu import penalties as dpen  # noqa: E402
from hyspec.gpu import sampling as dsamp  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.speculative.loop import SpecOptions  # noqa: E402
from logprobs import git_info, heldout_ids  # noqa: E402

SAMPLED = dict(temperature=0.8, top_p=0.95)
MODES = {"greedy": None, "greedy_rep1.2": dict(temperature=0.0, repetition_penalty=1.2),
         "rejection": dict(mode="rejection", **SAMPLED), "coupled": dict(mode="coupled", **SAMPLED)}
ARMS = {"kernels": True, "torch_ops": False}
TARGET = 0.9


def _params(mode: str, seed: int):
    kw = MODES[mode]
    return None if kw is None else SamplingParams(seed=seed, **kw)


def _arm(on: bool) -> None:
    """Both switches (read when a graph is captured: the caller drops the graphs)."""
    dsamp.U01_KERNEL = dpen.WINDOW_KERNEL = on


def _graph_times(dec) -> dict:
    from hyspec.gpu.graphs import replay_ms

    return {repr(key): replay_ms(g, reps=20) for key, g in dec.step_graphs.graphs.items()}


def engine_part(args, log) -> dict:
    from hyspec import Engine

    eng = Engine.load(device="cuda", dtype="bfloat16")
    prompt = heldout_ids(eng, args.prompt_tokens)
    out = {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "cases": []}
    tokens = {}
    for arm, on in ARMS.items():
        _arm(on)
        for mode in MODES:
            for k in (0, 3):
                eng._batch_dec = None  # a fresh decoder: its graphs are captured with this arm's draws

                def gen(n):
                    return eng.generate(prompt, max_new_tokens=n, draft=k, spec=SpecOptions(k=max(k, 1)),
                                        params=_params(mode, 5), ignore_eos=True, use_store=False)

                gen(16)  # graphs captured, kernels compiled
                rates, o = [], None
                for _ in range(args.repeats):
                    o = gen(args.new_tokens)
                    rates.append(o.samples[0].stats.get("decode_tok_s") or 0.0)
                s = o.samples[0]
                tel = s.stats.get("spec") or {}
                if not eng._batch_dec.step_graphs.active:  # a failed capture would time eager launches
                    raise SystemExit(f"{arm} {mode} K={k}: a CUDA-graph capture failed")
                graphs = {key: ms for key, ms in _graph_times(eng._batch_dec).items()}
                tokens[(arm, mode, k)] = s.tokens
                row = {"arm": arm, "mode": mode, "k": k, "path": s.stats.get("path"),
                       "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates,
                       "rounds": tel.get("rounds"), "accepted": tel.get("accepted"), "graph_replay_ms": graphs}
                out["cases"].append(row)
                log(f"default model  {arm:10s} {mode:13s} K={k}: {row['decode_tok_s']:8.1f} tok/s [{row['path']}]"
                    + (f"  rounds {row['rounds']} accepted {row['accepted']}" if k else ""))
                for key, ms in graphs.items():
                    log(f"      {ms * 1e3:8.1f} us  {key}")
    _arm(True)
    for c in out["cases"]:
        c["same_tokens_both_arms"] = tokens[("kernels", c["mode"], c["k"])] == tokens[("torch_ops", c["mode"], c["k"])]
    for mode in MODES:
        for k in (0, 3):
            a = next(c for c in out["cases"] if c["arm"] == "kernels" and c["mode"] == mode and c["k"] == k)
            b = next(c for c in out["cases"] if c["arm"] == "torch_ops" and c["mode"] == mode and c["k"] == k)
            log(f"default model  {mode:13s} K={k}: x{a['decode_tok_s'] / b['decode_tok_s']:.2f} with the kernels "
                f"({b['decode_tok_s']:.1f} -> {a['decode_tok_s']:.1f} tok/s); same tokens: {a['same_tokens_both_arms']}")
    return out


def rounds_part(args, log) -> dict:
    from hyspec.bench.timing import time_fn
    from hyspec.gpu.batch_bench import preset_model, random_lanes

    model = preset_model(args.config)
    S = args.lanes
    dec = random_lanes(model, S, 128, 128 + 16384, 3)
    dev = torch.device("cuda")
    out = {"config": args.config, "lanes": [1, S], "replays": args.replays, "cases": []}
    times = {}
    for mode in MODES:  # the two arms of a mode back to back (the lanes' contexts grow as rounds run)
        for arm, on in ARMS.items():
            _arm(on)
            dec.step_graphs.graphs.clear()  # captured again with this arm's draws
            regime = None
            if MODES[mode] is not None:
                for lane in range(S):
                    dec.set_params(lane, _params(mode, lane))
                    if dec.window is not None:  # a penalised lane's window over a stand-in history
                        dec.window.load(lane, list(range(lane, lane + 128)), _params(mode, lane))
                regime = dsamp.SampledGraphKey.of([_params(mode, 0)])
            else:
                for lane in range(S):
                    dec.set_params(lane, None)
            for nb in (1, S):
                for step in ("decode", "round_k3"):
                    fn = (lambda: dec.decode(nb, sampled=regime)) if step == "decode" else \
                        (lambda: dec.round(nb, 3, sampled=regime))
                    ms = time_fn(fn, dev, args.replays, warmup=2)
                    if not dec.step_graphs.active:  # a failed capture would time eager launches
                        raise SystemExit(f"{arm} {mode} {nb} {step}: a CUDA-graph capture failed")
                    times[(arm, mode, nb, step)] = ms
                    out["cases"].append({"arm": arm, "mode": mode, "lanes": nb, "step": step, "ms": ms})
                    log(f"{args.config}  {arm:10s} {mode:13s} {nb:3d} lanes {step:8s}: {ms:7.3f} ms")
    _arm(True)
    out["ratios"] = {}
    for arm in ARMS:
        for nb in (1, S):
            for mode in ("greedy_rep1.2", "rejection", "coupled"):
                for step in ("decode", "round_k3"):
                    r = times[(arm, "greedy", nb, step)] / times[(arm, mode, nb, step)]
                    key = f"{arm}:{mode}:{step}:B{nb}"
                    out["ratios"][key] = r
                    tgt = (f"  (target >= {TARGET}: {'met' if r >= TARGET else 'missed'})"
                           if step == "round_k3" and mode != "greedy_rep1.2" else "")
                    log(f"{args.config}  {arm:10s} {mode:13s} {nb:3d} lanes {step:8s}: over greedy, speed "
                        f"x{r:.3f}{tgt}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="b2", help="part 2's preset ('' skips part 2)")
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default="bench/results/sampled_modes_h200.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/sampled_modes.py needs a GPU", file=sys.stderr)
        return 2
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    res = {**git_info(), "bench": "sampled_modes", "command": "python bench/sampled_modes.py " + " ".join(sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "sampled": SAMPLED}
    res["default_model"] = engine_part(args, log)
    if args.config:
        res["rounds"] = rounds_part(args, log)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out).with_name(Path(args.out).stem + "_log.txt").write_text(
        f"# commit {res['git_commit']} dirty={res['dirty']} ({res['command']})\n" + "\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
