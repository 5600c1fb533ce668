"""hyspec bench: decode / verify / draft / speculative throughput of one sequence, in one run.

    hyspec bench --config qwen3-next-2b-dense --prompt-len 512 --new-tokens 256 --out bench.json
    hyspec bench --config tiny --device cpu             # CPU smoke (reference backend), ~10 s
    hyspec bench --model DIR                            # a checkpoint
    hyspec bench --config qwen3.5-27b                   # published shapes (hyspec/presets.py), GPU only
    hyspec bench --model DIR --batch 1,4,16             # aggregate throughput through the engine core
    hyspec bench --pp 2                                 # the pipeline bench (its flags: hyspec bench --pp 2 --help)

qwen3-next-2b-dense (the default; old name: b2) is the bench's own ~2.3 B Qwen3-Next-layout
model with random weights. On the CPU the defaults are small (a quick run: short prompt,
few tokens, K = 1..3, the exact variant only, no transformers comparison), the sequence
runs through the engine core's reference backend, the per-phase times are wall-clock
totals of its drafter and verify calls, and the GPU targets (roofline fraction,
speed-ups) are not judged.

Measures, on one device, batch 1, greedy:
  * device copy bandwidth (device-to-device copy, bytes read + written) and the roofline
    of one decode step = weight bytes a step reads / that bandwidth;
  * plain decode tok/s (the BatchDecoder with one lane, CUDA graphs: the decoder every GPU
    request runs on) and its fraction of the roofline;
  * the graph replays of a decode step, a verify of t = 1..8 rows (relative to t = 1), the
    draft graph of k drafts (fill rows + k chained MTP steps; a draft step = k = 1) and a
    whole round;
  * speculative tok/s and speed-up over plain at K = 1..4 with the forced-acceptance
    drafter (rates by depth, default 0.9/0.8/0.7/0.6) and with the real MTP head, the
    per-phase split (draft / verify graphs, commit = the round's graph minus both), and the
    cost-model ceiling
    L * t_decode / (t_verify(K+1) + K * t_draft);
  * all of it for two variants: exact (row-invariant kernels) and cublas (the fastest
    non-exact one: cuBLAS matmuls; old name: fast);
  * GPU greedy exactness: speculative output == plain output, bitwise, for several prompts;
  * the same checkpoint through transformers' generate, side by side.
Prints a table and writes everything as JSON (--out).
"""
# Where each part lives (hyspec/bench/):
#   cli.py       flags, device defaults, main (the order of the steps)
#   models.py    the model measured: a checkpoint, a preset, the bench model, tiny
#   timing.py    time_fn (CUDA events / wall clock), copy_bandwidth
#   variants.py  one variant's plain / verify / draft / speculative figures; exactness check
#   hf.py        transformers' generate on the same weights
#   report.py    log, memory report, GPU targets, the final table
from __future__ import annotations

from hyspec.bench.cli import build_parser, main
from hyspec.bench.hf import hf_generate
from hyspec.bench.models import B2, build_config_model, make_model
from hyspec.bench.report import format_memory, log, memory_report, print_table, targets
from hyspec.bench.timing import copy_bandwidth, time_fn
from hyspec.bench.variants import VARIANT_ALIASES, VARIANTS, bench_variant, exactness_check

__all__ = ["main", "build_parser", "B2", "build_config_model", "make_model", "time_fn", "copy_bandwidth",
           "bench_variant", "exactness_check", "hf_generate", "memory_report", "format_memory", "targets",
           "print_table", "log", "VARIANTS", "VARIANT_ALIASES"]
