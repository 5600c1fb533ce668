"""The `hyspec` command line, driven in-process through hyspec.cli.main (stdout/stderr
captured with capsys) on tiny checkpoints written by `hyspec make-tiny`.

Contract checked: `generate` (text and --json: tokens / text / stats / samples),
`--draft K` == `--draft 0` under greedy decoding, `--num-samples`, `score --json`
(against a full forward), `make-tiny`, and the error paths: exit code 2 with a message
naming what is wrong (argparse errors exit 2 through SystemExit)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from hyspec.cli import main
from hyspec.engine import derive_seed
from hyspec.loading import load_model
from hyspec.speculative.loop import MAX_DRAFT
from hyspec.tokenizer import Tokenizer

VOCAB = 320  # >= 300: make-tiny writes a tokenizer.json
PROMPT = "def fibonacci(n):"


def _make_tiny(out, *extra: str) -> None:
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(out), "--vocab-size", str(VOCAB),
                 "--hidden-size", "32", "--layers", "4", "--seed", "1", *extra]) == 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    _make_tiny(out, "--init-std", "0.1")
    return out


@pytest.fixture(scope="module")
def ckpt_no_mtp(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny_no_mtp"
    _make_tiny(out, "--no-mtp")
    return out


def run_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(list(argv) + ["--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def gen(capsys, ckpt, *argv: str) -> dict:
    return run_json(capsys, "generate", "--model", str(ckpt), "--prompt", PROMPT, "--ignore-eos", *argv)


def run_error(capsys, *argv: str) -> str:
    """A failing command: exit code 2 (returned, or argparse's SystemExit); returns stderr."""
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    return capsys.readouterr().err


# --------------------------------------------------------------------------------------
# make-tiny
# --------------------------------------------------------------------------------------


def test_make_tiny_writes_a_loadable_checkpoint(ckpt, ckpt_no_mtp, capsys, tmp_path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    model = load_model(ckpt)
    assert model.has_mtp and model.cfg.vocab_size == VOCAB and model.cfg.num_hidden_layers == 4
    assert Tokenizer(ckpt).vocab_size <= VOCAB
    assert not load_model(ckpt_no_mtp).has_mtp
    capsys.readouterr()
    out = tmp_path / "small"
    assert main(["make-tiny", "--arch", "qwen3_next", "--out", str(out), "--vocab-size", "64",
                 "--hidden-size", "32", "--layers", "4"]) == 0
    assert str(out) in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists()  # vocab < 300: ids only
    assert load_model(out).cfg.vocab_size == 64


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------


def test_generate_json_fields(ckpt, capsys) -> None:
    d = gen(capsys, ckpt, "--max-new-tokens", "8")
    assert {"tokens", "text", "stats", "samples", "prompt_tokens", "stop_reason"} <= set(d)
    tok = Tokenizer(ckpt)
    assert len(d["tokens"]) == 8 and all(0 <= t < VOCAB for t in d["tokens"])
    assert d["text"] == tok.decode(d["tokens"])
    assert d["prompt_tokens"] == tok.encode(PROMPT)
    assert len(d["samples"]) == 1 and d["samples"][0]["stats"]["generated_tokens"] == 8
    assert {k: v for k, v in d["samples"][0].items() if k != "stats"} == \
        {"tokens": d["tokens"], "text": d["text"], "stop_reason": d["stop_reason"]}
    assert d["stop_reason"] == "length"
    assert d["stats"]["generated_tokens"] == 8 and d["stats"]["num_samples"] == 1
    assert "spec" not in d["stats"]


def test_generate_prompt_ids_and_text_output(ckpt, capsys) -> None:
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "5, 6,7", "--max-new-tokens", "4",
                 "--ignore-eos"]) == 0
    cap = capsys.readouterr()
    d = run_json(capsys, "generate", "--model", str(ckpt), "--prompt-ids", "5,6,7", "--max-new-tokens", "4",
                 "--ignore-eos")
    assert d["prompt_tokens"] == [5, 6, 7]
    assert cap.out.strip() == (Tokenizer(ckpt).decode([5, 6, 7]) + d["text"]).strip()  # prompt echoed first
    assert "4 tokens" in cap.err


def test_generate_logprobs_json_text_and_prompts_file(ckpt, capsys, tmp_path) -> None:
    """--logprobs N: --json has each token's log-probability and top N, equal to `score` of
    prompt + tokens (the reference's teacher-forced log-softmax); the text mode prints one
    table row per token; a --prompts-file line may set its own; a negative N is an error."""
    from hyspec.engine import Engine

    d = gen(capsys, ckpt, "--max-new-tokens", "5", "--draft", "2", "--logprobs", "3")
    ids = d["prompt_tokens"]
    sc = Engine.load(ckpt).score(ids + d["tokens"], top_logprobs=3)
    n = len(d["tokens"])
    assert d["logprobs"] == pytest.approx(sc["logprobs"][len(ids) - 1:], abs=1e-5)
    assert [[e[0] for e in top] for top in d["top_logprobs"]] == \
        [[e[0] for e in top] for top in sc["top_logprobs"][len(ids) - 1:]]
    assert d["samples"][0]["logprobs"] == d["logprobs"] and len(d["top_logprobs"]) == n
    assert "logprobs" not in gen(capsys, ckpt, "--max-new-tokens", "2")
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--ignore-eos", "--max-new-tokens", "5",
                 "--logprobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["pos", "token", "logprob"])
    assert [line.split()[0] for line in lines[head + 1:]] == [str(j) for j in range(1, 6)]
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt": PROMPT, "max_new_tokens": 3, "logprobs": 2}) + "\n"
                 + json.dumps({"prompt": PROMPT, "max_new_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(ckpt), "--prompts-file", str(f), "--out", str(out), "--ignore-eos"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["logprobs"] == pytest.approx(d["logprobs"][:3], abs=1e-6) and len(rows[0]["top_logprobs"][0]) == 2
    assert "logprobs" not in rows[1]
    assert "--logprobs must be >= 0" in run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x",
                                                  "--logprobs", "-1")


def test_generate_draft3_equals_draft0_greedy(ckpt, capsys) -> None:
    plain = gen(capsys, ckpt, "--max-new-tokens", "24")
    spec = gen(capsys, ckpt, "--max-new-tokens", "24", "--draft", "3")
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    st = spec["stats"]["spec"]
    assert st["rounds"] > 0 and st["drafted"] > 0
    for rollback in ("rescan", "replay"):
        assert gen(capsys, ckpt, "--max-new-tokens", "24", "--draft", "5", "--rollback", rollback)["tokens"] \
            == plain["tokens"]


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_in_generate_writes_what_was_made_or_stops_at_once(ckpt, capsys, monkeypatch, presses) -> None:
    """A real SIGINT mid-generation (sent as the third round starts): one press ends the
    generation after that round and --json still prints the result, stop_reason "cancelled",
    its tokens a prefix of the uninterrupted run's (plain and speculative), exit 130 (was:
    nothing printed, "interrupted"); two presses stop at once (exit 130, no result). The SIGINT
    handler is the previous one afterwards."""
    import os
    import signal

    from hyspec.core import scheduler

    before = signal.getsignal(signal.SIGINT)
    assert before not in (signal.SIG_IGN, None)  # (tests/conftest.py restores a background run's)
    for draft in ("0", "3"):
        whole = gen(capsys, ckpt, "--max-new-tokens", "24", "--ignore-eos", "--draft", draft)
        run_round, calls = scheduler.run_round, [0]

        def pressing(*a, **k):
            calls[0] += 1
            if calls[0] == 3:
                for _ in range(presses):
                    os.kill(os.getpid(), signal.SIGINT)
            return run_round(*a, **k)

        monkeypatch.setattr(scheduler, "run_round", pressing)
        capsys.readouterr()
        assert main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-eos",
                     "--draft", draft, "--json"]) == 130
        monkeypatch.setattr(scheduler, "run_round", run_round)
        cap = capsys.readouterr()
        assert "interrupted" in cap.err and "Traceback" not in cap.err
        if presses == 2:
            assert cap.out == ""
            continue
        d = json.loads(cap.out)
        assert d["stop_reason"] == "cancelled" and 1 <= len(d["tokens"]) < 24
        assert d["tokens"] == whole["tokens"][:len(d["tokens"])]
        assert signal.getsignal(signal.SIGINT) is before


