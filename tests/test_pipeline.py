"""Pipeline stages (hyspec/parallel): two gloo processes on the CPU give bitwise the tokens
of one process -- greedy and seeded sampling, plain and speculative, single requests and a
mixed-K batch -- for all three families; the CLI's --pp 2 (self-launched and torchrun)
prints what a single process prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ARCHS, make_cooperative

from hyspec.engine import Engine
from hyspec.loading import load_model
from hyspec.parallel import free_port
from hyspec.parallel.local import run_job, run_jobs
from hyspec.parallel.pipeline import split_layers, stage_ranges
from hyspec.speculative.loop import SpecOptions

ROOT = Path(__file__).resolve().parent.parent
P1 = [1, 17, 42, 99, 7, 250, 3, 88]
P2 = [5, 9, 200, 31]
P3 = [300, 2, 2, 2, 77, 12]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 5}

JOBS = [
    ("generate", {"prompt": P1, "max_new_tokens": 16}),
    ("generate", {"prompt": P1, "max_new_tokens": 16, "draft": 3}),
    ("generate", {"prompt": P1, "max_new_tokens": 16, "draft": 2, "params": SAMPLED}),
    ("generate", {"prompt": P2, "max_new_tokens": 12, "params": {"temperature": 0.8, "seed": 11}}),
    ("generate", {"prompt": P2, "max_new_tokens": 12, "draft": 3, "spec": SpecOptions(rollback="rescan")}),
    ("generate", {"prompt": P3, "max_new_tokens": 12, "draft": 2, "spec": SpecOptions(rollback="replay")}),
    ("generate_batch", {"prompts": [P1, P2, P3], "max_new_tokens": [10, 14, 12], "draft": [0, 2, 3],
                        "params": [{"temperature": 0.0}, SAMPLED, {"temperature": 0.0}], "max_batch": 3}),
    # two-session lanes (hyspec/parallel/lanes.py): the same tokens
    ("generate_batch", {"prompts": [P1, P2, P3, P2], "max_new_tokens": [10, 14, 12, 9], "draft": [3, 0, 2, 3],
                        "params": [SAMPLED, {"temperature": 0.0}, {"temperature": 0.0}, SAMPLED], "max_batch": 4,
                        "lanes": 2}),
    ("generate", {"prompt": P2, "max_new_tokens": 10, "draft": 2, "params": SAMPLED, "num_samples": 3,
                  "lanes": 2}),
    # one slot, reused: each stage starts the next sequence on a zeroed state
    ("generate_batch", {"prompts": [P1, P3, P2], "max_new_tokens": [10, 6, 5], "draft": [2, 0, 3], "max_batch": 1}),
]


def coop_checkpoint(arch: str, d: Path) -> Path:
    """An 8-layer tiny checkpoint whose MTP head agrees with the target part of the time
    (so speculative rounds accept some drafts and roll back after others)."""
    from safetensors.torch import save_file

    from hyspec.tiny import make_tiny

    base, out = d / "base", d / "coop"
    make_tiny(arch, base, seed=0, layers=8)
    m = make_cooperative(load_model(base, dtype="float64"))
    out.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file({k: p.detach().float().contiguous() for k, p in m.named_parameters()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {a: coop_checkpoint(a, tmp_path_factory.mktemp(f"pp_{a}")) for a in ARCHS}


def test_split_rule():
    # balanced bytes: the last stage's head bytes count against it
    assert split_layers([10] * 8, 0, 0, 2) == [range(0, 4), range(4, 8)]
    assert split_layers([10] * 8, 0, 20, 2) == [range(0, 5), range(5, 8)]
    assert split_layers([10] * 9, 5, 5, 3) == [range(0, 3), range(3, 6), range(6, 9)]
    with pytest.raises(ValueError):
        split_layers([10] * 2, 0, 0, 3)
    # ties go to the earlier cut; stage 0's own bytes (the embedding) count against stage 0 only
    assert split_layers([10] * 3, 0, 0, 2) == [range(0, 1), range(1, 3)]
    assert split_layers([10] * 8, 20, 0, 2) == [range(0, 3), range(3, 8)]
    assert split_layers([10] * 9, 30, 0, 3) == [range(0, 1), range(1, 5), range(5, 9)]
    assert split_layers([10] * 3, 0, 0, 3) == [range(0, 1), range(1, 2), range(2, 3)]  # one layer a stage


def test_split_bytes_are_the_stages_own_tensors(ckpts):
    """layer_bytes counts, from config.json alone, what each stage holds: every layer's bytes,
    the embedding on stage 0, and the last stage's embedding (the MTP head embeds its drafts),
    final norm, LM head and MTP head (docs/multi-gpu.md, the split rule)."""
    from hyspec.config import ModelConfig
    from hyspec.parallel.pipeline import layer_bytes

    path = ckpts["qwen3_5_moe"]
    cfg = ModelConfig.from_dir(path)
    full = load_model(path, dtype="float32")
    size = {k: p.numel() * 4 for k, p in full.named_parameters()}

    def total(*prefixes):
        return sum(n for k, n in size.items() if k.startswith(prefixes))

    per, first, last = layer_bytes(cfg)
    assert per == [total(f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]
    assert first == total("model.embed_tokens.") > 0
    assert last == first + total("model.norm.", "lm_head.", "mtp.") and total("mtp.") > 0
    assert layer_bytes(cfg, torch.bfloat16) == ([n // 2 for n in per], first // 2, last // 2)


def test_launch_checks_and_messages(ckpts, monkeypatch):
    """What a `--pp N` launch says before it starts ranks, and its pieces: the --pp value
    (serve's parser takes any integer), N against the model's layers and the GPUs, which
    commands pass a Ctrl-C to the driver, the timeouts' values, a rank's exit in words and
    as a shell's exit code, and which GPU a rank takes."""
    import signal

    import torch

    from hyspec import engine, parallel
    from hyspec.parallel import RankDied, check_launch, graceful_ctrl_c, pp_from_argv
    from hyspec.parallel.pipeline import env_number, init, rank_device

    assert pp_from_argv(["serve"]) == 1 and pp_from_argv(["serve", "--pp", "3"]) == 3
    for bad, msg in (("0", "--pp must be >= 1, got 0"), ("two", "--pp must be an integer >= 1, got 'two'")):
        with pytest.raises(ValueError, match=msg):
            pp_from_argv(["serve", "--pp", bad])
    model = ["generate", "--model", str(ckpts["qwen3_5"])]  # 8 layers
    check_launch(model, 8)  # one layer a stage
    with pytest.raises(ValueError, match="--pp 9: the model has 8 layers; each stage needs at least one"):
        check_launch(model, 9)
    monkeypatch.setattr(engine, "check_device", lambda d: torch.device(d))  # (as on a machine with GPUs)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_launch(model + ["--device", "cuda"], 2)
    with pytest.raises(ValueError, match=r"--pp 3 --device cuda puts rank r on cuda:r: this machine has 2 GPU\(s\)"):
        check_launch(model + ["--device", "cuda"], 3)
    assert graceful_ctrl_c(["generate", "--prompt", "x"]) and graceful_ctrl_c(["generate", "--lanes", "1"])
    assert not graceful_ctrl_c(["generate", "--lanes", "2"]) and not graceful_ctrl_c(["serve"])
    assert not graceful_ctrl_c([])
    for raw in ("0", "-1", "inf", "nan"):
        monkeypatch.setenv("HYSPEC_PP_TIMEOUT", raw)
        with pytest.raises(ValueError, match="must be a positive number of seconds"):
            env_number("HYSPEC_PP_TIMEOUT", 1.0)
    monkeypatch.setenv("HYSPEC_PP_TIMEOUT", "0.5")
    assert env_number("HYSPEC_PP_TIMEOUT", 1.0) == 0.5
    monkeypatch.setenv("WORLD_SIZE", "2.5")
    with pytest.raises(ValueError, match="WORLD_SIZE='2.5' is not an integer"):
        init(2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # (torchrun --nproc-per-node 2 with --pp 3)
    with pytest.raises(ValueError, match="--pp 3 needs 3 processes; this launch has WORLD_SIZE=2"):
        init(3)
    assert str(RankDied(1, 2, -9)) == "pipeline rank 1 of 2 was killed by SIGKILL; the other ranks were stopped"
    assert RankDied(1, 2, -9).exit_code == 137 and RankDied(0, 2, -int(signal.SIGTERM)).exit_code == 143
    assert "pipeline rank 0 of 3 exited with code 3;" in str(RankDied(0, 3, 3)) and RankDied(0, 3, 3).exit_code == 3
    assert RankDied(0, 2, 0).exit_code == 1  # (gone mid-run: a failure, whatever its code)
    assert "killed by signal 99;" in str(RankDied(0, 2, -99)) and RankDied(0, 2, -99).exit_code == 227
    # a GPU per rank of this host: LOCAL_RANK (RANK counts the ranks of every host)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("cuda") == torch.device("cuda", 1) and rank_device("cuda:0") == torch.device("cuda", 0)
    assert rank_device("cpu") == torch.device("cpu")
    assert parallel.ACTIVE is None


class _Rank:
    """A rank process of launch() (subprocess.Popen's calls it makes): exits with `code`
    (None: runs until it is stopped)."""

    def __init__(self, code):
        self.returncode, self.code = None, code

    def poll(self):
        if self.returncode is None and self.code is not None:
            self.returncode = self.code
        return self.returncode

    def terminate(self):
        if self.returncode is None:
            self.returncode = -15

    send_signal = kill = lambda self, *_: self.terminate()

    def wait(self, timeout=None):
        return self.poll()


@pytest.mark.parametrize("codes, rc, line", [
    ((0, 0), 0, None),
    ((2, None), 2, None),  # the driver's own error: rank 0 printed it
    ((-9, None), 137, "pipeline rank 0 of 2 was killed by SIGKILL"),
    ((None, 3), 3, "pipeline rank 1 of 2 exited with code 3"),
    ((None, None, -6), 134, "pipeline rank 2 of 3 was killed by SIGABRT"),
])
def test_launch_reports_a_rank_that_ends(codes, rc, line, monkeypatch, capsys):
    """launch() with a rank that ends on its own: the others are stopped, the command's exit
    code is a shell's for it (128 + signal), and a rank other than rank 0 (or a killed rank
    0) is named in one line."""
    import signal

    from hyspec import parallel

    ranks = iter(codes)
    monkeypatch.setattr(parallel.subprocess, "Popen", lambda *a, **kw: _Rank(next(ranks)))
    term = signal.getsignal(signal.SIGTERM)
    try:
        assert parallel.launch(["generate"], len(codes)) == rc
    finally:
        signal.signal(signal.SIGTERM, term)
    err = capsys.readouterr().err
    assert err == ("" if line is None else f"hyspec: error: {line}; the other ranks were stopped\n")


class _FakeLink:
    """The driver's side of a Link: what it sends, and `answers` from each rank."""

    def __init__(self, world, answers=None):
        self.rank, self.world, self.comm_dev, self.lanes = world - 1, world, torch.device("cpu"), 1
        self.answers, self.sent = answers or {}, []

    def send_obj(self, obj, dst):
        self.sent.append((dst, obj))

    def recv_obj(self, src):
        return self.answers[src]


def test_driver_messages_to_the_stages():
    """The driver's own messages: stop hands the command's output to rank 0 only (it prints
    it), and a fork still in flight at a stop, a mark or the end of a run (settle) is thrown
    away by every stage and counted as dropped (its rows wasted)."""
    import types

    from hyspec.parallel.fork import PendingFork
    from hyspec.parallel.pipeline import Driver

    fwd = {"ids": [4, 5], "sizes": [2], "seqs": [(1, 64, 9, True, "states", False)]}
    link = _FakeLink(3)
    d = Driver(types.SimpleNamespace(), link)
    d.settle()  # nothing in flight: nothing to say
    assert link.sent == [] and not d.forking
    d.optimistic = True
    assert d.forking
    link.lanes = 2  # (the other lane already fills stage 0)
    assert not d.forking
    link.lanes = 1
    d.fork = PendingFork(fwd, 2)
    d.settle()
    assert link.sent == [(r, {"settle": True, "fork_res": "miss"}) for r in (0, 1)] and d.fork is None
    t = d.fork_stats()
    assert (t["forks"], t["dropped"], t["misses"], t["wasted_rows"], t["trace"]) == (0, 1, 0, 2, "d")
    link.sent.clear()
    d.fork = PendingFork(fwd, 2)
    d.mark()
    assert link.sent == [(r, {"mark": True, "fork_res": "miss"}) for r in (0, 1)] and d.fork is None
    assert d.fork_stats()["dropped"] == 0  # (mark starts the counters afresh)
    link.sent.clear()
    d.fork = PendingFork(fwd, 2)
    d.stop(("out", "err", 0))
    assert link.sent == [(0, {"stop": True, "result": ("out", "err", 0)}), (1, {"stop": True, "result": None})]
    assert d.fork is None and d.fork_stats()["dropped"] == 1


def test_a_workers_reused_cache_starts_zeroed(ckpts):
    """A worker's cache for a driver's slot: made at position 0, zeroed when the slot is
    reused (a forward at 0 on a cache with state: the recurrent state of the previous
    sequence must not leak in; its effect on a tiny model's tokens can be too small to
    see), made anew for a new length; any other position without state is a desync."""
    from hyspec.parallel.pipeline import Worker, load_stage

    w = Worker(load_stage(ckpts["qwen3_5"], 2, 0), _FakeLink(2))
    c = w._cache(7, 32, 0)
    assert w._cache(None, 32, 0) is None and c.linear_states
    c.pos = 5
    for s in c.linear_states:
        s.conv, s.ssm, s.record = torch.ones_like(s.conv), torch.ones_like(s.ssm), ["rec"]
    assert w._cache(7, 32, 5) is c and c.pos == 5  # (the same sequence, going on)
    assert w._cache(7, 32, 0) is c and c.pos == 0
    assert all(not s.conv.any() and not s.ssm.any() and s.record is None for s in c.linear_states)
    assert w._cache(7, 48, 0) is not c and w.caches[7].max_len == 48
    with pytest.raises(RuntimeError, match="pipeline desync: no state for cache 8 at position 3"):
        w._cache(8, 32, 3)


def test_lanes_deal_the_requests_and_split_max_batch(monkeypatch):
    """run_lanes: the requests dealt round-robin into at most `lanes` groups (none empty),
    each decoding up to ceil(max_batch / lanes) together; a lane's error is raised after
    every lane ended; the link counts one lane again afterwards (forking, the bubble)."""
    import threading
    import types

    from hyspec.parallel import lanes

    runs = []

    class FakeScheduler:
        def __init__(self, model, *, max_batch, backend):
            self.max_batch, self.reqs = max_batch, []

        def submit(self, r):
            self.reqs.append(r)

        def run(self):
            runs.append((self.max_batch, [r.name for r in self.reqs]))
            for r in self.reqs:
                if r.name == "bad":
                    raise RuntimeError("lane failed")
                r.on_tokens(r.name)

    monkeypatch.setattr(lanes, "Scheduler", FakeScheduler)
    link = types.SimpleNamespace(_mu=threading.Lock(), lanes=1, _waiting=0, _idle_since=0.0)
    backend = types.SimpleNamespace(driver=types.SimpleNamespace(link=link, lane=0))
    printed = []

    def reqs(names):
        return [types.SimpleNamespace(name=n, on_tokens=printed.append, on_finish=None) for n in names]

    assert lanes.run_lanes(None, backend, reqs("abcde"), max_batch=3)["lanes"] == 2
    assert sorted(runs) == [(2, ["a", "c", "e"]), (2, ["b", "d"])] and sorted(printed) == list("abcde")
    assert link.lanes == 1
    runs.clear()
    assert lanes.run_lanes(None, backend, reqs("ab"), max_batch=4, lanes=3)["lanes"] == 2
    assert sorted(runs) == [(2, ["a"]), (2, ["b"])] and link.lanes == 1
    with pytest.raises(RuntimeError, match="lane failed"):
        lanes.run_lanes(None, backend, reqs(["a", "bad", "c"]), max_batch=2)
    assert link.lanes == 1


def test_check_stages_names_the_stage_that_did_not_load():
    """The driver's start-up question: the first stage that could not load, its layers
    (first..last) and rank, and why."""
    from hyspec.parallel import check_stages

    link = _FakeLink(3, {0: {"load_error": None}, 1: {"load_error": "missing tensor"}})
    with pytest.raises(ValueError) as e:
        check_stages(link, [range(0, 3), range(3, 5), range(5, 8)])
    assert str(e.value) == "pipeline stage 1 (layers 3..4, rank 1) could not load: missing tensor"
    assert link.sent == [(0, {"status": True}), (1, {"status": True})]


def test_stage_loads_only_its_layers(ckpts):
    path = ckpts["qwen3_5_moe"]
    from hyspec.config import ModelConfig

    ranges = stage_ranges(ModelConfig.from_dir(path), 2)
    assert ranges[0].start == 0 and ranges[0].stop == ranges[1].start and ranges[1].stop == 8
    s0 = load_model(path, layers=ranges[0])
    s1 = load_model(path, layers=ranges[1])
    full = load_model(path)
    n0 = {k for k, _ in s0.named_parameters()}
    n1 = {k for k, _ in s1.named_parameters()}
    assert not any(k.startswith(("mtp.", "lm_head.", "model.norm.")) for k in n0)
    assert any(k.startswith("mtp.") for k in n1)
    assert all(f"layers.{i}." not in k for k in n0 for i in ranges[1])
    assert (n0 | n1) == {k for k, _ in full.named_parameters()}


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen3_next"])
def test_pipeline_matches_single_process(ckpts, arch):
    """Every job on the MoE family; on qwen3_5 (the stages' split, rollbacks and lanes do
    not depend on the family: CI's time) the speculative, sampled, batch and lanes jobs;
    qwen3_next runs the same four jobs through three stages (test_three_stages)."""
    path = ckpts[arch]
    jobs = JOBS if arch == "qwen3_5_moe" else [JOBS[i] for i in (1, 2, 6, 7)]
    eng = Engine(load_model(path, dtype="float32"))
    specs = []  # the speculative single-request jobs' round counts (from the reference runs themselves)
    generate = eng.generate

    def spy(*a, **kw):
        out = generate(*a, **kw)
        if kw.get("draft"):
            specs.append(out.stats["spec"])
        return out

    eng.generate = spy
    want = [run_job(eng, job) for job in jobs]
    got = run_jobs(path, jobs, world=2)
    for job, w, g in zip(jobs, want, got):
        assert g == w, job
    # the speculative jobs really accepted and rejected drafts (so stages rolled back)
    assert len(specs) == sum(k == "generate" and bool(kw.get("draft")) for k, kw in jobs)
    assert 0 < sum(s["accepted"] for s in specs) < sum(s["drafted"] for s in specs)


def _cli(args, env=None, launcher=None):
    import signal

    cmd = (launcher or [sys.executable, "-m", "hyspec.cli"]) + args
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the ranks too
        p.communicate()
        raise
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    assert r.returncode == 0, r.stderr
    return r


def _each(calls):
    """cli_each (tests/cli_helpers.py) in a new session: the --pp calls' ranks are stopped
    with it on a timeout."""
    from cli_helpers import _EACH, parse_each

    r = _cli(["-c", _EACH, json.dumps(calls)], env={"PYTHONPATH": str(ROOT)}, launcher=[sys.executable])
    return parse_each(r.stdout, len(calls))


def test_cli_pp2(ckpts):
    path = str(ckpts["qwen3_next"])
    args = ["generate", "--model", path, "--prompt-ids", "1,17,42,99,7", "--max-new-tokens", "12", "--draft", "3",
            "--temperature", "0.7", "--seed", "3", "--json"]
    targs = ["generate", "--model", path, "--prompt-ids", "1,17,42,99,7", "--max-new-tokens", "10", "--draft", "2"]
    # what a single process prints, for each, and what --pp 2 prints (each call alone, one
    # after the other, in one Python process: a --pp 2 call launches its own ranks)
    (code, out), (tcode, tout), (pcode, pout), (ptcode, ptout) = _each(
        [args, targs, args + ["--pp", "2"], targs + ["--pp", "2"]])
    assert code == tcode == pcode == ptcode == 0
    one = json.loads(out)
    two = json.loads(pout)  # exactly one JSON object: only rank 0 prints
    assert two["tokens"] == one["tokens"] and two["text"] == one["text"]
    # text mode: the same printed completion
    assert ptout == tout


def test_cli_pp2_torchrun(ckpts):
    path = str(ckpts["qwen3_5"])
    args = ["generate", "--model", path, "--prompt-ids", "4,5,6", "--max-new-tokens", "8", "--draft", "2", "--json"]
    one = json.loads(_cli(args).stdout)
    tr = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
          "-m", "hyspec.cli"]
    r = _cli(args + ["--pp", "2"], env={"OMP_NUM_THREADS": "1"}, launcher=tr)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["tokens"] == one["tokens"]


def test_cli_pp_errors(ckpts, monkeypatch, capsys):
    r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--model", str(ckpts["qwen3_5"]),
                        "--prompt-ids", "1,2", "--draft", "99", "--pp", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--draft must be in" in r.stderr
    # a bad option is reported before any rank is started
    from hyspec import parallel
    from hyspec.cli.dispatch import main

    def no_launch(argv, world):
        raise AssertionError(f"ranks launched for {argv}")

    monkeypatch.setattr(parallel, "launch", no_launch)
    monkeypatch.delenv("RANK", raising=False)  # (as a user's shell: this process would launch the ranks)
    lines = ckpts["qwen3_5"].parent / "reqs.jsonl"
    lines.write_text('{"prompt_ids": [1, 2, 3], "draft": 2}\n')
    model = ["generate", "--model", str(ckpts["qwen3_5"]), "--pp", "2"]
    for bad, msg in ((["--prompt-ids", "1,2", "--draft", "99"], "--draft must be in"),
                     (["--prompt-ids", "1,2", "--forced-rates", "0.9"], "--forced-rates needs --draft"),
                     (["--draft", "2"], "give --prompt"),
                     (["--prompts-file", str(ROOT / "no-such-file.jsonl")], "no-such-file.jsonl"),
                     (["--prompts-file", str(lines), "--p-min", "2"], "--p-min"),  # the file's spec options
                     (["--prompt-ids", "1,2", "--temperature", "-1"], "--temperature")):  # a sampling value
        assert main(model + bad) == 2, bad
        assert msg in capsys.readouterr().err, bad
    serve = ["serve", "--model", str(ckpts["qwen3_5"]), "--pp", "2"]
    assert main(serve + ["--draft", "99"]) == 2 and "--draft must be in" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # serve's own parser: usage and exit code 2, as without --pp
        main(serve + ["--bogus"])
    # options a pipeline cannot honour were accepted and dropped in silence; a taken port was
    # found by the driver rank after the ranks had started; an odd environment variable was
    # each rank's error, unnamed ("could not convert string to float: 'abc'")
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(serve + ["--port", str(port)]) == 2
        assert "the address is in use" in capsys.readouterr().err
    for bad, msg in ((serve + ["--prefix-store-bytes", "1000"], "--prefix-store-bytes does not go with --pp"),
                     (model + ["--prompts-file", str(lines), "--lanes", "2", "--optimistic"],
                      "--optimistic does not go with --lanes")):
        assert main(bad) == 2, bad
        assert msg in capsys.readouterr().err, bad
    monkeypatch.setenv("HYSPEC_PP_TIMEOUT", "abc")
    assert main(model + ["--prompt-ids", "1,2"]) == 2
    assert "environment variable HYSPEC_PP_TIMEOUT='abc' is not a number" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["HYSPEC_PP_TIMEOUT", "HYSPEC_PP_JOIN_TIMEOUT"])
