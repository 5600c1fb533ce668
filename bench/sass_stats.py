"""The Gated-DeltaNet step kernel compiled for sm_90 without a GPU: registers, SASS by opcode.

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``) and its wheel
ships ``ptxas`` and ``nvdisasm``, so the machine code of the H200's kernel can be read
here.  The step kernel is built the way the runner launches it at b2's shapes (its
constexprs from ``hyspec.kernels.gdn.kernel._step_meta``, its integer arguments
specialised as Triton specialises them: 1 becomes a constant, multiples of 16 get a
divisibility hint, the ``do_not_specialize`` ones stay plain), then this prints the
registers and spills (``ptxas -v``), the static SASS instructions by opcode, the TTGIR
layouts and, with ``--compare``, a second build's figures and the difference of the
two builds' float-instruction multisets (operand registers renamed away).

A matching multiset does not prove equal bits: it hides which values each instruction
pairs (two builds can contract different products into an FMA; docs/gpu.md "What is
left", item 9).  The counts say how much work a program issues, which is what bounds the
step (Nsight Compute: ``bench/results/gdn_ncu_b16.txt``).

    python bench/sass_stats.py                         # the runner's decode-step build
    python bench/sass_stats.py --set PF=0 --compare ONE_RED=0 --no-fp-fusion
    python bench/sass_stats.py --sass-out /tmp/step.sass

(The H200 runs Triton 3.6; another Triton version here compiles other code: the line
``triton`` says which one was used.  ``pip install --target DIR triton==3.6.0`` and
``PYTHONPATH=DIR`` give the H200's.)
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

from hyspec.bench.report import write_json
from hyspec.presets import QWEN3_NEXT_2B_DENSE as _B2  # b2: its Gated DeltaNet shapes

NK, NV = _B2["linear_num_key_heads"], _B2["linear_num_value_heads"]
DK, DV = _B2["linear_key_head_dim"], _B2["linear_value_head_dim"]
C = 2 * NK * DK + NV * DV


def _int_args(lanes: int) -> dict:
    """The step kernel's integer arguments for a decode step of `lanes` lanes at b2's shapes."""
    P = C + NV * DV + 2 * NV
    return dict(sy=C, sp=P, st_t=0, so=NV * DV, T=1, R=NV // NK, KD=NK * DK, C=C, VD=NV * DV, NV=NV, DK=DK,
                DV=DV, mode=1, replay=0, sy_g=0, sp_g=0, ss_g=0, sa_g=0, NB=lanes, sy_b=C, sp_b=P,
                ss_b=NV * DK * DV, so_b=NV * DV)


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return int(text)


def build(settings: dict, *, lanes: int, state_dtype: str, fp_fusion: bool, block_v: int, maxnreg: int | None = None):
    """Compile the step kernel for sm_90 -> (compiled kernel, ptxas -v text, SASS text)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile

    from hyspec.kernels.gdn import kernel as gk

    fn = gk._kernels()["gdn_step"]
    BK, BV, norm = gk._gdn_blocks(DK, DV, block_v)
    meta = gk._step_meta(BK, BV, norm, 1, DK, DV)
    warps = meta.pop("num_warps")
    meta = {k: v for k, v in meta.items() if k in fn.arg_names}
    for k, v in settings.items():
        if k == "num_warps":
            warps = v
        elif k not in fn.arg_names:
            raise SystemExit(f"--set/--compare: the step kernel has no parameter {k!r}")
        else:
            meta[k] = v
    sdt = {"float32": "fp32", "bfloat16": "bf16"}[state_dtype]
    ptrs = dict(y_ptr="*bf16", p_ptr="*bf16", alog_ptr="*fp32", dtb_ptr="*fp32", nw_ptr="*bf16", s_ptr="*" + sdt,
                st_ptr="*" + sdt, o_ptr="*bf16", n_ptr="*i64")
    ints = _int_args(lanes)
    unspecialised = {fn.arg_names[i] if isinstance(i, int) else i for i in (fn.do_not_specialize or ())}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in meta:
            sig[name], consts[(i,)] = "constexpr", meta[name]
        elif fn.params[i].is_constexpr:  # left at its default by the launch
            sig[name], consts[(i,)] = "constexpr", fn.params[i].default
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "eps"):
            sig[name] = "fp32"
        else:
            v = ints[name]
            if name not in unspecialised and v == 1:
                sig[name], consts[(i,)] = "constexpr", 1
            else:
                sig[name] = "i32"
                if name not in unspecialised and v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs=attrs)
    opts = {"num_warps": warps, "enable_fp_fusion": fp_fusion}
    if maxnreg:
        opts["maxnreg"] = maxnreg  # a .maxnreg directive in the PTX: ptxas spills above it
    k = tcompile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    from triton.backends.nvidia import compiler as nvc

    ptxas = nvc.get_ptxas(90).path  # the ptxas Triton itself runs for sm_90 (its wheel ships two)
    bindir = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin")
    nvdisasm = glob.glob(os.path.join(bindir, "nvdisasm"))[0]
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        fmad = [] if fp_fusion else ["--fmad=false"]
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", *fmad, ptx, "-o", os.devnull], capture_output=True,
                              text=True).stderr
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    return k, info, sass, dict(meta, num_warps=warps)