def test_generate_stop_ids_plain_and_speculative(ckpt, capsys) -> None:
    full = gen(capsys, ckpt, "--max-new-tokens", "24")["tokens"]
    stop = full[9]
    first = full.index(stop)
    for draft in ("0", "3"):
        d = gen(capsys, ckpt, "--max-new-tokens", "24", "--stop-ids", str(stop), "--draft", draft)
        assert d["tokens"] == full[: first + 1] and d["stop_reason"] == "eos", draft


def test_generate_num_samples_text_output(ckpt, capsys) -> None:
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--ignore-eos", "--max-new-tokens", "4",
                 "--num-samples", "2", "--temperature", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- sample 0 ---" in out and "--- sample 1 ---" in out


def test_generate_num_samples(ckpt, capsys) -> None:
    d = gen(capsys, ckpt, "--max-new-tokens", "10", "--num-samples", "3", "--temperature", "1", "--seed", "5")
    samples = d["samples"]
    assert len(samples) == 3
    for s in samples:
        assert set(s) >= {"tokens", "text"} and len(s["tokens"]) == 10
        assert isinstance(s["text"], str)
    assert d["tokens"] == samples[0]["tokens"]
    assert len({tuple(s["tokens"]) for s in samples}) == 3  # independent completions
    assert d["stats"]["num_samples"] == 3 and d["stats"]["generated_tokens"] == 30
    # sample 0 is the --seed 5 run, sample i the run with the derived seed
    one = gen(capsys, ckpt, "--max-new-tokens", "10", "--temperature", "1", "--seed", "5")
    assert one["tokens"] == samples[0]["tokens"]
    two = gen(capsys, ckpt, "--max-new-tokens", "10", "--temperature", "1", "--seed", str(derive_seed(5, 2)))
    assert two["tokens"] == samples[2]["tokens"]
    # same command, same output
    again = gen(capsys, ckpt, "--max-new-tokens", "10", "--num-samples", "3", "--temperature", "1", "--seed", "5")
    assert [(s["tokens"], s["text"]) for s in again["samples"]] == [(s["tokens"], s["text"]) for s in samples]


def test_generate_coupled_draft_equals_plain(ckpt, capsys) -> None:
    args = ["--max-new-tokens", "16", "--num-samples", "2", "--temperature", "1", "--top-k", "20",
            "--repetition-penalty", "1.2", "--seed", "9", "--sampling-mode", "coupled"]
    plain = gen(capsys, ckpt, *args)
    spec = gen(capsys, ckpt, *args, "--draft", "4")
    assert [s["tokens"] for s in spec["samples"]] == [s["tokens"] for s in plain["samples"]]


def test_generate_logit_bias_flag(ckpt, capsys) -> None:
    """--logit-bias ID:BIAS,...: greedy leaves a -100 token out, speculative == plain; a
    malformed or out-of-range value is one line naming the flag, exit 2."""
    first = gen(capsys, ckpt, "--max-new-tokens", "1")["samples"][0]["tokens"][0]
    args = ["--max-new-tokens", "12", "--logit-bias", f"{first}:-100,7:1.5"]
    plain, spec = gen(capsys, ckpt, *args), gen(capsys, ckpt, *args, "--draft", "3")
    assert plain["samples"][0]["tokens"] == spec["samples"][0]["tokens"]
    assert first not in plain["samples"][0]["tokens"]
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt", PROMPT, "--logit-bias", "42")
    assert "--logit-bias" in err and "ID:BIAS" in err and "Traceback" not in err
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt", PROMPT, "--logit-bias", "42:500")
    assert "--logit-bias" in err and "[-100, 100]" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------
# score
# --------------------------------------------------------------------------------------


def test_score_json_matches_full_forward(ckpt, capsys) -> None:
    ids = [5, 17, 200, 3, 99, 42, 7, 250]
    d = run_json(capsys, "score", "--model", str(ckpt), "--ids", ",".join(map(str, ids)), "--top-logprobs", "4")
    assert {"tokens", "logprobs", "top_logprobs", "nll", "perplexity"} <= set(d)
    n = len(ids)
    assert d["tokens"] == ids
    assert len(d["logprobs"]) == n - 1
    assert len(d["top_logprobs"]) == n - 1 and all(len(row) == 4 for row in d["top_logprobs"])
    model = load_model(ckpt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(ids)).double(), dim=-1)  # [n, V]
    expect = [float(logp[i, ids[i + 1]]) for i in range(n - 1)]
    assert d["logprobs"] == pytest.approx(expect, abs=1e-5)
    for i, row in enumerate(d["top_logprobs"]):
        v, idx = torch.topk(logp[i], 4)
        assert [e[0] for e in row] == idx.tolist()
        assert [e[1] for e in row] == pytest.approx(v.tolist(), abs=1e-5)
        assert all(isinstance(e[2], str) for e in row)  # decoded token text (tokenizer present)
    assert d["nll"] == pytest.approx(-sum(expect), abs=1e-4)
    assert d["perplexity"] == pytest.approx(math.exp(-sum(expect) / (n - 1)), rel=1e-5)