def test_a_huge_pipeline_timeout_is_refused_in_one_line(name, ckpts, monkeypatch, capsys):
    """A timeout of "forever" (1e10 s and up) passed the check and then failed in the ranks:
    torch's deadline in int64 nanoseconds and Python's thread waits overflow near 9.2e9 s
    (1e10: the join failed at once with torch's C++ traceback; 1e11: the ranks hung; 1e15 /
    1e300: an OverflowError traceback). Now the launch refuses it before starting any rank."""
    from hyspec import parallel
    from hyspec.cli.dispatch import main
    from hyspec.parallel.pipeline import MAX_TIMEOUT_S, env_number

    def no_launch(argv, world):
        raise AssertionError(f"ranks launched for {argv}")

    monkeypatch.setattr(parallel, "launch", no_launch)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(name, "1e15")
    assert main(["generate", "--model", str(ckpts["qwen3_5"]), "--pp", "2", "--prompt-ids", "1,2"]) == 2
    assert f"environment variable {name}='1e15' must be at most" in capsys.readouterr().err
    monkeypatch.setenv(name, f"{MAX_TIMEOUT_S:g}")  # the bound itself is taken
    assert env_number(name, 1.0) == MAX_TIMEOUT_S


def test_a_rank_whose_others_never_join_gives_up_in_one_line(ckpts):
    """RANK / WORLD_SIZE of a launch whose other ranks never start (a torchrun rank that failed
    before it joined, stale variables in a shell): the rank waited the one-year timeout meant
    for idle workers (with a short HYSPEC_PP_TIMEOUT: torch's traceback). Now joining has its
    own bound, HYSPEC_PP_JOIN_TIMEOUT, and ends in one line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "HYSPEC_PP_JOIN_TIMEOUT": "2"}
    r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--model", str(ckpts["qwen3_5"]),
                        "--prompt-ids", "1,2", "--pp", "2"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    assert "pipeline rank 0 of 2: the other ranks did not join" in r.stderr and "Traceback" not in r.stderr


def test_a_stage_that_cannot_load_is_named_at_start_up(ckpts, tmp_path):
    """A checkpoint whose first stage's layer is missing: `--pp 2` says which stage could not
    load and why, in one line, before decoding (it was a traceback: only the driver's own
    load error was reported, and a server started and answered 500s)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(ckpts["qwen3_5"], d)
    t = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("model.layers.0.")}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--model", str(d), "--prompt-ids", "1,2",
                        "--max-new-tokens", "2", "--pp", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    import re

    assert re.search(r"pipeline stage 0 \(layers 0\.\.\d+, rank 0\) could not load: checkpoint", r.stderr), r.stderr
    assert "missing tensor(s) 'model.layers.0." in r.stderr


