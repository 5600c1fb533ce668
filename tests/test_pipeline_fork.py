"""Optimistic fork on the pipeline (hyspec/parallel/fork.py, `--optimistic`): two gloo
processes on the CPU, forking on every round it can, give bitwise the tokens of one
process -- greedy and seeded sampling (rejection and coupled), plain and speculative,
the three rollback strategies, a mixed batch -- while forks both hit (the forced-
acceptance drafter at rate 1) and miss (low rates, the MTP drafter); the controller
pauses after 3 consecutive misses by the stated rule; the driver's and the worker's fork
counters agree."""

from __future__ import annotations

import pytest

from test_pipeline import P1, P2, P3, SAMPLED, coop_checkpoint

from hyspec.engine import Engine
from hyspec.loading import load_model
from hyspec.parallel.fork import ForkController, PendingFork, fork_fwd, is_hit
from hyspec.parallel.local import run_job, run_jobs
from hyspec.speculative.loop import SpecOptions

COUPLED = {"temperature": 0.9, "seed": 7, "mode": "coupled"}
OPT = {"optimistic": True, "ignore_eos": True}


def forced(rates, **kw) -> SpecOptions:
    return SpecOptions(forced_rates=tuple(rates), **kw)


def test_controller_rule():
    """3 consecutive misses pause forking for 4 rounds; a probe that misses pauses it
    again, twice as long (up to 64); a hit resets both."""
    c = ForkController()
    trace = []
    for outcome in "mmm" + "m" * 6 + "h" + "mmm":
        while not c.allow():
            trace.append("p")
        trace.append(outcome)
        c.resolve(outcome == "h")
    assert "".join(trace) == "mmm" + "pppp" + "m" + "p" * 8 + "m" + "p" * 16 + "m" + "p" * 32 + "m" + "p" * 64 \
        + "m" + "p" * 64 + "m" + "p" * 64 + "h" + "mmm"
    assert [c.allow() for _ in range(5)] == [False] * 4 + [True]  # after the hit: back to 4


def test_hit_rule():
    fwd = {"ids": [5, 6, 7], "sizes": [3], "seqs": [(1, 64, 10, True, "states", False)]}
    nxt = fork_fwd(fwd, [[8, 9]])
    assert nxt == {"ids": [8, 9], "sizes": [2], "seqs": [(1, 64, 13, True, "states", False)]}
    f = PendingFork(nxt, 2)
    assert is_hit(f, nxt, [("clear", 1), ("snap", 1, 4), ("restore", 2, 1)])  # other caches: anything
    assert not is_hit(f, nxt, [("keep", 1, 3, 2), ("snap", 1, 4)])  # round r was not fully accepted
    assert not is_hit(f, {**nxt, "ids": [8, 10]}, [])
    assert fork_fwd(fwd, [[8] * 60]) is None  # past the cache
    assert fork_fwd(fwd, [[8] * 52]) is None and fork_fwd(fwd, [[8] * 51])["seqs"][0][2] == 13  # 13 + 51 = 64 fits


def test_telemetry_counts_and_line():
    """ForkTelemetry.to_dict / summary_line: the hit rate is hits per fork issued (paused
    and no-guess rounds issue none), the trace keeps its first TRACE_MAX events."""
    from hyspec.parallel.fork import TRACE_MAX, ForkTelemetry

    t = ForkTelemetry()
    assert t.to_dict()["hit_rate"] == 0.0
    t.forks, t.hits, t.misses, t.paused, t.no_guess, t.trips, t.forked_rows, t.wasted_rows = 4, 3, 1, 8, 2, 1, 12, 3
    for c in "hm" + "p" * TRACE_MAX:
        t.event(c)
    d = t.to_dict()
    assert d["hit_rate"] == 0.75 and len(d["trace"]) == TRACE_MAX and d["trace"].startswith("hmp")
    assert t.summary_line() == ("[optimistic fork: 4 forks, 3 hits (75%), 1 misses, 8 rounds paused (1 pauses), "
                                "3 of 12 forked rows wasted]")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return coop_checkpoint("qwen3_5", tmp_path_factory.mktemp("fork"))


