"""Count the full-vocabulary passes of each sampling site of the BatchDecoder's sampled
rounds (hyspec.gpu.batch_sampling), on the CPU: every torch op that reads or writes a
tensor with at least V / 4 entries per row, and every launch of a row kernel
(hyspec.kernels.probs / the Gumbel-max kernel), for the torch path (16-row blocks) and
the row kernels (run in the Triton interpreter). A count, not a timing: no GPU needed.

    TRITON_INTERPRET=1 python bench/sampling_passes.py [--vocab 151936] [--k 3] [--lanes 1]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.ops, self.paused = vocab, collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:  # inside a kernel launch (the interpreter's own copies)
            return out
        ts = [t for t in torch.utils._pytree.tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.dim() and t.shape[-1] * 4 >= self.vocab for t in ts) and func.__name__ not in (
                "view.default", "_unsafe_view.default", "t.default", "slice.Tensor", "select.int", "expand.default",
                "unsqueeze.default", "squeeze.dim", "reshape.default", "detach.default", "alias.default",
                "as_strided.default", "transpose.int", "permute.default", "empty.memory_format", "view.dtype"):
            self.ops[func.__name__] += 1
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=1)
    args = ap.parse_args()
    from types import SimpleNamespace

    import hyspec.gpu.batch_sampling as bs
    import hyspec.gpu.sampling as dsamp
    from hyspec.gpu.batch_bench import SAMPLED
    from hyspec.kernels import probs as kp
    from hyspec.kernels import rng as kr
    from hyspec.sampling import SamplingParams

    V, k, nb = args.vocab, args.k, args.lanes
    t = k + 1
    g = torch.Generator().manual_seed(0)
    for mode in ("coupled", "rejection"):
        table = dsamp.SamplingTable(nb)
        for b in range(nb):
            table.set(b, SamplingParams(seed=b, mode=mode, **SAMPLED))
        regime = dsamp.SampledGraphKey.of(table.params)
        logits = torch.randn(nb * t, V, generator=g) * 4
        draft_logits = torch.randn(nb, V, generator=g) * 4
        pos = torch.arange(nb) * 5 + 10
        q = torch.softmax(torch.randn(nb, k, V, generator=g, dtype=torch.float64), -1)
        dec = SimpleNamespace(cfg=SimpleNamespace(vocab_size=V), runner=SimpleNamespace(bufs=SimpleNamespace(
            logits=logits)), sampling_table=table, pos=pos, k_lane=torch.full((nb,), k), dev=torch.device("cpu"),
            verify_tokens=torch.randint(0, V, (nb, t), generator=g), draft_probs=q, spec_lane=torch.ones(nb))
        sites = {"plain (decode step)": lambda: bs.plain_draws(draft_logits, table, pos, regime),
                 "draft (one draft)": lambda: bs.draft_draws(draft_logits, table, pos, regime),
                 f"verify + accept ({t} rows / lane)": lambda: bs.accept_sampled(dec, nb, t, regime, plain=False)}
        for use_kernels in (False, True):
            for name, fn in sites.items():
                launches = collections.Counter()
                counter = _Count(V)

                def spy(label, f):
                    def call(*a, **kw):
                        launches[label] += 1
                        counter.paused = True
                        try:
                            return f(*a, **kw)
                        finally:
                            counter.paused = False
                    return call

                with contextlib.ExitStack() as st:
                    st.enter_context(mock.patch.object(bs, "row_kernels", lambda dev: use_kernels))
                    st.enter_context(mock.patch.object(dsamp, "softmax_rows", spy("softmax_rows x2", kp.softmax_rows)))
                    st.enter_context(mock.patch.object(dsamp, "inverse_cdf_rows",
                                                       spy("inverse_cdf_rows x2", kp.inverse_cdf_rows)))
                    # the coupled draw: the Gumbel-max kernel on both paths (as on CUDA before the row kernels)
                    st.enter_context(mock.patch.object(dsamp, "coupled_rows", spy(
                        "gumbel_argmax x1", lambda p, s_, ps, kernel=None: kr.gumbel_argmax(p, s_, 0, ps))))
                    st.enter_context(counter)
                    fn()
                torch_ops = sum(counter.ops.values())
                kern = sum(n * int(label[-1]) for label, n in launches.items())
                rows = (nb * t if name.startswith("verify") else nb) if use_kernels else 16
                print(f"{mode:9s} {'kernels' if use_kernels else 'torch  '} {name:32s} rows {rows:3d} torch ops {torch_ops:4d}"
                      f"  kernel launches {kern:3d}  total {torch_ops + kern:4d}   {dict(launches)}")
                if name.startswith("plain"):
                    print("    ", dict(counter.ops.most_common()))


if __name__ == "__main__":
    main()
