"""Compile the top-k / top-p kernels (hyspec/kernels/probs/topp.py) for sm_90 on a machine
without a GPU: catches type and lowering errors the interpreter does not. Prints one line
per variant; no device is used.

    python bench/topp_compile_check.py
"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hyspec.kernels.probs.topp import _topp_kernels, DIGIT, SCAN_BLOCK
from hyspec.kernels.probs.reference import CHUNK
hist_k, cut_k, tie_k = _topp_kernels()
tgt = GPUTarget("cuda", 90, 32)
def comp(fn, sig, const):
    src = ASTSource(fn, signature=sig, constexprs=const)
    k = triton.compile(src, target=tgt)
    print(fn.__name__, "ok", k.metadata.num_warps, len(k.asm["ptx"]))
for kdt in ("*i16", "*i32"):
    for first in (True, False):
        comp(hist_k, {"key_ptr": kdt, "sk": "i32", "w_ptr": "*i64", "sw": "i32", "state_ptr": "*i64", "hist_ptr": "*i64",
                      "V": "i32", "SHIFT": "constexpr", "FIRST": "constexpr", "W": "constexpr", "SB": "constexpr",
                      "BLOCK": "constexpr", "RAW": "constexpr", "HALF": "constexpr", "MREP": "constexpr",
                      "REP": "constexpr"},
             {"SHIFT": 0 if first else 16, "FIRST": first, "W": DIGIT, "SB": SCAN_BLOCK, "BLOCK": CHUNK,
              "RAW": False, "HALF": 0, "MREP": 1, "REP": 1})
    for keep in (False, True):
        comp(tie_k, {"key_ptr": kdt, "sk": "i32", "w_ptr": "*i64", "sw": "i32", "valid_ptr": "*u8", "sv": "i32",
                     "thr_ptr": "*i64", "state_ptr": "*i64", "tot_ptr": "*i64", "out_ptr": "*i8", "so": "i32", "V": "i32",
                     "n_chunks": "i32", "KEEP": "constexpr", "BLOCK": "constexpr", "NC": "constexpr",
                     "RAW": "constexpr", "HALF": "constexpr", "NEG_INF": "constexpr", "HAS_VALID": "constexpr"},
             {"KEEP": keep, "BLOCK": CHUNK, "NC": 256, "RAW": False, "HALF": 0, "NEG_INF": 0, "HAS_VALID": True})
for first in (True, False):
    comp(cut_k, {"hist_ptr": "*i64", "thr_ptr": "*i64", "state_ptr": "*i64", "FIRST": "constexpr", "W": "constexpr",
                 "SB": "constexpr", "MREP": "constexpr", "REP": "constexpr"},
         {"FIRST": first, "W": DIGIT, "SB": SCAN_BLOCK, "MREP": 1, "REP": 1})
