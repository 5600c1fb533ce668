"""GPU fast path: a static-shape, CUDA-graph-captured decoder for one sequence (see docs/gpu.md).

    from hyspec.gpu import generate_plain_fast, generate_speculative_fast, FastDecoder
"""
from hyspec.gpu.decoder import FastDecoder
from hyspec.gpu.graphs import GraphFallbackWarning
from hyspec.gpu.generate import forced_table, generate_plain_fast, generate_speculative_fast, get_decoder

__all__ = ["FastDecoder", "GraphFallbackWarning", "generate_plain_fast", "generate_speculative_fast",
           "get_decoder", "forced_table"]