def test_bench_pp2(tmp_path, capsys):
    # `hyspec bench --pp 2` run in this process (its stages are processes of their own; the
    # bench sets this process's torch threads, put back after)
    import torch

    from hyspec.cli.dispatch import main

    out = tmp_path / "pp.json"
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "--pp", "2", "--layers", "4", "--hidden", "64", "--batch", "2", "--new-tokens", "4",
                     "--prompt-len", "4", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    r = capsys.readouterr()
    assert code == 0, r.err
    rows = json.loads(out.read_text())["rows"]
    assert [x["mode"] for x in rows] == ["1 process", "--pp 2", "--pp 2 --lanes 2"]
    assert all(x["same_tokens"] for x in rows) and all(0 <= b <= 1 for x in rows[1:] for b in x["bubble"])
    assert "bubble" in r.out


def test_serve_pp2(ckpts):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    import signal
    import time

    path = ckpts["qwen3_5_moe"]
    ref = Engine(load_model(path, dtype="float32"))
    prompt = [3, 14, 15, 92, 65]
    want = ref.generate(prompt, max_new_tokens=10, draft=2, ignore_eos=True).tokens
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "hyspec.cli", "serve", "--pp", "2", "--model", str(path), "--port",
                          str(port), "--draft", "2", "--log-level", "warning"], cwd=ROOT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None, "server exited"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": path.name, "prompt": [prompt], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        # a prompt extending the first sequence: the pipeline keeps no prefix store (its driver
        # holds only its own layers' state), and /health says so
        longer = prompt + want + [7, 8]
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": path.name, "prompt": [longer], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == ref.generate(longer, max_new_tokens=4, draft=2,
                                                                   ignore_eos=True).tokens
        assert httpx.get(url + "/health", timeout=5).json()["prefix_store"] is None
    finally:
        os.killpg(p.pid, signal.SIGINT)  # (a terminal's Ctrl-C: every rank gets it)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130  # (a launcher passing its Ctrl-C on to uvicorn made it 0, after a traceback)


