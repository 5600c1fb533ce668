"""hyspec.gpu: the CUDA-graph decoder, many sequences per forward (lanes; one request is
one lane), with row-invariant Triton kernels (see docs/gpu.md).

    from hyspec.gpu import BatchDecoder, decode_one
    dec = BatchDecoder(model, 1024, 3, 16)               # max_len, k_max, slots (lanes)
    out = decode_one(dec, prompt_ids, 256, k=3)          # one sequence; BatchRunner for many
"""
from hyspec.gpu.batch import BatchDecoder
from hyspec.gpu.batch_loop import BatchRunner, LaneRequest, decode_one, forced_table, run_batch
from hyspec.gpu.graphs import GraphFallbackWarning

__all__ = ["BatchDecoder", "BatchRunner", "LaneRequest", "GraphFallbackWarning", "decode_one", "forced_table",
           "run_batch"]
