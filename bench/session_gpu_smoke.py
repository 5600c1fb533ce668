"""Smoke check of sessions on CUDA: spec == plain per turn, store hit / demotion to pinned
host memory / promotion back bitwise, save + load bitwise, a one-shot store hit == the live
session. Prints one JSON line (used once on an H200; the CPU tests are the real suite)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyspec.core.state import same_state  # noqa: E402
from hyspec.engine import Engine  # noqa: E402
from hyspec.provenance import git_state
from hyspec.session import Session  # noqa: E402


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print("usage: python bench/session_gpu_smoke.py [DEVICE (cuda)] [DTYPE (float32)]\n" + __doc__)
        return 0
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/session_gpu_smoke.py", dev)
    eng = Engine.load(device=dev, dtype=dtype)
    msgs = ["def add(a, b):\n", "    return a + b\n", "class Stack:\n", "    def push(self, x):\n"]
    plain = eng.session(max_new_tokens=24, ignore_eos=True, use_store=False)
    spec = eng.session(draft=3, max_new_tokens=24, ignore_eos=True)
    res = {"git": git_state(), "device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev,
           "dtype": dtype}
    res["spec_equals_plain"] = all(plain.send(m).tokens == spec.send(m).tokens for m in msgs[:3])
    live = spec.live_state()
    key = spec.tokens
    hit = eng.store.lookup(key + eng.encode(msgs[3]), drafter="post")
    res["store_hit_bitwise"] = same_state(hit, live)
    eng.store.demote(key)
    if dev.startswith("cuda"):
        res["host_tier_pinned"] = all(t.is_pinned() for t in eng.store._entries[tuple(key)].state.tensors().values())
    back = eng.store.lookup(key + eng.encode(msgs[3]), drafter="post")
    res["promoted_bitwise"] = same_state(back, live) and back.device.type == eng.model.device.type
    with tempfile.TemporaryDirectory() as d:
        spec.save(Path(d) / "s.pt")
        loaded = Session.load(eng, Path(d) / "s.pt")
    res["save_load_bitwise"] = same_state(loaded.state(), live)
    one = eng.generate(key + eng.encode(msgs[3]), max_new_tokens=24, draft=3, ignore_eos=True)
    want = spec.send(msgs[3]).tokens
    res["oneshot_store_hit_equals_session"] = one.tokens == want
    res["loaded_continues_identically"] = loaded.send(msgs[3]).tokens == want
    res["turn_stats"] = {k: spec.last_stats[k] for k in ("cached_tokens", "prompt_tokens", "time_to_first_token_s")}
    res["store"] = eng.store.stats()
    print(json.dumps(res))
    return 0 if all(v for k, v in res.items() if isinstance(v, bool)) else 1


if __name__ == "__main__":
    sys.exit(main())