def test_lanes_with_the_optimistic_fork_are_refused_from_python(ckpts):
    """Engine.lanes > 1 with Engine.optimistic on the pipeline driver's Engine is a ValueError
    naming both, as `hyspec generate --lanes 2 --optimistic` is refused: the lanes ran without
    the fork in silence (a batch), or the fork without the lanes (one request)."""
    path = ckpts["qwen3_5"]
    for job in (("generate_batch", {"prompts": [P1, P2], "max_new_tokens": 4, "draft": 2, "lanes": 2,
                                    "optimistic": True}),
                ("generate", {"prompt": P1, "max_new_tokens": 4, "draft": 2, "lanes": 2, "optimistic": True})):
        with pytest.raises(RuntimeError, match=r"ValueError: Engine\.optimistic does not go with Engine\.lanes = 2"):
            run_jobs(path, [job], world=2)


def test_three_stages(ckpts):
    """A middle stage (receives from rank 0, sends to the driver) keeps the tokens too,
    also with the optimistic fork (forks run through both workers; hits and misses)."""
    path = ckpts["qwen3_next"]
    fork = ("generate", {"prompt": P1, "max_new_tokens": 17, "draft": 3, "ignore_eos": True, "optimistic": True,
                         "spec": SpecOptions(forced_rates=(1.0, 0.8, 0.7))})
    jobs = [JOBS[1], JOBS[2], JOBS[6], JOBS[7], fork]
    eng = Engine(load_model(path, dtype="float32"))
    assert run_jobs(path, jobs, world=3) == [run_job(eng, job) for job in jobs]


