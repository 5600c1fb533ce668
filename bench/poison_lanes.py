"""A constraint that cannot go on, beside an unconstrained request on the engine's graph
lanes (CUDA; on the CPU with --interpret through the Triton interpreter): the unconstrained
request's tokens equal its run alone, the poisoned one ends with stop_reason "error".

    python bench/poison_lanes.py            (GPU)
"""
from __future__ import annotations

import argparse
import sys

from hyspec import Engine
from hyspec.core.request import Request
from hyspec.gpu.batch_loop import run_requests

GRAMMAR = 'start: "ab" x\nx: /[^\\x00-\\U0010FFFF]/'  # after "ab", a character from an empty set


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/poison_lanes.py", args.device)
    eng = Engine.load(device=args.device)
    eng.batch_graphs = True
    victim = eng.encode("def fibonacci(n):")
    ok = True
    for draft in (0, 3):
        alone = eng.generate(victim, max_new_tokens=24, draft=draft).tokens
        spec = eng._spec_options(draft, None)
        reqs = [Request(prompt_ids=victim, max_new_tokens=24, draft=draft, spec=spec),
                Request(prompt_ids=eng.encode("x = "), max_new_tokens=8, draft=draft, spec=spec,
                        constraint=eng.constraint("grammar", GRAMMAR))]
        dec = eng._graph_batch(reqs, 4)
        run_requests(dec, reqs, 4)
        same = list(reqs[0].tokens) == list(alone)
        ok &= same and reqs[1].stop_reason == "error"
        print(f"draft {draft}: neighbour == alone: {same} ({reqs[0].stats.get('path')}); poisoned: "
              f"{reqs[1].stop_reason} ({reqs[1].error})")
    print("isolation held" if ok else "ISOLATION BROKEN")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