def test_score_text(ckpt, capsys) -> None:
    d = run_json(capsys, "score", "--model", str(ckpt), "--text", PROMPT)
    assert d["tokens"] == Tokenizer(ckpt).encode(PROMPT)
    assert len(d["logprobs"]) == len(d["tokens"]) - 1 and d["top_logprobs"] is None
    capsys.readouterr()
    assert main(["score", "--model", str(ckpt), "--text", PROMPT]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "perplexity" in out[-1]
    # each scored token's log-probability, as the command says (it printed the summary alone
    # unless --top-logprobs was given); --summary: that line alone
    assert out[0].split() == ["pos", "token", "logprob"] and len(out) == len(d["tokens"]) + 1, out
    assert [float(line.split()[-1]) for line in out[1:-1]] == [round(v, 3) for v in d["logprobs"]]
    assert main(["score", "--model", str(ckpt), "--text", PROMPT, "--summary"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == out[-1:]
    assert "--top-logprobs does not go with it" in run_error(capsys, "score", "--model", str(ckpt), "--text", PROMPT,
                                                             "--summary", "--top-logprobs", "2")


def test_score_summary_labels_units(ckpt, capsys) -> None:
    """The plain summary line said "11 tokens  NLL 30.497  mean 2.7724" for a 12-token text:
    the count is of scored tokens (the first has no context) and the NLL is in nats."""
    d = run_json(capsys, "score", "--model", str(ckpt), "--text", PROMPT)
    n = len(d["tokens"])
    capsys.readouterr()
    assert main(["score", "--model", str(ckpt), "--text", PROMPT]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"{n - 1} of {n} tokens scored  NLL "), last
    assert " nats  mean " in last and " nats/token  perplexity " in last, last


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [MAX_DRAFT + 1, -1])
def test_draft_out_of_range(ckpt, capsys, k) -> None:
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--draft", str(k))
    assert f"0..{MAX_DRAFT}" in err and "--draft" in err


def test_draft_without_mtp_head(ckpt_no_mtp, capsys) -> None:
    err = run_error(capsys, "generate", "--model", str(ckpt_no_mtp), "--prompt-ids", "1,2", "--draft", "3")
    assert "MTP" in err and "--draft 0" in err
    # plain decoding still works on it
    d = run_json(capsys, "generate", "--model", str(ckpt_no_mtp), "--prompt-ids", "1,2", "--max-new-tokens", "3",
                 "--ignore-eos")
    assert len(d["tokens"]) == 3


def test_bad_prompt_ids_is_an_argparse_error(ckpt, capsys) -> None:
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt-ids", "1,x")
    assert "comma-separated token ids" in err and "'1,x'" in err
    # one line, as every user error (README), not argparse's usage block first
    assert err.startswith("hyspec generate: error: argument --prompt-ids") and err.strip().count("\n") == 0, err


def test_unknown_dtype_rejected(ckpt, capsys) -> None:
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt-ids", "1", "--dtype", "float8")
    assert "float8" in err and "invalid choice" in err


def test_prompt_id_out_of_vocabulary(ckpt, capsys) -> None:
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt-ids", f"1,{VOCAB + 7}")
    assert str(VOCAB + 7) in err and str(VOCAB) in err
    for stream in ([], ["--no-stream"]):  # a negative id: the same error before the printer decodes the prompt
        err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt-ids=1,-1", *stream)
        assert "[-1] out of range" in err and "Traceback" not in err
    err = run_error(capsys, "score", "--model", str(ckpt), "--ids", f"1,2,{VOCAB}")
    assert str(VOCAB) in err


@pytest.mark.parametrize("argv,needle", [
    (["--num-samples", "0"], "--num-samples"),
    (["--forced-rates", "0.9"], "--draft"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
], ids=["num_samples", "forced_without_draft", "temperature", "top_p"])
def test_bad_generate_options(ckpt, capsys, argv, needle) -> None:
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt-ids", "1,2", *argv)
    assert needle in err


def test_prompts_file_and_option_errors_name_the_problem(ckpt, tmp_path, capsys) -> None:
    """Bad --prompts-file lines are errors naming file:line (ids checked against the
    vocabulary before anything runs); options that do not apply are errors, not ignored."""
    f = tmp_path / "p.jsonl"
    for line, needle in (('{"prompt_ids": "abc"}', '"prompt_ids" must be a non-empty list'),
                         ('{"prompt": 5}', '"prompt" must be a non-empty string'),
                         ('{"prompt": ""}', '"prompt" must be a non-empty string'),
                         ('{"prompt": "x", "draft": 99}', "draft must be in 0..16"),
                         ('{"prompt_ids": [1, -3]}', "[-3] out of range")):
        f.write_text('{"prompt": "ok"}\n' + line + "\n")
        err = run_error(capsys, "generate", "--model", str(ckpt), "--prompts-file", str(f))
        assert f"{f}:2: " in err and needle in err, (line, err)
    f.write_text('{"prompt": "ok"}\n')
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompts-file", str(f), "--num-samples", "2")
    assert "--num-samples" in err
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x", "--out", str(tmp_path / "o.json"))
    assert "--out" in err and "--prompts-file" in err
    # the speculative flags are checked without --draft too, and --adaptive-floor above K is an error, not clamped
    assert "--p-min" in run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x", "--p-min", "2")
    assert "--adaptive-floor: must be in 1..k=3" in run_error(capsys, "generate", "--model", str(ckpt), "--prompt",
                                                                "x", "--draft", "3", "--adaptive-floor", "5")
    for flag in ("--pp", "--lanes"):
        assert f"{flag} must be >= 1" in run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x", flag, "0")
    assert "--init-std must be a positive number" in run_error(capsys, "make-tiny", "--arch", "qwen3_5", "--out",
                                                                str(tmp_path / "t"), "--init-std", "-1")


def test_missing_prompt_and_missing_model(ckpt, tmp_path, capsys) -> None:
    assert "--prompt" in run_error(capsys, "generate", "--model", str(ckpt))
    assert str(tmp_path / "nope") in run_error(capsys, "generate", "--model", str(tmp_path / "nope"),
                                               "--prompt-ids", "1")


def test_same_seed_same_output_rejection_mode(ckpt, capsys) -> None:
    args = ["--max-new-tokens", "12", "--temperature", "1", "--top-p", "0.9", "--seed", "3"]
    for draft in ("0", "3"):
        a = gen(capsys, ckpt, *args, "--draft", draft)
        b = gen(capsys, ckpt, *args, "--draft", draft)
        assert a["tokens"] == b["tokens"] and a["text"] == b["text"]


def test_forced_rates_with_rejection_sampling(ckpt, capsys) -> None:
    """--forced-rates with --temperature > 0 (rejection mode) must either work (a forced
    draft is a deterministic proposal: q = one-hot at the forced token is the lossless
    treatment) or be refused with exit code 2 and a message."""
    capsys.readouterr()
    rc = main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
               "--ignore-eos", "--draft", "3", "--forced-rates", "0.9", "--temperature", "1", "--json"])
    cap = capsys.readouterr()
    if rc == 0:
        assert len(json.loads(cap.out)["tokens"]) == 8
    else:
        assert rc == 2 and "forced" in cap.err


def test_bench_refuses_a_checkpoint_without_mtp_and_prints_no_ceiling_it_did_not_time(ckpt_no_mtp, tmp_path,
                                                                                     capsys) -> None:
    """A model without MTP head: one line naming it, not "1 part(s) failed". A run whose
    --verify-max is below K+1 says it has no ceiling (it printed x0.00). Bare `hyspec bench`
    on the CPU takes the tiny model (it built the 2.3 B bench model)."""
    err = run_error(capsys, "bench", "--model", str(ckpt_no_mtp), "--device", "cpu")
    assert "no MTP head" in err and "part(s) failed" not in err
    from hyspec.bench.cli import build_parser, resolve_device

    args = build_parser().parse_args(["--device", "cpu"])
    resolve_device(args)
    assert args.config == "tiny"
    rc = main(["bench", "--config", "tiny", "--prompt-len", "4", "--new-tokens", "4", "--ks", "2", "--verify-max", "1",
               "--reps", "1", "--exact-prompts", "0", "--hf-tokens", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "x0.00" not in out and "no ceiling: --verify-max 1 < K+1 = 3" in out and "ceil n/a" in out


def test_bench_cpu_smoke(tmp_path, capsys) -> None:
    """`hyspec bench` on CPU (tiny preset, the reference backend): runs end to end, writes the JSON
    with every section, and its speculative runs equal plain decoding."""
    out = tmp_path / "b.json"
    tuned = Path(__file__).resolve().parents[1] / "bench" / "results" / "qwen3.5-35b-a3b_h200_tuning.json"
    rc = main(["bench", "--config", "tiny", "--prompt-len", "8", "--new-tokens", "8", "--ks", "1,2",
               "--verify-max", "3", "--reps", "1", "--exact-prompts", "1", "--exact-tokens", "12",
               "--hf-tokens", "0", "--variants", "exact", "--out", str(out), "--tuned-from", str(tuned)])
    assert rc == 0
    r = json.loads(out.read_text())
    # the GPU kernels' configs of --tuned-from are not used on the CPU: not recorded as if they were
    assert "tuned_gemm" not in r and "tuned_moe_gemm" not in r
    ex = r["variants"]["exact"]
    assert r["copy_bandwidth_GBps"] > 0 and r["roofline_ms"] > 0 and not r["errors"]
    assert ex["plain"]["tok_s"] > 0 and set(ex["verify_ms"]) == {"1", "2", "3"}
    # the figures are what their names say: fractions of the roofline, verify relative to t = 1,
    # speed-up over plain, the cost model's ceiling L * t_decode / (t_verify(K+1) + K * t_draft)
    assert ex["plain"]["roofline_frac"] == pytest.approx(r["roofline_ms"] * ex["plain"]["tok_s"] / 1e3)
    assert ex["decode_step_roofline_frac"] == pytest.approx(r["roofline_ms"] / ex["decode_step_ms"])
    assert ex["verify_rel"]["3"] == pytest.approx(ex["verify_ms"]["3"] / ex["verify_ms"]["1"])
    for K in (1, 2):
        e = ex["spec"]["forced"][str(K)]
        ceiling = e["acceptance_length"] * ex["decode_step_ms"] / (ex["verify_ms"][str(K + 1)] + K * ex["draft_step_ms"])
        assert e["speedup"] == pytest.approx(e["tok_s"] / ex["plain"]["tok_s"]) and e["ceiling"] == pytest.approx(ceiling)
        assert e["ceiling_frac"] == pytest.approx(e["speedup"] / ceiling) and e["first_mismatch"] is None
    for kind in ("forced", "mtp"):
        for K in ("1", "2"):
            assert ex["spec"][kind][K]["tokens_equal_plain"], (kind, K)
    assert r["exactness"]["all_equal"]
    # coupled sampling: speculative == plain for each prompt, and the sampled run is not the greedy one
    assert r["exactness"]["coupled_all_equal"] and r["exactness"]["coupled"]["mode"] == "coupled"
    row = r["exactness"]["prompts"][0]
    assert row["coupled"]["forced"]["equal"] and row["coupled"]["mtp"]["equal"]
    assert r["targets"] == {}  # the GPU targets are not judged on the CPU
    assert "hyspec bench" in capsys.readouterr().out


def test_an_unknown_flag_is_the_commands_error(capsys):
    """`hyspec score --text x --text-file f`: the command's one-line error ("hyspec score:
    error: unrecognized arguments ..."; the top-level parser said "hyspec: error: ...")."""
    from hyspec.cli.dispatch import main

    for cmd, argv in (("score", ["--text", "x", "--text-file", "f"]), ("generate", ["--prompt", "x", "--bogus"])):
        with pytest.raises(SystemExit) as e:
            main([cmd, *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"hyspec {cmd}: error: unrecognized arguments: {argv[-2] if cmd == 'score' else '--bogus'}" in err


def test_make_tiny_refuses_a_checkpoint_that_is_not_small(tmp_path, capsys):
    """--layers 100000 ran for minutes building a 7.7 B-parameter model; a size below 1 is named."""
    from hyspec.cli.dispatch import main

    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(tmp_path / "a"), "--layers", "100000"]) == 2
    err = capsys.readouterr().err
    assert "make-tiny writes small test checkpoints" in err and "--layers" in err and not (tmp_path / "a").exists()
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(tmp_path / "b"), "--hidden-size", "0"]) == 2
    assert "--hidden-size must be >= 1, got 0" in capsys.readouterr().err
    # an earlier checkpoint in --out: a make-tiny one is replaced whole (its tokenizer stayed beside a new
    # checkpoint without one, and every text's ids were refused); another one's shards are refused (the
    # loader preferred their index: the old weights loaded under the new config)
    again = tmp_path / "again"
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(again)]) == 0
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(again), "--vocab-size", "200"]) == 0
    assert not (again / "tokenizer.json").exists()
    capsys.readouterr()
    held = tmp_path / "held"
    held.mkdir()
    (held / "model.safetensors.index.json").write_text("{}")
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(held)]) == 2
    assert "holds another checkpoint's shards (model.safetensors.index.json)" in capsys.readouterr().err
    assert sorted(p.name for p in held.iterdir()) == ["model.safetensors.index.json"]
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(tmp_path / "c"), "--fp8-block", "32,32"]) == 2
    assert "--fp8-block applies with --fp8" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_a_missing_extra_names_what_installs_it():
    """`hyspec serve` without the serve extra said only "No module named 'fastapi'"; the
    error now names the extra (as constrained decoding's already did for llguidance)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = None; from hyspec.cli.dispatch import main; "
            "sys.exit(main(['serve', '--port', '0']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "hyspec serve: error: import of fastapi halted; None in sys.modules (pip install 'hyspec[serve]', "
        "or from a checkout: pip install -e '.[serve]')"]


def test_version_and_python_dash_m():
    """`hyspec --version` was "the following arguments are required: cmd"; `python -m hyspec`
    was "No module named hyspec.__main__"."""
    import subprocess
    import sys

    import hyspec

    r = subprocess.run([sys.executable, "-m", "hyspec", "--version"], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, f"hyspec {hyspec.__version__}"), r.stderr


def test_bare_hyspec_names_the_missing_command(capsys):
    """A bare `hyspec` said "the following arguments are required: cmd" (the parser's internal
    name); it names a COMMAND, and the usage line shows where it goes."""
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "required: COMMAND" in err and "cmd" not in err, err


def test_bench_names_the_embedded_model_and_checks_model_first(tmp_path):
    """The README's `--model hyspec/default_model` worked from a checkout only (an installed
    package has no such relative path): `--config default` names the embedded model anywhere.
    A --model that is no directory was found after the header and the bandwidth measurement."""
    from hyspec.bench import cli as bench_cli
    from hyspec.engine import default_model_dir
    from hyspec.loading import CheckpointError

    parse = bench_cli.build_parser().parse_args
    args = parse(["--config", "default", "--device", "cpu"])
    bench_cli.resolve_device(args)
    assert args.model == str(default_model_dir())
    with pytest.raises(CheckpointError, match=f"model directory {tmp_path / 'none'} does not exist"):
        bench_cli.resolve_device(parse(["--model", str(tmp_path / "none"), "--device", "cpu"]))
    from hyspec.config import ConfigError  # (a directory without config.json: found at the load, after both)

    with pytest.raises(ConfigError, match=f"no config.json in {tmp_path}"):
        bench_cli.resolve_device(parse(["--model", str(tmp_path), "--device", "cpu"]))
    for extra in (["--model", str(tmp_path)], ["--fp8"]):
        with pytest.raises(ValueError, match=f"{extra[0]} does not go with it"):
            bench_cli.resolve_device(parse(["--config", "default", "--device", "cpu", *extra]))


def test_a_failed_part_of_the_batched_bench_fails_the_run(monkeypatch, capsys) -> None:
    """The GPU batched bench keeps going past a failed part (the invariance check, the sampled
    speed) and lists it in its own errors: those never reached the run's exit status (0) nor
    its closing error line."""
    from hyspec.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "run_batches", lambda *a, **k: {"rows": [], "errors": {
        "invariance": "AssertionError: lane 3 differs", "sampled": "RuntimeError: x"}})
    rc = main(["bench", "--config", "tiny", "--device", "cpu", "--prompt-len", "4", "--new-tokens", "4", "--ks", "1",
               "--reps", "1", "--exact-prompts", "0", "--hf-tokens", "0", "--batch", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "2 part(s) failed" in err and "batch/invariance: AssertionError: lane 3 differs" in err


def test_bench_with_no_variant_runs_the_batches_alone(tmp_path) -> None:
    """`--variants '' --batch ...` (the documented batched-only runs) still runs: only an empty
    --variants with nothing else asked for is refused."""
    out = tmp_path / "b.json"
    rc = main(["bench", "--config", "tiny", "--device", "cpu", "--variants", "", "--batch", "1,2", "--prompt-len", "4",
               "--new-tokens", "4", "--hf-tokens", "0", "--exact-prompts", "0", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["variants"] == {} and not r["errors"] and r["batch"]["backend"]


def test_make_tiny_keeps_other_checkpoints_and_paths_expand_the_home(tmp_path, capsys, monkeypatch):
    """make-tiny replaced any single-file checkpoint in --out (a trained one's weights lost) and
    wrote its weights readable by their owner only; a --seed out of range was torch's
    "Overflow when unpacking long long", -1 the weights of 2**64 - 1; `--out=~/x` (the shell
    leaves that ~) wrote to ./~/x, and --model / --text-file / --prompts-file / generate's
    --out with a ~ were "does not exist"."""
    import os
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["make-tiny", "--arch", "qwen3_5", "--out=~/m", "--vocab-size", str(VOCAB)]) == 0
    assert (tmp_path / "m" / "config.json").is_file() and not (tmp_path / "~").exists()
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "m" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", "~/m", "--vocab-size", str(VOCAB)]) == 0  # its own
    trained = tmp_path / "trained"
    shutil.copytree(tmp_path / "m", trained)
    (trained / "make_tiny.json").unlink()
    before = (trained / "model.safetensors").read_bytes()
    assert "holds a checkpoint (config.json, model.safetensors, tokenizer.json) without the make_tiny.json" in \
        run_error(capsys, "make-tiny", "--arch", "qwen3_5", "--out", str(trained))
    assert (trained / "model.safetensors").read_bytes() == before
    for seed in ("-1", str(2**64)):
        assert "--seed must be in 0..2**64 - 1" in run_error(capsys, "make-tiny", "--arch", "qwen3_5", "--out",
                                                            str(tmp_path / "s"), "--seed", seed)
    (tmp_path / "t.txt").write_text("def f(x):\n    return x\n" * 4)
    assert run_json(capsys, "score", "--model", "~/m", "--text", "ab")["scored_tokens"] >= 1
    assert run_json(capsys, "replay", "--model", "~/m", "--text-file", "~/t.txt", "--k", "2")["tokens"] > 4
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "ab"}) + "\n")
    capsys.readouterr()
    assert main(["generate", "--model", "~/m", "--prompts-file", "~/p.jsonl", "--out", "~/r.jsonl",
                 "--max-new-tokens", "2"]) == 0
    assert (tmp_path / "r.jsonl").read_text().count("\n") == 1


def test_score_and_replay_of_overflowing_models(tmp_path, capsys, monkeypatch):
    """A mean NLL above ~709 nats crashed `score` with OverflowError's traceback (replay
    printed exp(700) instead of inf); logits that overflow float16 were NaN log-probs and
    invalid JSON (NaN). The perplexity is now inf (null in --json), non-finite logits an
    error naming the dtype; replay reads the file's bytes as they are (a CRLF file's \\r:
    text mode dropped them) and standard input with "-"."""
    import io
    import sys

    out = tmp_path / "big"
    _make_tiny(out, "--init-std", "80")
    text = "hello world the quick brown fox"
    scored = run_json(capsys, "score", "--model", str(out), "--text", text)
    assert scored["perplexity"] is None and scored["mean_nll"] > 709
    capsys.readouterr()
    assert main(["score", "--model", str(out), "--text", text]) == 0
    assert "perplexity inf" in capsys.readouterr().out
    assert "are not finite (NaN or inf) from position 0 on, in float16" in run_error(
        capsys, "score", "--model", str(out), "--text", text, "--dtype", "float16")
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"def f(x):\r\n    return x\r\n" * 8)
    want = len(Tokenizer(out).encode(crlf.read_bytes().decode()))
    assert run_json(capsys, "replay", "--model", str(out), "--text-file", str(crlf), "--k", "2")["tokens"] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(crlf.read_bytes())))
    report = run_json(capsys, "replay", "--model", str(out), "--text-file", "-", "--k", "2")
    assert report["tokens"] == want and report["perplexity"] is None


def test_replay_of_a_closed_standard_input_is_one_line(ckpt, capsys, monkeypatch):
    """`hyspec replay --text-file - <&-` ended in AttributeError's traceback (sys.stdin is
    None there), after loading the model; it is now one line, as --prompts-file - says it."""
    import sys

    monkeypatch.setattr(sys, "stdin", None)
    assert "hyspec replay: error: --text-file -: standard input is closed" in run_error(
        capsys, "replay", "--model", str(ckpt), "--text-file", "-")


def test_a_constraint_file_that_is_not_utf8_is_named(ckpt, tmp_path, capsys):
    """A --grammar or --json-schema file that is not UTF-8 was "error: 'utf-8' codec can't
    decode byte 0xff in position 0" (neither the flag nor the file named)."""
    pytest.importorskip("llguidance")
    bad = tmp_path / "bad.lark"
    bad.write_bytes(b"\xffstart: \"a\"\n")
    for flag in ("--grammar", "--json-schema"):
        err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x", flag, str(bad))
        assert f"{flag}: '{bad}' is not UTF-8 text (invalid start byte at byte 1)" in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_bench_results_that_cannot_be_written_name_the_out_path():
    """--out on a full disk: the error was "[Errno 28] No space left on device", no file named."""
    from hyspec.bench.report import write_json

    with pytest.raises(OSError, match=r"^--out /dev/full: cannot write the results \(No space left on device\)"):
        write_json("/dev/full", {"a": 1})