def test_ctrl_c_and_sigterm_to_the_launcher(ckpts, tmp_path):
    """Ctrl-C to a `--pp 2` launcher: the driver ends the command as one process does and rank
    0 prints what it printed (the launcher killed every rank at once: the finished lines and
    all else the driver printed were lost), exit 130; SIGTERM stops the ranks with a
    SIGTERM's exit (143, was 130 "interrupted"). No rank is left behind."""
    import signal
    import time

    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt_ids": [5, 6], "max_new_tokens": 1}\n{"prompt_ids": [7, 8], "max_new_tokens": 2000}\n')
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        out = tmp_path / f"out{code}.jsonl"
        p = subprocess.Popen([sys.executable, "-m", "hyspec.cli", "generate", "--pp", "2", "--model",
                              str(ckpts["qwen3_5"]), "--prompts-file", str(f), "--ignore-eos", "--max-batch", "1",
                              "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (out.exists() and out.read_text().count("\n") >= 1):  # line 1 done: line 2 decodes now
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.1)
            p.send_signal(sig)  # (the launcher alone, as `kill` does; a terminal's Ctrl-C reaches every rank)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode == code, err
        assert "Traceback" not in err and err.count("interrupted") == (code == 130), err
        if code == 130:  # what the driver printed reached rank 0
            assert "[pipeline: 2 stages" in err, err
        assert [json.loads(x)["line"] for x in out.read_text().splitlines()] == [1]
        r = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
        assert r.stdout.strip() == "", "a rank was left running"


def test_a_bench_rank_that_dies_is_named(monkeypatch, capsys):
    """`bench --pp 2` with a rank killed: one line naming it, the signal's exit code (it was a
    20-line ProcessExitedException traceback, exit 1)."""
    import torch.multiprocessing as mp

    from hyspec.cli.dispatch import main

    def killed(*a, **kw):
        raise mp.ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=1,
                                        exit_code=-9, signal_name="SIGKILL")

    monkeypatch.setattr(mp, "spawn", killed)
    assert main(["bench", "--pp", "2", "--layers", "2", "--hidden", "32", "--batch", "1", "--new-tokens", "2",
                 "--prompt-len", "2"]) == 137
    assert "pipeline rank 1 of 2 was killed by SIGKILL" in capsys.readouterr().err
