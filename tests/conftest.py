"""Shared fixtures: tiny checkpoints (make_tiny and transformers' save_pretrained), loaded
models and plain-decoding references, each built once per session and only when a test
asks for it.

Tests here run many tiny forwards (hundreds of [1, 64] matmuls per token). On a shared
2-core machine OpenMP's second thread costs far more than it gains for such shapes (its
spin-waits fight the other processes: one 200-token run took 1.3 s with one thread and
up to 70 s with two), so the whole suite runs single-threaded.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# A suite started in the background by a shell without job control (`pytest ... &`, nohup)
# inherits SIGINT ignored, and so would every CLI the tests start and interrupt: their
# Ctrl-C tests would see no KeyboardInterrupt. Python's own handler here: the children
# start with SIGINT at its default again (an exec keeps ignored signals only).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Interpreter mode for Triton is decided once, before anything imports triton: only on
# machines without CUDA, so it can never leak into GPU tests in the same run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter():
    """triton.runtime.interpreter when this run interprets Triton and triton imports, else None."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter


def _interpreter_without_dead_overflow_checks() -> None:
    """Triton's interpreter widens every int32 add / sub / mul to int64 and compares the
    result with the int32 range ("sanitize_overflow"), then hands the comparison to
    device_assert -- which, without debug=True, returns without checking it. That dead
    work was about a third of an interpreted round (test_batch_decoder's sampled test).
    Turn it off only where it is dead (the interpreter, debug off); nothing is checked
    less."""
    import dataclasses

    interpreter = _interpreter()
    if interpreter is None:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if opts is None or getattr(opts, "debug", True) or not getattr(opts, "sanitize_overflow", False):
        return
    builder.options = dataclasses.replace(opts, sanitize_overflow=False)


_interpreter_without_dead_overflow_checks()


def _interpreter_dot_in_fixed_order() -> None:
    """The interpreter's tl.dot is numpy's matmul, and BLAS sums each output element in an
    order that depends on the CPU it runs on and on the call's shape and layout (OpenBLAS
    picks its kernels per CPU: on this AMD EPYC its AVX2 kernels gave a row other bits in a
    one-row attention call than in a four-row one, where Sandybridge kernels did not).
    Then a row-invariance test in the interpreter checks the BLAS build, not the kernel.
    A GPU MMA adds each element's products in a fixed order whatever the tile; so does
    this dot: the products [K, M, N] in the accumulator's dtype, summed over K in order
    (axis 0 is outermost: numpy adds the K slices one after another, no pairwise split).
    Only for floating operands; anything else keeps the interpreter's own dot
    (HYSPEC_TEST_NUMPY_DOT=1 keeps it everywhere)."""
    import numpy as np

    interpreter = _interpreter()
    if interpreter is None or os.environ.get("HYSPEC_TEST_NUMPY_DOT") == "1":
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    orig = getattr(builder, "create_dot", None)
    if orig is None:
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        ad, bd, acc = a.data, b.data, d.data
        wide = a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8  # fp8: the interpreter's path
        if wide or ad.ndim != 2 or bd.ndim != 2 or not np.issubdtype(acc.dtype, np.floating) \
                or not np.issubdtype(ad.dtype, np.floating) or not np.issubdtype(bd.dtype, np.floating):
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = ad.astype(acc.dtype).T[:, :, None] * bd.astype(acc.dtype)[:, None, :]  # [K, M, N]
        return interpreter.TensorHandle(np.add.reduce(prod, axis=0) + acc, d.dtype.scalar)

    builder.create_dot = create_dot


_interpreter_dot_in_fixed_order()


