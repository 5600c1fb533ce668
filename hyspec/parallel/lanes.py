"""Two-session lanes: keep both pipeline stages busy by alternating two batch groups.

With one batch, a round is a chain: stage 0's layers (rank 0), then stage 1's layers, the
LM head, accept, commit and the next drafts (the driver) -- each stage idles while the
other works (the bubble: about half of each stage's time with two balanced stages). With
lanes, the requests are dealt round-robin into `lanes` groups, each with its own scheduler
(continuous batching inside the group), and each group's rounds run in their own driver
thread: while the driver works on group A's verify rows (and A's accept and drafts), rank 0
already runs group B's rows through its layers. Commands reach the workers in the order
the driver sends them and served in that order, so the lanes take the replies in ticket
(send) order, one receive at a time -- never depending on message tags (NCCL has none;
gloo also tags each lane's replies with 1 + lane). Every sequence's tokens are the same
as without lanes (exact mode: a row's result does not depend on its batch).
"""

from __future__ import annotations

import threading
import time

from hyspec.core.scheduler import Scheduler


def run_lanes(model, backend, reqs: list, *, max_batch: int, lanes: int = 2) -> dict:
    """Run `reqs` (already validated) in `lanes` groups on the pipeline driver `backend`.
    max_batch is the total: each group decodes up to ceil(max_batch / lanes) together.
    Returns {"wall_s", "lanes"}."""
    driver, link = backend.driver, backend.driver.link
    groups = [g for g in (reqs[i::lanes] for i in range(lanes)) if g]
    per = max(1, -(-max_batch // lanes))
    lock = threading.Lock()
    for r in reqs:  # callbacks (printing) run one at a time whatever the lane
        for name in ("on_tokens", "on_finish"):
            cb = getattr(r, name)
            if cb is not None:
                setattr(r, name, (lambda *a, cb=cb: _locked(lock, cb, *a)))
    errors: list[BaseException] = []

    def lane_main(i: int, group: list) -> None:
        driver.lane = i
        try:
            sched = Scheduler(model, max_batch=per, backend=backend)
            for r in group:
                sched.submit(r)
            sched.run()
        except BaseException as e:  # re-raised in the caller
            errors.append(e)
        finally:
            with link._mu:  # one lane fewer: the driver is idle when all the remaining ones wait
                link.lanes -= 1
                if link.lanes and link._waiting == link.lanes:
                    link._idle_since = time.perf_counter()

    link.lanes = len(groups)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane_main, args=(i, g), name=f"hyspec-lane-{i}") for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    link.lanes = 1
    if errors:
        raise errors[0]
    return {"wall_s": time.perf_counter() - t0, "lanes": len(groups)}


def _locked(lock, cb, *a):
    with lock:
        return cb(*a)