def test_fork_exact_and_telemetry(ckpt):
    eng = Engine(load_model(ckpt, dtype="float32"))
    plain_ref = eng.generate(P1, max_new_tokens=14, ignore_eos=True).tokens
    coupled_ref = eng.generate(P3, max_new_tokens=16, params=_p(COUPLED), ignore_eos=True).tokens
    jobs = {
        # plain: the reference (testing hook) as the guess -> hits; sampled -> prompt lookup, misses
        "plain_hits": ("generate", {"prompt": P1, "max_new_tokens": 14, "reference": plain_ref, **OPT}),
        "plain_sampled": ("generate", {"prompt": P2, "max_new_tokens": 8, "params": SAMPLED, **OPT}),
        # the MTP drafter (coop checkpoint: it agrees part of the time)
        "mtp_greedy": ("generate", {"prompt": P1, "max_new_tokens": 12, "draft": 3, **OPT}),
        "mtp_sampled": ("generate", {"prompt": P2, "max_new_tokens": 10, "draft": 2, "params": SAMPLED, **OPT}),
        # forced acceptance: rate 1 -> every fork hits; rescan rollback
        "forced_hits": ("generate", {"prompt": P1, "max_new_tokens": 17, "draft": 3,
                                     "spec": forced([1.0], rollback="rescan"), **OPT}),
        # coupled sampling follows its own reference token for token: hits and misses
        "coupled_mix": ("generate", {"prompt": P3, "max_new_tokens": 16, "draft": 2, "params": COUPLED,
                                     "reference": coupled_ref, "spec": forced([1.0, 1.0, 0.5]), **OPT}),
        "forced_mix": ("generate", {"prompt": P3, "max_new_tokens": 16, "draft": 3,
                                    "spec": forced([0.9, 0.8, 0.7, 0.6], adaptive=True), **OPT}),
        # replay rollback: its re-run of the kept rows is a pipelined forward between rounds
        "replay": ("generate", {"prompt": P2, "max_new_tokens": 12, "draft": 2,
                                "spec": forced([1.0, 0.6], rollback="replay"), **OPT}),
        "batch": ("generate_batch", {"prompts": [P1, P2], "max_new_tokens": [8, 9], "draft": [2, 0],
                                     "max_batch": 2, "optimistic": True}),
        # rate 0: every fork misses -> the controller's pauses (36 tokens: 35 rounds of one)
        "misses": ("generate", {"prompt": P1, "max_new_tokens": 36, "draft": 1, "spec": forced([0.0]), **OPT}),
    }
    seq = []
    for job in jobs.values():
        seq += [job, ("fork_stats", {})]
    want = [run_job(eng, j) for j in jobs.values()]
    got, st = run_jobs(ckpt, seq, world=2, with_stats=True)
    tel = dict(zip(jobs, got[1::2]))
    for name, w, g in zip(jobs, want, got[0::2]):
        assert g == w, name

    for name, t in tel.items():
        assert t["forks"] == t["hits"] + t["misses"] + t["dropped"], name
        assert t["forked_rows"] == t["hit_rows"] + t["wasted_rows"], name
        assert t["trace"].count("h") == t["hits"] and t["trace"].count("m") == t["misses"], name
        assert t["trace"].count("p") == t["paused"], name
    assert tel["plain_hits"]["hits"] == tel["plain_hits"]["forks"] == 12  # 14 tokens: 13 rounds, the last one can't fork
    assert tel["forced_hits"]["hits"] == tel["forced_hits"]["forks"] == 3  # 4 tokens a round: 1 + 4 x 4
    assert tel["forced_hits"]["hit_rows"] == 12 and tel["forced_hits"]["misses"] == 0
    for name in ("coupled_mix", "forced_mix", "replay"):
        assert tel[name]["hits"] > 0 and tel[name]["misses"] > 0, (name, tel[name])
    m = tel["misses"]
    # 35 rounds of one token: forks in rounds 1-3, 8 and 17; the last two rounds cannot fork
    assert m["trace"] == "mmm" + "pppp" + "m" + "p" * 8 + "m" + "p" * 16 + ".."
    assert (m["forks"], m["hits"], m["trips"], m["wasted_rows"]) == (5, 0, 3, 10)

    # the worker saw the same forks: it ran each one, served each hit, rolled back the rest
    w = st["workers"][0]["fork"]
    assert w["forks"] == sum(t["forks"] for t in tel.values())
    assert w["hits"] == sum(t["hits"] for t in tel.values())
    assert w["rollbacks"] == sum(t["misses"] + t["dropped"] for t in tel.values())
    assert 0 < w["wasted_s"] <= w["fork_s"]


def _p(d):
    from hyspec.sampling import SamplingParams

    return SamplingParams(**d)


def test_cli_optimistic(ckpt):
    """`hyspec generate --pp 2 --optimistic --json`: the single-process tokens, and the
    fork telemetry in stats["fork"]."""
    import json

    from test_pipeline import _cli

    eng = Engine(load_model(ckpt, dtype="float32"))
    want = eng.generate([1, 17, 42, 99, 7], max_new_tokens=10, draft=2, ignore_eos=True,
                        params=_p({"temperature": 0.7, "seed": 3})).tokens
    args = ["generate", "--model", str(ckpt), "--prompt-ids", "1,17,42,99,7", "--max-new-tokens", "10", "--draft", "2",
            "--temperature", "0.7", "--seed", "3", "--ignore-eos", "--json", "--pp", "2", "--optimistic"]
    out = json.loads(_cli(args).stdout)
    assert out["tokens"] == want
    f = out["stats"]["fork"]
    assert f["forks"] == f["hits"] + f["misses"] + f["dropped"] and f["forks"] > 0


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--new-tokens", "-1"), ("--prompt-len", "0")])
def test_bench_sizes_checked(flag, value, capsys):
    """`hyspec bench --pp 2 --optimistic` with a size out of range: one line naming the bench's
    own flag, exit 2, before any checkpoint or rank (--batch 0 was an IndexError traceback)."""
    from hyspec.cli.dispatch import main

    assert main(["bench", "--pp", "2", "--optimistic", "--layers", "2", "--hidden", "32", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"hyspec bench: error: {flag}: must be >= {1 if value == '0' else 0}, "
                                        f"got {value}"], err