def _interpreter_type_objects_cached() -> None:
    """Most of an interpreted kernel's time is Triton's front end re-deriving the same type
    objects for every operation of every program: a block type's shape unwrapped and
    validated, a tensor's shape turned into a tuple of constexprs, the numpy dtype of a
    Triton dtype looked up in a dict built per call. Here each is derived once per shape / dtype name and reused (the
    objects are never mutated in the interpreter): the same attributes, values and errors,
    about a third less time per interpreted round (measured on this 2-core machine with
    triton 3.9: test_batch_decoder's sampled lanes test 14.4 -> 9.2 s, test_sessions_graphs's
    rewind test 24.2 -> 16.6 s). Applied only where a probe built both ways agrees (another
    Triton version's objects: left alone)."""
    import math

    interpreter = _interpreter()
    if interpreter is None:
        return
    try:
        from triton.language import core

        tl_tuple, constexpr, block_type, tensor = core.tuple, core.constexpr, core.block_type, core.tensor
        orig_np, orig_bt, orig_tensor = interpreter._get_np_dtype, block_type.__init__, tensor.__init__
    except AttributeError:
        return

    np_dtypes: dict = {}

    def get_np_dtype(tt):  # the dtype's name names its numpy dtype (a block's: shape and element)
        name = getattr(tt, "name", None)
        r = np_dtypes.get(name) if type(name) is str else None
        if r is None:
            r = orig_np(tt)
            if type(name) is str:
                np_dtypes[name] = r
        return r

    blocks: dict = {}

    def bt_init(self, element_ty, shape):
        vals = shape.values if type(shape) is tl_tuple else shape if type(shape) is list else None
        key = tuple([s.value if type(s) is constexpr else s for s in vals]) if vals else None
        known = blocks.get(key) if key is not None and all(type(s) is int for s in key) else None
        if known is None:  # first sight (validated) or anything unusual: Triton's own
            orig_bt(self, element_ty, shape)
            if key is not None and all(type(s) is int for s in key):
                blocks[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape, self.numel, text = known
        self.name = f"<{text}, {element_ty}>"

    shapes: dict = {}

    def tensor_init(self, handle, type):
        self.handle = handle
        block = type.is_block()
        key = type.name if block else ""
        known = shapes.get(key)
        if known is None:
            shape = type.shape if block else ()
            known = shapes[key] = (constexpr(math.prod(shape)), tl_tuple([constexpr(s) for s in shape]))
        self.numel, self.shape = known
        self.type = type
        self.dtype = type.scalar

    def same(a, b):
        return a.keys() == b.keys() and all(str(a[k]) == str(b[k]) for k in a)

    try:  # (another Triton's signatures or fields: the probe fails or differs, and nothing is patched)
        probe_ty = [block_type.__new__(block_type) for _ in range(3)]
        orig_bt(probe_ty[0], core.float32, [constexpr(16), 8])
        bt_init(probe_ty[1], core.float32, [constexpr(16), 8])
        bt_init(probe_ty[2], core.float32, tl_tuple([16, constexpr(8)]))
        probe_t = [tensor.__new__(tensor) for _ in range(2)]
        orig_tensor(probe_t[0], None, probe_ty[0])
        tensor_init(probe_t[1], None, probe_ty[2])
        agree = (same(vars(probe_ty[0]), vars(probe_ty[1])) and same(vars(probe_ty[0]), vars(probe_ty[2]))
                 and same(vars(probe_t[0]), vars(probe_t[1])) and get_np_dtype(probe_ty[2]) == orig_np(probe_ty[0]))
    except Exception:  # noqa: BLE001
        agree = False
    if not agree:
        blocks.clear(), shapes.clear(), np_dtypes.clear()
        return
    interpreter._get_np_dtype = get_np_dtype
    block_type.__init__ = bt_init
    tensor.__init__ = tensor_init


_interpreter_type_objects_cached()


def pytest_configure(config):
    """With -n N (pytest-xdist) and no --dist of its own choosing, the "worksteal" schedule:
    an idle worker takes tests queued for a busy one, so the suite does not wait on one
    worker's tail of long tests (9:32 -> 8:36 on 2 cores, measured once). ("load" is also
    xdist's default, so an explicit --dist load is turned into worksteal too.) The README's
    test command asks for --dist loadgroup instead, which this leaves alone: it keeps the
    tests of tests/test_spec_sampling_e2e.py's module-scoped draws on one worker, so the
    draws are made once (worksteal ignores xdist_group); its timings on this 2-core machine
    (433-576 s) overlap worksteal's of the sessions before (557-643 s for slower code), so
    neither is shown faster. Without xdist: nothing."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "load":
        config.option.dist = "worksteal"

sys.path.insert(0, str(Path(__file__).parent))  # tests/hf_ref.py

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
SOURCES = ("tiny", "hf")  # hyspec.tiny.make_tiny / transformers save_pretrained + mtp.*
DTYPES = ("float64", "float32")
PROMPT = [1, 17, 42, 99, 7, 250, 3, 88]


OVERFLOW_TOKEN = 100


@torch.no_grad()
def make_overflowing(model, lm_bias: float = 0.0, token: int = OVERFLOW_TOKEN):
    """Make `token` (and no other) drive layer 0's MLP past float32's range when it is fed:
    the rows after it hold NaN / +inf (a damaged checkpoint's symptom). lm_bias > 0 scales
    the head's row for it, so that the model chooses (and drafts) it now and then. A tiny
    qwen3_5 / qwen3_next model (layer 0 a Gated DeltaNet layer with a dense MLP). Returns model."""
    emb = model.model.embed_tokens.weight
    emb[:, 0] = 0.0
    emb[token] = 0.0
    emb[token, 0] = 8.0
    layer = model.model.layers[0]
    layer.linear_attn.out_proj.weight[0, :] = 0.0
    layer.mlp.gate_proj.weight[:, 0] = 1e19
    layer.mlp.up_proj.weight[:, 0] = 1e19
    if lm_bias:
        model.lm_head.weight[token] *= lm_bias
    return model


@torch.no_grad()
def make_drafter_overflowing(model, lm_bias: float = 0.0, token: int = OVERFLOW_TOKEN):
    """Make `token` (and no other) drive the MTP head's MLP past float32's range when the
    drafter is fed it: the draft row it is fed for holds NaN / +inf (its keys and values
    stay finite: the MLP comes after the attention), the target's rows stay finite (a
    damaged MTP checkpoint's symptom). lm_bias > 0 scales the head's row for it, so that
    the model chooses (and drafts) it now and then. A tiny qwen3_5 / qwen3_next model with
    an MTP head (its fc input: the normed embedding first). Returns model."""
    emb = model.model.embed_tokens.weight
    emb[:, 0] = 0.0
    emb[token] = 0.0
    emb[token, 0] = 8.0
    fc = model.mtp.fc.weight  # [H, 2H]: row 0 takes the normed embedding's component 0 alone
    fc[0, :] = 0.0
    fc[0, 0] = 1.0
    layer = model.mtp.layers[0]
    layer.self_attn.o_proj.weight[0, :] = 0.0  # (component 0 of the residual: the token's alone)
    mlp = layer.mlp
    mlp.gate_proj.weight[:, 0] = 1e20
    mlp.up_proj.weight[:, 0] = 1e20
    if lm_bias:
        model.lm_head.weight[token] *= lm_bias
    return model


@torch.no_grad()
def make_infinite(model, token: int = 150, drafter: bool = True):
    """Make the logit of `token` +inf (or -inf) in the drafter's rows (drafter=True; the
    target's stay finite) or the target's (False), the rows' other logits finite: that
    head's final norm scales hidden component 0 by 1e37, which only token's row of the
    shared head reads (times 100). The sign follows the component's: a row of +inf now and
    then. A tiny qwen3_5 / qwen3_next model with an MTP head. Returns model."""
    (model.mtp.norm if drafter else model.model.norm).weight[0] = 1e37
    model.lm_head.weight[:, 0] = 0.0
    model.lm_head.weight[token, 0] = 100.0
    return model


def spy_bad_rows(monkeypatch) -> dict:
    """Count, in every graph round the BatchRunner reads, the lanes whose bad row (the result
    row's last column) was used (<= the accepted n) or not: {"used": .., "unused": ..}."""
    from hyspec.gpu import batch_loop
    from hyspec.gpu.batch import NO_BAD_ROW

    seen = {"used": 0, "unused": 0}
    take = batch_loop.BatchRunner._take

    def spy(self, rows, k, lp=None, kept=None):
        for r, row in zip(self.active, rows):
            if r.reason is None and row[-1] != NO_BAD_ROW:
                seen["used" if row[-1] <= row[0] else "unused"] += 1
        return take(self, rows, k, lp, kept)

    monkeypatch.setattr(batch_loop.BatchRunner, "_take", spy)
    return seen


def make_cooperative(model, *, hidden_mix: float = 0.3, attn_scale: float = 30.0, seed: int = 0):
    """A copy of `model` whose MTP head agrees with the target part of the time (depth-1
    acceptance ~0.1-0.3 on the tiny models) while every input of a draft still matters.

    fc maps the normalised token embedding through unchanged and adds a random mix of the
    normalised hidden (hidden_mix); mtp.norm copies the final norm. The drafter's logits
    are then roughly the target's "token after t" with its decoder layers switched off,
    which random tiny layers barely change. The MTP block is kept, its attention output
    scaled up (attn_scale) so the draft KV cache visibly moves the drafts: with the
    defaults, shifting the seed hiddens by one row changes ~60% of the drafts and leaving
    chained rows in the draft KV ~35% of them. The target is unchanged."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.mtp.named_parameters():
            if name.endswith("o_proj.weight"):
                p.mul_(attn_scale)
        H = m.cfg.hidden_size
        fc = torch.zeros(H, 2 * H, dtype=torch.float64)
        fc[:, :H] = torch.eye(H, dtype=torch.float64)
        fc[:, H:] = hidden_mix * torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5
        m.mtp.fc.weight.copy_(fc.to(m.mtp.fc.weight.dtype))
        m.mtp.pre_fc_norm_embedding.weight.zero_()
        m.mtp.norm.weight.copy_(m.model.norm.weight)
    return m


class Zoo:
    """Lazily built, session-cached checkpoints, models and plain references."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._paths: dict = {}
        self._hf: dict = {}
        self._models: dict = {}
        self._plain: dict = {}

    def path(self, source: str, arch: str, *, with_mtp: bool = True) -> Path:
        key = (source, arch, with_mtp)
        if key not in self._paths:
            d = self._tmp.mktemp(f"{source}_{arch}{'' if with_mtp else '_nomtp'}")
            if source == "tiny":
                from hyspec.tiny import make_tiny

                make_tiny(arch, d, seed=0, with_mtp=with_mtp)
            elif source == "hf":
                from hf_ref import make_hf_checkpoint

                self._hf[key] = make_hf_checkpoint(arch, d, seed=0, with_mtp=with_mtp)
            else:
                raise ValueError(source)
            self._paths[key] = d
        return self._paths[key]

    def hf_model(self, arch: str):
        """The transformers model written to path('hf', arch) (fp32, eval mode)."""
        self.path("hf", arch)
        return self._hf[("hf", arch, True)]

    def model(self, source: str, arch: str, dtype: str = "float64", variant: str = "plain"):
        """variant: "plain" (the checkpoint) or "coop" (make_cooperative: target unchanged,
        MTP head changed to agree with it part of the time)."""
        key = (source, arch, dtype, variant)
        if key not in self._models:
            if variant == "plain":
                from hyspec.loading import load_model

                self._models[key] = load_model(self.path(source, arch), dtype=dtype)
            elif variant == "coop":
                self._models[key] = make_cooperative(self.model(source, arch, dtype))
            else:
                raise ValueError(variant)
        return self._models[key]

    def plain(self, source: str, arch: str, dtype: str, n: int, prompt=tuple(PROMPT)) -> list[int]:
        """Plain greedy continuation of `prompt` (n tokens) by the checkpoint's target (MTP
        variants share the target, so this is their reference too)."""
        key = (source, arch, dtype, tuple(prompt))
        have = self._plain.get(key)
        if have is None or len(have) < n:
            from hyspec.decode import generate_plain

            have = generate_plain(self.model(source, arch, dtype), list(prompt), max_new_tokens=n).tokens
            self._plain[key] = have
        return have[:n]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory)


@pytest.fixture(scope="module")
def triton_interpreter():
    """For test modules that run Triton kernels in the CPU interpreter. Triton's standard
    library must be imported in interpreter mode, so the mode is chosen once per process
    (top of this file): on a machine without CUDA everything interprets; on a GPU machine
    nothing does (the GPU tests run the same kernels on the device) and these modules skip."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CUDA is available: Triton kernels are tested on the device (tests/test_gpu_*.py)")


_DEVICE_CALL = """    def __call__(self, *args, **kwargs):
        # This is a device function call
        _patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e
"""


def _patch_lang_once_per_launch():
    """Triton's interpreter patches triton.language (every builtin, found with
    inspect.getmembers) at each kernel launch, and again at every call of a jit function
    inside the kernel: tl.sum, tl.max and the like call jit'd combine functions, so the
    language was patched dozens of times per launch (a 12-row batched target forward of
    test_batch_decoder's tiny model: 3,360 patchings, 4.4 s; with this, 94 and 2.9 s, the
    logits bitwise the same).  This makes a call inside a launch skip the patching when
    the launch has already patched the language modules the function sees (tl, tl.core):
    the patch would set the same stateless wrappers again, so the kernels compute exactly
    what they did.  Only when this Triton's device-function call is the one above (3.x);
    else nothing changes.  Returns the undo."""
    import inspect
    import threading

    import triton.language as tl
    import triton.runtime.interpreter as ti

    fn_cls, grid_cls = ti.InterpretedFunction, ti.GridExecutor
    device_call, launch = fn_cls.__call__, grid_cls.__call__
    try:
        if inspect.getsource(device_call) != _DEVICE_CALL:
            return lambda: None
    except (OSError, TypeError):
        return lambda: None

    def langs_of(fn):  # the language modules _patch_lang(fn) patches
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    local = threading.local()  # the launches in progress on this thread: the modules each has patched

    def launch_once(self, *args, **kwargs):
        stack = local.__dict__.setdefault("stack", [])
        stack.append(set(langs_of(self.fn)))  # GridExecutor.__call__ patches them first
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def call_inside(self, *args, **kwargs):
        stack, langs = local.__dict__.get("stack"), langs_of(self.fn)
        if not stack or not langs <= stack[-1]:
            ti._patch_lang(self.fn)
            if stack:
                stack[-1] |= langs
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    fn_cls.__call__, grid_cls.__call__ = call_inside, launch_once

    def undo():
        fn_cls.__call__, grid_cls.__call__ = device_call, launch

    return undo


@pytest.fixture(scope="session", autouse=True)
def _interpreter_patched_once_per_launch():
    """Every test that interprets Triton kernels gets the one patching per launch
    (_patch_lang_once_per_launch): the kernel-level tests (top-p, probabilities, ...) as
    much as the decoder tests, which had it first."""
    if _interpreter() is None:
        yield
        return
    undo = _patch_lang_once_per_launch()
    yield
    undo()


# The server tests' fixtures (tests/test_server*.py): a real uvicorn server on 127.0.0.1
# (free port) over the embedded default model, the official openai client, and an offline
# Engine to compare with. Imported lazily: the server extras are optional.
SERVER_MODEL = "hyspec-default"


@pytest.fixture(scope="module")
def ref_engine():
    from hyspec.engine import Engine

    return Engine.load()


@pytest.fixture(scope="module")
def server():
    from hyspec.engine import Engine
    from hyspec.server.app import ServerConfig, create_app
    from hyspec.server.thread import ServerThread

    app = create_app(Engine.load(), ServerConfig(served_model_name=SERVER_MODEL, draft=3, max_batch=8,
                                                 max_queue=64))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
