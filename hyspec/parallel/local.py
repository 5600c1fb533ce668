"""Run engine jobs on a pipeline of local processes from Python (tests, the pipeline bench).

    results = run_jobs(path, world=2, jobs=[("generate", {"prompt": [1, 2, 3], "draft": 3}), ...])

Every job runs on the driver rank's Engine (PipelineBackend); a job is
("generate", kwargs) -> the samples' token lists, ("generate_batch", kwargs) -> one token
list per prompt, ("mark", {}) -> starts the timing counters, ("fork_stats", {}) -> the driver's
optimistic-fork telemetry since the last such job (hyspec/parallel/fork.py). A generate job's
"lanes" and "optimistic" keys set Engine.lanes / Engine.optimistic for it on a pipeline (a
single-process Engine, the reference run of the same jobs, leaves them out: it refuses them).
Processes: torch.multiprocessing (spawn), gloo on CPU / NCCL on CUDA, 127.0.0.1 and a free port.
"""

from __future__ import annotations

import os
import pickle
import tempfile

from hyspec.sampling import SamplingParams


def _params(kw: dict) -> dict:
    kw = dict(kw)
    p = kw.get("params")
    if isinstance(p, dict):
        kw["params"] = SamplingParams(**p)
    elif isinstance(p, list):
        kw["params"] = [SamplingParams(**x) if isinstance(x, dict) else x for x in p]
    return kw


def run_job(eng, job):
    kind, kw = job
    if kind == "mark":
        if eng.backend is not None:
            eng.backend.driver.mark()
        return None
    if kind == "fork_stats":  # the driver's optimistic-fork telemetry since the last call (then reset)
        if eng.backend is None:
            return None
        return eng.backend.driver.fork_stats(reset=kw.get("reset", True))
    kw = _params(kw)
    lanes, optimistic = kw.pop("lanes", 1), kw.pop("optimistic", False)
    if eng.backend is not None:  # (pipeline only: one process runs the same tokens without them)
        eng.lanes, eng.optimistic = lanes, optimistic
    if kind == "generate":
        return [s.tokens for s in eng.generate(**kw).samples]
    if kind == "generate_batch":
        return [o.tokens for o in eng.generate_batch(**kw)]
    raise ValueError(f"unknown job kind {kind!r}")


def _rank_main(rank: int, world: int, port: int, path: str, dtype: str, device: str, jobs, out_file: str,
               threads: int) -> None:
    import time

    import torch

    from hyspec import parallel
    from hyspec.parallel.pipeline import Link, Worker, init, load_stage

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(threads)
    rank, dev = init(world, device)
    link = Link(rank, world, dev)
    try:
        if rank < world - 1:
            model = load_stage(path, world, rank, dtype=dtype, device=dev)
            w = Worker(model, link)
            w.run()
            wall = time.perf_counter() - w.t_mark
            link.send_obj({"busy_s": w.busy_s, "wait_s": link.wait_s, "wall_s": wall, "forwards": w.forwards,
                           "fork": dict(w.fork_counts)}, world - 1)
            return
        parallel.ACTIVE = {"world": world, "rank": rank, "device": dev, "link": link}
        eng = parallel.active_engine(path, dtype=dtype, device=device)
        driver = parallel.ACTIVE["driver"]
        results, error = [], None
        try:
            for job in jobs:
                results.append(run_job(eng, job))
        except Exception as e:  # reported to the caller
            error = f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - driver.t_mark
        driver.stop()
        stats = {"driver": {"compute_s": driver.compute_s, "wait_s": link.wait_s, "wall_s": wall,
                            "forwards": driver.forwards, "fork": driver.fork_stats()},
                 "workers": [link.recv_obj(r) for r in range(world - 1)]}
        with open(out_file, "wb") as f:
            pickle.dump({"results": results, "error": error, "stats": stats}, f)
    finally:
        parallel.ACTIVE = None
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_jobs(path, jobs: list, *, world: int = 2, dtype: str = "float32", device: str = "cpu", threads: int = 1,
             with_stats: bool = False):
    """Run `jobs` on a `world`-stage pipeline of local processes; returns the job results
    (and the timing counters with with_stats)."""
    import torch.multiprocessing as mp

    from hyspec.parallel import free_port

    fd, out_file = tempfile.mkstemp(suffix=".pkl")
    os.close(fd)
    try:
        try:
            mp.spawn(_rank_main, args=(world, free_port(), str(path), dtype, device, jobs, out_file, threads),
                     nprocs=world, join=True)
        except mp.ProcessExitedException as e:  # (killed, or gone without a Python error): named, not a traceback
            from hyspec.parallel import RankDied

            raise RankDied(e.error_index, world, e.exit_code) from None  # (exit_code: -signal for a killed rank)
        with open(out_file, "rb") as f:
            res = pickle.load(f)
    finally:
        os.unlink(out_file)
    if res["error"] is not None:
        raise RuntimeError(f"pipeline job failed: {res['error']}")
    return (res["results"], res["stats"]) if with_stats else res["results"]