_INSN = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?)\s*;")


def stats(k, info: str, sass: str) -> dict:
    ops, floats = collections.Counter(), collections.Counter()
    for line in sass.splitlines():
        m = _INSN.match(line)
        if not m:
            continue
        op = m.group(2)
        ops[op.split(".")[0]] += 1
        if (op[0] in "FH" or op.startswith("MUFU")) and not re.match(r"\s*R\d+, -?RZ, RZ,", m.group(3)):
            # (HFMA2.MMA R, -RZ, RZ, a, b: a constant moved into a register, no arithmetic)
            args = re.sub(r"\.reuse", "", m.group(3))
            args = re.sub(r"\bU?R\d+\b", "R", re.sub(r"!?U?P[0-9T]\b", "P", args))
            floats[(op + args).strip()] += 1
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    layouts = [ln for ln in k.asm["ttgir"].splitlines() if re.match(r"#(blocked|linear)\d* =", ln)]
    return {"instructions": sum(ops.values()), "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else None, "ops": ops, "floats": floats,
            "layouts": layouts}


def report(name: str, meta: dict, s: dict, top: int) -> None:
    shown = {k: v for k, v in meta.items() if k not in ("PDL",)}
    print(f"== {name}: {shown}")
    print(f"   registers {s['registers']}, spill stores {s['spill_store_bytes']} B, "
          f"static SASS instructions {s['instructions']}")
    print("   " + ", ".join(f"{op} {n}" for op, n in s["ops"].most_common(top)))
    for ln in s["layouts"]:
        print("   " + ln)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a constexpr (or num_warps) over the runner's launch")
    ap.add_argument("--compare", default=None, metavar="NAME=VALUE[,NAME=VALUE]",
                    help="a second build with these settings over the first's")
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--block-v", type=int, default=32, help="Dv columns per program (the runner's: 32)")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-fp-fusion", action="store_true", help="enable_fp_fusion=False (and ptxas --fmad=false)")
    ap.add_argument("--maxnreg", type=int, default=None, help="registers per thread at most (Triton's maxnreg)")
    ap.add_argument("--top", type=int, default=24, help="opcodes shown")
    ap.add_argument("--sass-out", default=None, help="write the first build's SASS here")
    ap.add_argument("--json", default=None, help="write the figures (per build: registers, instructions, "
                                                 "opcode counts, float instructions) here")
    args = ap.parse_args(argv)
    import triton

    def parse(items):
        out = {}
        for item in items:
            if "=" not in item:
                raise SystemExit(f"expected NAME=VALUE, got {item!r}")
            k, v = item.split("=", 1)
            out[k.strip()] = _value(v.strip())
        return out

    kw = dict(lanes=args.lanes, state_dtype=args.state_dtype, fp_fusion=not args.no_fp_fusion, block_v=args.block_v,
              maxnreg=args.maxnreg)
    print(f"triton {triton.__version__} (sm_90 offline); b2's Gated DeltaNet, {args.lanes} lanes, "
          f"{args.state_dtype} state, fp fusion {'off' if args.no_fp_fusion else 'on'}")
    first = parse(args.set)
    k, info, sass, meta = build(first, **kw)
    a = stats(k, info, sass)
    report("build", meta, a, args.top)
    if args.sass_out:
        with open(args.sass_out, "w") as f:
            f.write(sass)
    builds = [(meta, a)]
    if args.compare is not None:
        second = dict(first, **parse([x for x in args.compare.split(",") if x]))
        k2, info2, sass2, meta2 = build(second, **kw)
        b = stats(k2, info2, sass2)
        report("compare", meta2, b, args.top)
        builds.append((meta2, b))
        diff = (a["floats"] - b["floats"]) + (b["floats"] - a["floats"])
        print(f"   float instructions: {sum(a['floats'].values())} vs {sum(b['floats'].values())}; "
              + ("the same multiset (not a proof of equal bits)" if not diff else "multisets differ:"))
        for ins in sorted(diff):
            print(f"     {a['floats'].get(ins, 0):4d} vs {b['floats'].get(ins, 0):4d}  {ins}")
    if args.json:
        out = {"triton": triton.__version__, "lanes": args.lanes, "state_dtype": args.state_dtype,
               "fp_fusion": not args.no_fp_fusion,
               "builds": [{"settings": dict(m), "registers": st["registers"],
                           "spill_store_bytes": st["spill_store_bytes"], "instructions": st["instructions"],
                           "ops": dict(st["ops"]), "float_instructions": sum(st["floats"].values())}
                          for m, st in builds]}
        write_json(args.json, out)  # (whole or not at all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