def test_bench_results_are_replaced_whole(tmp_path, monkeypatch):
    """--out is written after each part of a run: a write that failed part-way (a full disk, a
    Ctrl-C) left a truncated JSON in place of the last part's whole one."""
    from hyspec.bench.report import write_json

    import builtins

    import hyspec.files

    out = tmp_path / "r.json"
    write_json(str(out), {"part": 1})

    class Half:  # a file whose write puts half the bytes down, then finds the disk full
        def __init__(self, f):
            self.f = f

        def write(self, b):
            self.f.write(b[: len(b) // 2])
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(hyspec.files, "open", lambda *a, **kw: Half(builtins.open(*a, **kw)), raising=False)
    with pytest.raises(OSError, match="cannot write the results"):
        write_json(str(out), {"part": 2, "figures": list(range(100))})
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"part": 1} and [f.name for f in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc's fd links")
def test_bench_results_to_dev_stdout_are_written_to_it(tmp_path):
    """--out /dev/stdout was resolved like a link to a file: into a pipe it was "cannot write
    the results (No such file or directory)" (/proc/PID/fd/pipe:[N]); into a file (`> r.json`)
    it replaced the file, and the next part's results went to a new file "r.json (deleted)"."""
    import subprocess
    import sys

    code = ("from hyspec.bench.report import write_json; write_json('/dev/stdout', {'part': 1}); "
            "write_json('/dev/stdout', {'part': 2})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.endswith('"part": 2\n}'), r.stderr
    with open(tmp_path / "r.json", "w") as out:
        r = subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "r.json").read_text()) == {"part": 2} and os.listdir(tmp_path) == ["r.json"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_files_written_on_a_full_disk_are_named_in_one_line(ckpt, tmp_path, capsys, monkeypatch):
    """make-tiny on a full disk ended in safetensors' SafetensorError traceback; generate --out
    in "error: [Errno 28] No space left on device", no file named."""
    import safetensors
    import safetensors.torch

    def full(tensors, filename, metadata=None):  # (its error on a full disk, as safetensors 0.8 words it)
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "t"
    err = run_error(capsys, "make-tiny", "--arch", "qwen3_5", "--out", str(out))
    assert f"hyspec make-tiny: error: cannot write {out / 'model.safetensors'}: No space left on device (os error 28)" in err
    monkeypatch.undo()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x", "max_new_tokens": 2}\n')
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompts-file", str(prompts), "--out", "/dev/full")
    assert err.strip().splitlines()[-1] == "hyspec generate: error: --out /dev/full: cannot write it (No space left " \
                                           "on device)", err
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # (written to as it is: never replaced by a file)


def test_make_tiny_names_a_tokenizer_json_it_cannot_write(tmp_path, capsys, monkeypatch):
    """The weights fitting on a nearly full disk and tokenizer.json not: tokenizers' error is a
    bare Exception ("No space left on device (os error 28)"), and make-tiny ended in its traceback."""
    from hyspec import tiny

    class Full:
        def save(self, path):  # (tokenizers' own error on a full disk, as it words it)
            raise Exception("No space left on device (os error 28)")  # noqa: TRY002

    monkeypatch.setattr(tiny, "tiny_tokenizer", lambda vocab_size: Full())
    out = tmp_path / "t"
    err = run_error(capsys, "make-tiny", "--arch", "qwen3_5", "--out", str(out))
    assert f"hyspec make-tiny: error: cannot write {out / 'tokenizer.json'}: No space left on device (os error 28)" \
        in err, err


@pytest.mark.parametrize("why", [KeyboardInterrupt, BrokenPipeError])
def test_an_interrupted_bench_keeps_the_figures_measured_so_far(monkeypatch, tmp_path, why):
    """Ctrl-C during a bench run: --out was written only after a whole part finished, so a run
    stopped later left no file although figures had been printed. The same when the reader of
    its output goes away (`hyspec bench ... --out F | head`: no file at all)."""
    from hyspec.bench import cli as bench_cli

    def stop(*a, **k):
        raise why

    monkeypatch.setattr(bench_cli, "make_model", stop)
    out = tmp_path / "r.json"
    with pytest.raises(why):
        bench_cli.main(["--config", "tiny", "--device", "cpu", "--copy-bytes", "1048576", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["interrupted"] is True and got["copy_bandwidth_GBps"] > 0 and "git" in got["meta"]


def test_id_and_rate_lists_parse_as_the_help_says(tmp_path) -> None:
    """--prompt-ids / --stop-ids take a trailing comma ("1,2," as a pasted list ends) and
    spaces; --forced-rates takes the whole closed range [0, 1] (rate 0: every draft
    rejected, the forced drafter's other end); values outside it are refused."""
    import argparse

    from hyspec.cli.common import parse_ids, parse_rates

    assert parse_ids("1, 2,3,") == [1, 2, 3] and parse_ids("") == []
    for bad in ("1,,2", "1,x", ",2"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated token ids"):
            parse_ids(bad)
    assert parse_rates("0,0.5,1") == (0.0, 0.5, 1.0)
    for bad in ("1.5", "-0.1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"rates in \[0, 1\]"):
            parse_rates(bad)


def test_spec_flags_without_a_draft_are_checked_against_the_largest_k(ckpt, capsys) -> None:
    """Without --draft the speculative flags are checked against the largest K (MAX_DRAFT),
    not a small one: --adaptive-floor MAX_DRAFT runs plain decoding, one more is refused."""
    out = gen(capsys, ckpt, "--max-new-tokens", "2", "--adaptive-floor", str(MAX_DRAFT))
    assert len(out["tokens"]) == 2
    err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x", "--adaptive-floor", str(MAX_DRAFT + 1))
    assert "--adaptive-floor" in err and f"1..k={MAX_DRAFT}" in err


def test_checking_out_leaves_no_file_behind(tmp_path) -> None:
    """check_out_file (--out checked before the work) opens the file to see that it can be
    written: a file it created is removed again (a run that fails later leaves no empty
    results file), an existing one keeps its bytes."""
    from hyspec.cli.common import check_out_file

    new = tmp_path / "new.jsonl"
    check_out_file(str(new))
    assert not new.exists()
    old = tmp_path / "old.jsonl"
    old.write_text("kept\n")
    check_out_file(str(old))
    assert old.read_text() == "kept\n"
    with pytest.raises(ValueError, match="is a directory"):
        check_out_file(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        check_out_file(str(tmp_path / "no" / "x.jsonl"))


def test_pipeline_only_flags_without_pp_are_errors(ckpt, capsys) -> None:
    """--optimistic and --lanes act only on pipeline stages: without --pp N >= 2 they are
    one-line errors naming --pp, not ignored in silence."""
    for flags, needle in ((["--optimistic"], "--optimistic forks pipeline stages: it needs --pp N"),
                          (["--lanes", "2"], "--lanes alternates batch groups through pipeline stages")):
        err = run_error(capsys, "generate", "--model", str(ckpt), "--prompt", "x", "--max-new-tokens", "1", *flags)
        assert err.startswith("hyspec generate: error: ") and needle in err, err


def test_score_table_rows_name_the_scored_tokens(ckpt, capsys) -> None:
    """Each row of the score table is the token scored there (the first token has no
    context: row 1 is the second token), and --top-logprobs above the vocabulary lists the
    whole vocabulary, as its header says ("top 320", not the number asked for)."""
    ids = [5, 17, 42, 99]
    capsys.readouterr()
    assert main(["score", "--model", str(ckpt), "--ids", ",".join(map(str, ids)), "--top-logprobs", "1000"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split()[-4:] == ["top", str(VOCAB), "(token", "logprob)"], out[0]
    tok = Tokenizer(ckpt)
    want = [repr(tok.decode([t])) for t in ids[1:]]
    assert [line[7:21].rstrip() for line in out[1:-1]] == [w if len(w) <= 14 else w[:13] + "~" for w in want], out
    assert [int(line.split()[0]) for line in out[1:-1]] == list(range(1, len(ids))), out  # (pos counts from 1)


def test_constraint_flags_reach_the_engine_whole(tmp_path) -> None:
    """constraint_from_args hands Engine.constraint each flag's whole value: every --choice
    option (comma-separated), a --json-schema file as a Path (its text is read by the
    library) and JSON text as is, --regex as given; no flag, no constraint."""
    import argparse

    from hyspec.cli.common import constraint_from_args

    class Eng:
        def constraint(self, kind, value=None, arg=None):
            return kind, value, arg

    def ns(**kw):
        return argparse.Namespace(**{"json_schema": None, "constrain_json": False, "regex": None, "grammar": None,
                                     "choice": None, **kw})

    assert constraint_from_args(Eng(), ns(choice="yes,no,maybe")) == ("choice", ["yes", "no", "maybe"], "--choice")
    assert constraint_from_args(Eng(), ns(choice="a b, c")) == ("choice", ["a b", " c"], "--choice")  # (as given)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    assert constraint_from_args(Eng(), ns(json_schema=str(schema))) == ("json_schema", schema, "--json-schema")
    assert constraint_from_args(Eng(), ns(json_schema=' {"type": "string"}')) == (
        "json_schema", ' {"type": "string"}', "--json-schema")
    assert constraint_from_args(Eng(), ns(regex="[ab]+")) == ("regex", "[ab]+", "--regex")
    assert constraint_from_args(Eng(), ns(constrain_json=True)) == ("json_object", None, "--constrain-json")
    assert constraint_from_args(Eng(), ns()) is None
    with pytest.raises(ValueError, match="neither JSON text nor an existing file"):
        constraint_from_args(Eng(), ns(json_schema=str(tmp_path / "missing.json")))


def test_every_form_of_a_failed_allocation_is_out_of_memory() -> None:
    """dispatch.out_of_memory: MemoryError, torch's OutOfMemoryError, the CPU allocator's
    RuntimeError and a RuntimeError saying "out of memory" in any case (a CUDA error raised as
    a plain RuntimeError, a kernel launcher's) are failed allocations (one error line); other
    RuntimeErrors are bugs (their traceback kept)."""
    from hyspec.cli.dispatch import out_of_memory

    class OutOfMemoryError(RuntimeError):
        pass

    for e in (MemoryError(), OutOfMemoryError("x"), RuntimeError("DefaultCPUAllocator: can't allocate memory"),
              RuntimeError("CUDA error: out of memory"), RuntimeError("Triton Error [CUDA]: Out of memory")):
        assert out_of_memory(e), e
    for e in (RuntimeError("shape '[2, 3]' is invalid"), ValueError("out of memory")):
        assert not out_of_memory(e), e


def test_a_file_error_names_the_file_without_errno() -> None:
    """An OSError reaching the entry point is "REASON: PATH" (its strerror and filename), not
    Python's "[Errno 13] Permission denied: 'PATH'"; one without a filename is its text."""
    from hyspec.cli.dispatch import error_message

    assert error_message(PermissionError(13, "Permission denied", "/data/t.txt")) == "Permission denied: /data/t.txt"
    assert error_message(OSError("disk on fire")) == "disk on fire"
    assert error_message(ValueError("--k must be >= 1, got 0")) == "--k must be >= 1, got 0"


def test_more_prompts_file_lines_that_are_refused_before_the_model_loads(ckpt, tmp_path, capsys) -> None:
    """Each of these lines is a one-line error naming FILE:LINE (not a traceback later, nor
    run with a value it did not ask for): no prompt at all, chat fields without "messages",
    a boolean where a count goes, a draft just past the largest K, two constraints."""
    f = tmp_path / "p.jsonl"
    for line, needle in (('{"max_new_tokens": 2}', 'give exactly one of "prompt", "prompt_ids" or "messages"'),
                         ('{"prompt": "x", "tools": []}', 'go with "messages"'),
                         ('{"prompt": "x", "max_new_tokens": true}', "max_new_tokens must be an integer >= 0"),
                         ('{"prompt": "x", "draft": false}', "draft must be an integer >= 0"),
                         (f'{{"prompt": "x", "draft": {MAX_DRAFT + 1}}}', f"draft must be in 0..{MAX_DRAFT}"),
                         ('{"prompt": "x", "logprobs": true}', "logprobs must be null or an integer >= 0"),
                         ('{"prompt": "x", "json_object": false}', '"json_object" must be true'),
                         ('{"prompt": "x", "regex": "a", "choice": ["a"]}', "one constraint per line")):
        f.write_text('{"prompt": "ok"}\n' + line + "\n")
        err = run_error(capsys, "generate", "--model", str(ckpt), "--prompts-file", str(f))
        assert err.startswith(f"hyspec generate: error: {f}:2: ") and needle in err, (line, err)


def test_replay_limits_and_json_output(ckpt, tmp_path, capsys) -> None:
    """replay: --max-tokens N replays exactly the first N tokens (N >= 2: one to draft from,
    one to check), --chunk must be >= 1, a text past the model's context (by one token) is
    an error pointing at --max-tokens, and --json prints the report alone (no progress bar on
    stderr)."""
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 400)
    replay = ["replay", "--model", str(ckpt), "--text-file", str(text), "--k", "2"]
    capsys.readouterr()
    assert main(replay + ["--max-tokens", "9", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["tokens"] == 9 and got.err == ""
    assert "--max-tokens: must be >= 2" in run_error(capsys, *replay, "--max-tokens", "1")
    assert "--chunk must be >= 1, got 0" in run_error(capsys, *replay, "--chunk", "0")
    ctx = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    err = run_error(capsys, *replay, "--max-tokens", str(ctx + 1))
    assert f"has {ctx + 1} tokens, more than the model's context of {ctx}" in err and f"--max-tokens {ctx}" in err


def test_prompts_file_rows_name_their_file_line_and_text_output_cuts_at_a_stop(ckpt, tmp_path, capsys) -> None:
    """--prompts-file results carry the line of the file each came from (blank lines count,
    as an editor numbers them) beside their index; and the text output of a run that ended at
    a --stop string is the prompt and the text before it (not every token generated)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_ids": [5, 6], "max_new_tokens": 1}\n\n{"prompt_ids": [7], "max_new_tokens": 1}\n')
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompts-file", str(f)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["index"], r["line"]) for r in rows] == [(0, 1), (1, 3)]
    full = gen(capsys, ckpt, "--max-new-tokens", "12")
    stop = full["text"][4:6]
    d = gen(capsys, ckpt, "--max-new-tokens", "12", "--stop", stop)
    assert d["stop_reason"] == "stop" and d["text"] == full["text"][: full["text"].index(stop)]
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--ignore-eos", "--max-new-tokens", "12",
                 "--stop", stop]) == 0
    assert capsys.readouterr().out == PROMPT + d["text"] + "\n"


def test_several_samples_print_as_with_no_stream(ckpt, capsys) -> None:
    """--num-samples N decodes the samples together (their tokens interleave): the text
    output is each sample whole under its header, the same with and without --no-stream."""
    argv = ["generate", "--model", str(ckpt), "--prompt", PROMPT, "--ignore-eos", "--max-new-tokens", "10",
            "--num-samples", "2", "--temperature", "1", "--seed", "4"]
    outs = []
    for extra in ([], ["--no-stream"]):
        capsys.readouterr()
        assert main(argv + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("--- sample 0 ---\n" + PROMPT) and "--- sample 1 ---" in outs[0]


def test_streamed_text_equals_the_text_printed_at_the_end(ckpt, capsys) -> None:
    """The streamed text (decoded again as tokens arrive; a character whose bytes span
    several tokens waits for the rest) is exactly the text --no-stream prints at the end."""
    outs = []
    for extra in ([], ["--no-stream"]):
        for seed in ("1", "2", "3"):
            capsys.readouterr()
            assert main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--ignore-eos", "--max-new-tokens",
                         "40", "--temperature", "1", "--seed", seed, *extra]) == 0
            outs.append(capsys.readouterr().out)
    assert outs[:3] == outs[3:]


def test_bench_lists_and_tuned_files_are_checked_as_documented(tmp_path) -> None:
    """--ks above the largest draft is refused; --tuned-from takes a file of dense configs
    alone (a --tune-only dense run's) and refuses one whose entries are malformed."""
    from hyspec.bench.cli import _int_list, read_tuned
    from hyspec.speculative.loop import MAX_DRAFT

    assert _int_list("ks", f"1,{MAX_DRAFT}", 1, MAX_DRAFT) == [1, MAX_DRAFT]
    with pytest.raises(ValueError, match=f"--ks: expected comma-separated integers in 1..{MAX_DRAFT}"):
        _int_list("ks", f"{MAX_DRAFT + 1}", 1, MAX_DRAFT)
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"tuned_gemm": {"2048x2048": {"config": [64, 64, 4]}}}))
    assert read_tuned(str(dense))["tuned_gemm"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tuned_gemm": {"2048x2048": {"cfg": 1}}}))
    with pytest.raises(ValueError, match="a GEMM config entry is malformed"):
        read_tuned(str(bad))


def test_bench_exactness_check_compares_each_prompt_and_each_drafter() -> None:
    """The exactness check runs a different prompt each time and reports all_equal only when
    every drafter of every prompt equals plain (a decoder whose MTP runs differ on one prompt)."""
    import argparse
    import types

    from hyspec.bench.variants import exactness_check

    prompts = []

    class Fake:
        kind = "fake"

        def run(self, prompt, n, k=0, forced_rates=None, reference=None, params=None):
            prompts.append(tuple(prompt))
            bad = k and forced_rates is None and len(set(map(tuple, prompts))) == 2  # MTP on the 2nd prompt
            toks = [1] * n if not bad else [1] * (n - 1) + [2]
            return types.SimpleNamespace(tokens=toks, stats={"decode_tok_s": 1.0, "spec": {"acceptance_length": 1.0}})

    model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=1000))
    args = argparse.Namespace(exact_tokens=4, exact_prompts=3, prompt_len=6, forced="0.9", exact_coupled=False)
    r = exactness_check(model, args, torch.device("cpu"), Fake())
    assert len(set(prompts)) == 3 and [p["mtp"]["equal"] for p in r["prompts"]] == [True, False, True]
    assert r["prompts"][1]["mtp"]["first_mismatch"] == 3 and r["prompts"][1]["forced"]["equal"]
    assert r["all_equal"] is False


def test_bench_timing_and_bandwidth_figures(monkeypatch) -> None:
    """time_fn on the CPU: ms per call of `reps` calls after the warm-up; copy_bandwidth counts
    the bytes read and written."""
    import time

    from hyspec.bench import timing

    calls = []
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    assert timing.time_fn(lambda: calls.append(1), torch.device("cpu"), reps=5, warmup=2) == pytest.approx(100.0)
    assert len(calls) == 7
    monkeypatch.undo()
    monkeypatch.setattr(timing, "time_fn", lambda fn, dev, reps, warmup=2: 1.0)  # 1 ms per copy
    assert timing.copy_bandwidth(torch.device("cpu"), 1 << 20) == pytest.approx(2 * (1 << 20) / 1e-3 / 1e9)


def test_bench_models_take_fp8_seed_and_state_dtype() -> None:
    """make_model: --fp8 keeps block-FP8 weights, --seed picks the random weights, --ssm-dtype
    the state's storage dtype (in-memory models as the presets)."""
    import argparse

    from hyspec.bench.models import make_model
    from hyspec.quant import FP8_DTYPE

    def build(**kw):
        a = dict(model=None, config="tiny", fp8=False, seed=0, ssm_dtype=None)
        a.update(kw)
        return make_model(argparse.Namespace(**a), torch.device("cpu"), torch.bfloat16)

    base = build()
    w = "model.layers.0.linear_attn.out_proj.weight"
    assert FP8_DTYPE in {p.dtype for p in build(fp8=True).parameters()} and base.state_dict()[w].dtype == torch.bfloat16
    assert torch.equal(build().state_dict()[w], base.state_dict()[w])
    assert not torch.equal(build(seed=1).state_dict()[w], base.state_dict()[w])
    assert build(ssm_dtype="bfloat16").cfg.mamba_ssm_dtype == "bfloat16" and base.cfg.mamba_ssm_dtype is None
