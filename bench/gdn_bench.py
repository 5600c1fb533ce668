"""The Gated-DeltaNet step kernel at b2's shapes, launched several ways (block of Dv per
program, warps, grid order, next-row prefetch): time per layer of a decode step, a 4-row
verify and the commit replay (n accepted drafts, all layers in one launch), the state
bytes they move and the bandwidth, the registers of its decode kernel; for each way,
whether its states and outputs are bitwise those of the first way of the same tile,
warps and row form (several Dv blocks per decode program must not change a bit), how far
the two row forms' results are apart, and whether a replay of n + 1 rows leaves the
state bitwise equal to n + 1 decode steps (the exactness the speculative loop needs).
GPU only.

    python bench/gdn_bench.py --lanes 1,16,64 --out gdn_bench.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from hyspec.bench.report import write_json
from hyspec.presets import QWEN3_NEXT_2B_DENSE as _B2  # b2: its Gated DeltaNet shapes

# (block_v, num_warps, pv_first, prefetch, one_reduction, decode_blocks).  The first is the
# runner's way until session 12 (the reference's row order: two dependent state reductions and
# two norms per row), the second the same launch with one state reduction per row
# (hyspec.kernels.gdn.kernel, ONE_RED), then Dv blocks per decode program (the next
# block's state loading while this one is updated) and other tiles.  A run at 26a63eb
# tried twelve ways, among them 64- and 128-wide blocks on 4 to 16 warps, all slower, and
# one at e468594 the next ten, one at b33b848 twelve of the current ones before the
# state's offsets went int32 (git history of bench/results/gdn_bench_h200.json; b33b848's:
# git show a44f100:bench/results/gdn_bench_h200.json).
WAYS = [(16, 2, True, True, False, 1), (16, 2, True, True, True, 1), (16, 2, True, True, True, 2),
        (16, 4, True, True, True, 1), (16, 4, True, True, True, 2), (8, 1, True, True, True, 1),
        (8, 2, True, True, True, 1), (32, 4, True, True, True, 1), (32, 4, True, True, True, 2),
        # wider Dv blocks, for the bf16 state (--state-dtype bfloat16: half the bytes per tile)
        (32, 8, True, True, True, 1), (64, 4, True, True, True, 1), (64, 8, True, True, True, 1),
        # fewer registers per thread (92 on 4 warps, offline ptxas for sm_90)
        (8, 4, True, True, True, 1)]
# A transposed state layout (each head [Dv, Dk], the Dk reductions along the fast axis) was
# measured with four ways at 0e1da99 and was slower in all of them (git show
# 0e1da99:hyspec/kernels/gdn/kernel.py, its TRANS; bench/results/gdn_ways_*_h200.json).


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lanes", default="1,16,64")
    n_gdn = _B2["num_hidden_layers"] - _B2["num_hidden_layers"] // _B2["full_attention_interval"]
    ap.add_argument("--layers", type=int, default=n_gdn, help=f"Gated-DeltaNet layers (b2's: {n_gdn})")
    ap.add_argument("--verify-rows", type=int, default=4)
    ap.add_argument("--accepted", type=int, default=2, help="n of the replay (n + 1 rows)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run in the Triton interpreter (no timing)")
    ap.add_argument("--ways", type=int, default=len(WAYS), help="the first N ways only")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the state's storage dtype (hyspec --ssm-dtype): computed in fp32, stored in this")
    ap.add_argument("--skip", default="", help="comma-separated indices of WAYS not to run")
    ap.add_argument("--const-dv", default="1",
                    help="comma-separated 0/1: each way with the state's row stride Dv a runtime value (0: int32 "
                         "offsets) and/or a compile-time one (1, the runner's default: int64 offsets, immediates)")
    ap.add_argument("--launch", default="",
                    help="semicolon-separated NAME:KEY=V,KEY=V sets of integer STEP_LAUNCH keys (const_dv, stream, "
                         "...); each way runs once per set too (after --const-dv's runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/gdn_bench.py", args.device)
    from hyspec.kernels.gdn import kernel as gk
    from hyspec.kernels.gdn import gdn_replay, gdn_step
    from hyspec.provenance import git_state

    dev = torch.device(args.device)
    nk, nv = _B2["linear_num_key_heads"], _B2["linear_num_value_heads"]
    dk, dv, G = _B2["linear_key_head_dim"], _B2["linear_value_head_dim"], args.layers
    C = 2 * nk * dk + nv * dv
    P = C + nv * dv + 2 * nv
    T, n = args.verify_rows, args.accepted
    lanes_list = [int(x) for x in args.lanes.split(",")]
    B_max = max(lanes_list)
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    y = torch.randn(G, B_max, T, C, device=dev, generator=g).to(bf)
    proj = torch.randn(G, B_max, T, P, device=dev, generator=g).to(bf)
    A_log = torch.rand(G, nv, device=dev, generator=g)
    dtb = torch.rand(G, nv, device=dev, generator=g)
    nw = torch.rand(dv, device=dev, generator=g).to(bf)
    sdt = getattr(torch, args.state_dtype)
    ssm0 = (torch.randn(G, B_max, nv, dk, dv, device=dev, generator=g) * 0.1).to(sdt)
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
    state_bytes = nv * dk * dv * ssm0.element_size()  # one lane, one layer
    out = {"git": git_state(), "command": "python bench/gdn_bench.py " + " ".join(sys.argv[1:]),
           "shape": {"nk": nk, "nv": nv, "dk": dk, "dv": dv, "layers": G, "verify_rows": T, "accepted": n},
           "state_dtype": args.state_dtype,
           "ways": []}

    def timed(fn) -> float:
        fn()
        if dev.type != "cuda":
            return float("nan")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.reps):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / args.reps * 1e3  # us

    base, form_base = {}, {}
    skip = {int(i) for i in args.skip.split(",") if i}
    cdvs = [bool(int(c)) for c in args.const_dv.split(",")]
    sets = [("cdv" if c else "", {"const_dv": c}) for c in cdvs]
    for part in filter(None, args.launch.split(";")):
        nm, _, kvs = part.partition(":")
        sets.append((nm, {k: int(v) for k, v in (kv.split("=") for kv in kvs.split(","))}))
    runs = [(i, way, ls) for i, way in enumerate(WAYS[: args.ways]) if i not in skip for ls in sets]
    for i, way, (lname, lset) in runs:
        bv, warps, pvf, pf, one_red, nbp = way
        gk.STEP_LAUNCH.update(gk._env_launch())
        gk.STEP_LAUNCH.update(num_warps=warps, pv_first=pvf, prefetch=pf, one_reduction=one_red,
                              decode_blocks=nbp, decode_blocks_min_lanes=1, **lset)
        cdv = bool(gk.STEP_LAUNCH["const_dv"])
        name = (f"bv{bv}_w{warps}{'_pvf' if pvf else ''}{'_pf' if pf else ''}{'_1red' if one_red else '_ref'}"
                f"{f'_dec{nbp}' if nbp > 1 else ''}{'_' + lname if lname else ''}")
        row = {"name": name, "block_v": bv, "num_warps": warps, "pv_first": pvf, "prefetch": pf,
               "one_reduction": one_red, "decode_blocks": nbp, "launch": dict(lset), "lanes": {}}
        try:
            for B in lanes_list:
                ssm = ssm0[:, :B].clone()
                o1 = torch.empty(B, nv * dv, device=dev, dtype=bf)
                oT = torch.empty(B * T, nv * dv, device=dev, dtype=bf)
                y1 = y[:, :B, 0].contiguous()  # [G, B, C]: one row per lane
                p1 = proj[:, :B, 0].contiguous()
                yT = y[:, :B].reshape(G, B * T, C)
                pT = proj[:, :B].reshape(G, B * T, P)
                ncount = torch.full((B,), n, device=dev, dtype=torch.long)

                def decode():
                    for gi in range(G):
                        gdn_step(y1[gi], p1[gi], A_log[gi], dtb[gi], nw, ssm[gi], o1, rows=B, block_v=bv, lanes=B,
                                 state_lane_stride=ssm.stride(1), **kw)

                def verify():
                    for gi in range(G):
                        gdn_step(yT[gi], pT[gi], A_log[gi], dtb[gi], nw, ssm[gi], oT, rows=B * T, block_v=bv,
                                 keep_state=True, lanes=B, state_lane_stride=ssm.stride(1), **kw)

                def replay():
                    gdn_replay(y[:, :B], proj[:, :B], A_log, dtb, nw, ssm, ncount, o1, block_v=bv, lanes=B, **kw)

                t_dec = timed(decode)
                ck = gk.LAST.get("gdn_step")
                regs = {"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None)}
                t_ver, t_rep = timed(verify), timed(replay)
                # bits: one decode step / a verify's outputs / a replay from ssm0, against the default way
                ssm.copy_(ssm0[:, :B])
                decode()
                bits = {"decode_state": ssm.clone(), "decode_out": o1.clone()}
                ssm.copy_(ssm0[:, :B])
                verify()
                bits["verify_out"] = oT.clone()
                ssm.copy_(ssm0[:, :B])
                replay()
                bits["replay_state"] = ssm.clone()
                # exactness: n + 1 decode steps (rows 0..n of each lane) == the replay
                seq = ssm0[:, :B].clone()
                for r in range(n + 1):
                    yr, pr = y[:, :B, r].contiguous(), proj[:, :B, r].contiguous()
                    for gi in range(G):
                        gdn_step(yr[gi], pr[gi], A_log[gi], dtb[gi], nw, seq[gi], o1, rows=B, block_v=bv, lanes=B,
                                 state_lane_stride=seq.stride(1), **kw)
                replay_exact = bool(torch.equal(seq, bits["replay_state"]))
                # a verify's first row is the decode step's row: its outputs must be the same bits
                verify_row0 = bool(torch.equal(bits["verify_out"].view(B, T, -1)[:, 0], bits["decode_out"]))
                # bits: against the first way of the same tile, warps and form (a way with
                # several decode blocks per program must equal its one-block way), and the
                # first way of the other form (rounding only)
                key = (B, bv, warps, one_red, cdv)
                base.setdefault(key, bits)
                rt = base.get((B, bv, warps, one_red, False)) if cdv else None  # the runtime-Dv build's bits
                as_runtime = None if rt is None else all(torch.equal(v, rt[k]) for k, v in bits.items())
                form_base.setdefault((B, one_red), bits)
                same = {k: bool(torch.equal(v, base[key][k])) for k, v in bits.items()}
                maxdiff = max(float((v.float() - base[key][k].float()).abs().max()) for k, v in bits.items())
                other = form_base.get((B, not one_red))
                form_diff = (max(float((v.float() - other[k].float()).abs().max()) for k, v in bits.items())
                             if other else None)
                gb = state_bytes * B / 1e9
                row["lanes"][B] = {
                    "decode_us_per_layer": t_dec / G, "verify_us_per_layer": t_ver / G, "replay_us_all_layers": t_rep,
                    "decode_TBs": 2 * gb * G / (t_dec * 1e-6) / 1e3, "verify_TBs": gb * G / (t_ver * 1e-6) / 1e3,
                    "replay_TBs": 2 * gb * G / (t_rep * 1e-6) / 1e3, "replay_equals_decode_steps": replay_exact,
                    "verify_row0_equals_decode": verify_row0,
                    "bitwise_as_default": same, "max_abs_diff_vs_default": maxdiff,
                    "bitwise_as_runtime_dv": as_runtime,
                    "max_abs_diff_vs_other_form": form_diff, "last_kernel": regs}
                r = row["lanes"][B]
                print(f"{name:22s} B={B:3d}: decode {r['decode_us_per_layer']:7.1f} us/layer ({r['decode_TBs']:.2f} TB/s)"
                      f"  verify t={T} {r['verify_us_per_layer']:7.1f} us/layer ({r['verify_TBs']:.2f} TB/s)"
                      f"  replay n={n} {t_rep:7.1f} us ({r['replay_TBs']:.2f} TB/s)  replay==steps {replay_exact} verify row 0==decode {verify_row0}"
                      f"  same bits as its one-block way: {all(same.values())} (max diff {maxdiff:.2g};"
                      f" vs the other form {form_diff if form_diff is None else f'{form_diff:.2g}'})"
                      f"{'' if as_runtime is None else f'  bits as runtime Dv: {as_runtime}'}"
                      f"  regs {regs['n_regs']} spills {regs['n_spills']}", flush=True)
        except Exception as e:  # noqa: BLE001 - a way that does not compile or run: recorded
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: {row['error']}", flush=True)
        out["ways"].append(row)
    gk.STEP_LAUNCH.update(gk._env_launch())
    if args.out:
        write_json(args.out, out)  # (whole or not at all)


if __name__ == "__main__":
    main()
