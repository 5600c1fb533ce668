"""Row-invariant Triton kernels for the GPU decode / verify path, one folder per op.

Each op folder holds ``kernel.py`` (the Triton kernels, built lazily once per Triton mode
with :func:`hyspec.kernels.pdl.kernels_per_mode`, and their launchers), ``reference.py``
(plain torch, the tests' oracle) and an ``__init__.py`` that states the op's contract and
exports its public functions:

==============  ===========================================================================
``rmsnorm/``    RMSNorm fused with the residual add / embedding gather / split-K reduction
``attention/``  q/k prep + KV write, split-key decode, grouped-query decode, fixed-order combine
``gdn/``        Gated-DeltaNet causal conv, step (scan + gated norm), commit replay
``moe/``        routed-expert GEMV (optionally with the SiLU*mul input)
``matmul/``     skinny ``x @ w.T`` with a per-shape split-K config (``config.py``)
``rng/``        Philox uniforms for whole vocabulary rows
``probs/``      sampling's row softmax and inverse CDF over (row, chunk) programs; the greedy argmax
==============  ===========================================================================


Shared pieces: :mod:`hyspec.kernels.common` (block sizes, argument checks, the deferred
split-K result, the triton import check) and :mod:`hyspec.kernels.pdl` (per-mode kernel
building, programmatic dependent launch).  ``fused.py``, ``attn.py``, ``gemm.py`` and
``philox.py`` are the former flat modules, kept as re-exports so old imports work.

The contract every kernel keeps (see ``docs/gpu.md``): row r of a t-row call computes
exactly what a 1-row call computes for the same inputs -- every program handles one row
(or one row-head pair, or scans the rows in order), reductions run inside one program in
an order fixed by the block sizes (never by the row count), and the row count ``T`` is
passed with ``do_not_specialize`` so T=1 and T=5 run the very same compiled binary.
Runtime flags that differ between a decode step and a verify (``update``/``save``/
strides) are ``do_not_specialize`` as well.  The references mirror the model code's
rounding points (the dtype after each op where the torch model rounds), so in fp32 they
agree with the model to float rounding.

Shape letters: T rows, H hidden, Hq/Hkv attention heads, D head dim, ROT rotary dims,
L cache rows, Hk/Hv linear key/value heads, Dk/Dv their dims, C conv channels, W conv
width, NS attention splits, K/N matmul in/out features, S K-splits.
"""
