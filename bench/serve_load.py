"""Load test of `hyspec serve` on the loopback interface (not a unit test).

Starts `hyspec serve` as a subprocess on 127.0.0.1 (a free port), runs C concurrent
streaming clients x R requests each (openai.AsyncOpenAI), then checks every streamed text
against the offline Engine.generate_batch output for the same prompt and parameters, and
times an offline batch generation of the same requests. On a GPU (--device cuda) the
server runs these requests (greedy and seeded sampling, no penalties) on the batched CUDA
graphs, and so does Engine.generate_batch; on the CPU both run the engine core. Bounded:
C x R requests, and --max-seconds for the load phase (requests not finished by then count
as failed).

    python bench/serve_load.py                       # 64 clients x 10 requests, default model, CPU
    python bench/serve_load.py --clients 8 --requests 2 --out /tmp/x.json   # a quick look
    python bench/serve_load.py --model DIR --device cuda --dtype bfloat16   # the batched graphs

Writes bench/results/serve_load_<cpu|cuda>.json (git commit and dirty flag included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyspec.provenance import git_state  # noqa: E402

PROMPTS = [
    "def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
    "def read_config(filename):\n    \"\"\"Read a config file.\"\"\"", "import json\n\n\ndef load(path):",
    "def is_prime(n):", "class Node:\n    def __init__(self, value):", "def merge_sort(items):",
    "import re\n\n\ndef tokenize(text):", "def parse_args(argv=None):", "class Timer:\n    def __enter__(self):",
    "def flatten(nested):", "import socket\n\n\ndef connect(host, port):", "def main():\n    parser = ",
    "def __repr__(self):\n    return", "try:\n    import numpy as np\nexcept ImportError:",
]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def request_spec(c: int, r: int, args) -> dict:
    """Request r of client c: a prompt from the list, greedy or seeded sampling alternately."""
    i = c * args.requests + r
    greedy = i % 2 == 0
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
            "temperature": 0.0 if greedy else 0.8, "seed": 0 if greedy else 1000 + (i // 2) % 8}


async def client_task(cl: openai.AsyncOpenAI, c: int, args, model: str, out: list, deadline: float) -> None:
    for r in range(args.requests):
        spec = request_spec(c, r, args)
        rec = {"client": c, "req": r, **spec, "ok": False}
        t0 = time.perf_counter()
        try:
            if time.perf_counter() > deadline:
                raise TimeoutError("load phase time limit")
            stream = await cl.completions.create(model=model, prompt=spec["prompt"], max_tokens=spec["max_tokens"],
                                                 temperature=spec["temperature"], seed=spec["seed"], stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"draft": args.draft})
            text, times, usage, finish = "", [], None, None
            async for ch in stream:
                now = time.perf_counter()
                if ch.usage is not None:
                    usage = ch.usage
                for choice in ch.choices:
                    if choice.text:
                        text += choice.text
                        times.append(now)
                    finish = choice.finish_reason or finish
            rec.update(ok=True, text=text, finish=finish, t_start=t0, t_end=time.perf_counter(),
                       ttft=(times[0] - t0) if times else None, chunk_times=times,
                       completion_tokens=usage.completion_tokens if usage else None)
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            rec.update(error=f"{type(e).__name__}: {e}")
        out.append(rec)


async def load_phase(url: str, args, model: str) -> tuple[list, float]:
    out: list = []
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(limits=limits, timeout=args.max_seconds) as hc:
        cl = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=hc)
        t0 = time.perf_counter()
        deadline = t0 + args.max_seconds
        tasks = [asyncio.create_task(client_task(cl, c, args, model, out, deadline)) for c in range(args.clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.max_seconds + 30)
        for t in pending:
            t.cancel()
        return out, time.perf_counter() - t0


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def offline(args, specs: list[dict]):
    """Reference outputs (Engine.generate_batch over the distinct requests) and the time of
    one offline Engine.generate_batch over all requests."""
    import torch

    from hyspec.engine import Engine
    from hyspec.sampling import SamplingParams

    torch.set_num_threads(1)
    eng = Engine.load(args.model, dtype=args.dtype, device=args.device)

    def batch(keys):
        return eng.generate_batch([k[0] for k in keys], max_new_tokens=args.max_tokens, draft=args.draft,
                                  params=[SamplingParams(temperature=k[1], seed=k[2]) for k in keys],
                                  max_batch=args.max_batch)

    keys = [(s["prompt"], s["temperature"], s["seed"]) for s in specs]
    distinct = list(dict.fromkeys(keys))
    refs = {}
    for key, out in zip(distinct, batch(distinct)):
        toks = out.tokens
        refs[key] = (toks, eng.tokenizer.decode(toks[:-1] if toks and toks[-1] in eng.eos_ids else toks,
                                                skip_special_tokens=True))
    t0 = time.perf_counter()
    outs = batch(keys)
    dt = time.perf_counter() - t0
    n_tok = sum(len(o.tokens) for o in outs)
    stats = outs[0].samples[0].stats if outs else {}
    path = stats.get("path", "engine core")
    mismatched = sum(o.tokens != refs[k][0] for o, k in zip(outs, keys))
    return refs, {"mode": f"Engine.generate_batch(max_batch={args.max_batch}) on the {path}", "seconds": dt,
                  "tokens": n_tok, "tok_s": n_tok / dt, "outputs_differing_from_engine": mismatched,
                  "batch_runner": stats.get("batch_runner")}  # the graph path's time split (prefill, rounds, ...)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=10, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (server and offline engine)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-seconds", type=float, default=1200.0, help="time limit of the load phase")
    ap.add_argument("--out", default=None, help="default: bench/results/serve_load_<cpu|cuda>.json")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / f"serve_load_{args.device.split(':')[0]}.json")

    port = free_port()
    cmd = [sys.executable, "-m", "hyspec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--draft", str(args.draft), "--max-batch", str(args.max_batch),
           "--max-queue", str(args.clients * 2), "--served-model-name", "bench", "--log-level", "warning",
           "--device", args.device, "--dtype", args.dtype]
    if args.model:
        cmd += ["--model", args.model]
    # the tree first, then whatever the caller's PYTHONPATH holds (wheels carried to a machine without network)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > t_end:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        health = httpx.get(url + "/health").json()
        server_engine = health.get("engine")
        if health.get("batch_graphs"):
            server_engine += " + batch graphs"
        # on a GPU the server warms its batched graphs up first: the load starts after it
        # (the offline engine's timed pass runs warm too)
        t_end = time.monotonic() + 300
        while (args.device.startswith("cuda") and health.get("batch_graphs") and health.get("warm_up") is None
               and time.monotonic() < t_end):
            time.sleep(0.5)
            health = httpx.get(url + "/health").json()
        warm_up = health.get("warm_up")
        recs, wall = asyncio.run(load_phase(url, args, "bench"))
        metrics_text = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)

    specs = [request_spec(c, r, args) for c in range(args.clients) for r in range(args.requests)]
    refs, off = offline(args, specs)
    ok = [r for r in recs if r["ok"]]
    failed = len(specs) - len(ok)
    mismatched = [r for r in ok if r["text"] != refs[(r["prompt"], r["temperature"], r["seed"])][1]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    itl_req = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (r["completion_tokens"] - 1)
               for r in ok if r["completion_tokens"] and r["completion_tokens"] > 1 and len(r["chunk_times"]) > 1]
    gen_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    spec_len = next((float(line.split()[-1]) for line in metrics_text.splitlines()
                     if line.startswith("hyspec_spec_mean_acceptance_length ")), None)
    engine_s = {line.split('"')[1]: float(line.split()[-1]) for line in metrics_text.splitlines()
                if line.startswith("hyspec_engine_seconds{")}
    res = {
        "git": git_state(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join(["python3", "bench/serve_load.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "device": args.device},
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "server_cmd": " ".join(cmd[1:]),
                   "server_engine": server_engine},
        "requests": len(specs), "failed": failed, "outputs_differing_from_engine": len(mismatched),
        "errors": sorted({r.get("error", "") for r in recs if not r["ok"]})[:5],
        "load_wall_s": wall, "generated_tokens": gen_tokens, "server_tok_s": gen_tokens / wall if wall else None,
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "mean": statistics.fmean(ttft) if ttft else None},
        "inter_chunk_s": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "n": len(gaps)},
        "itl_per_request_mean_s": {"p50": pct(itl_req, 50), "p99": pct(itl_req, 99)},
        "spec_mean_acceptance_length": spec_len,
        "server_warm_up": warm_up,
        "server_engine_seconds": engine_s,  # the engine thread's time by part during the run (GET /metrics)
        "offline_batch": off,
        "server_vs_offline_tok_s": (gen_tokens / wall) / off["tok_s"] if wall and off["tok_s"] else None,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("config",)}, indent=1))
    return 0 if failed == 0 and not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
