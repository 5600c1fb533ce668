"""Fast CPU tests for hyspec.train.train: the batched training forward equals HybridLM's
per-sequence forward (target and MTP heads), a few steps reduce the loss, and the written
checkpoint loads with hyspec.loading.load_model at the computed size."""

from __future__ import annotations

import json
import lzma
import struct
from pathlib import Path

import pytest
import torch

from hyspec.config import ModelConfig
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.tiny import init_weights, tiny_config
from hyspec.train import train as tr

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer" / "tokenizer.json"
TINY_ARCH = dict(hidden=64, layers=4, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                 lin_k_heads=2, lin_v_heads=4, lin_head_dim=16, conv=4, full_every=4)


def _tiny_model(tied: bool, seed: int = 0) -> HybridLM:
    d = tiny_config("qwen3_5", vocab_size=256, hidden=64, layers=4)
    d["tie_word_embeddings"] = tied
    torch.manual_seed(seed)
    model = HybridLM(ModelConfig.from_dict(d))
    init_weights(model, torch.Generator().manual_seed(seed), std=0.1)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_batched_forward_matches_hybridlm(tied):
    model = _tiny_model(tied)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 70), generator=g)  # 70: not a multiple of the 64-row chunk
    with torch.no_grad():
        h = tr.batched_hidden(model, ids, use_fla=False)
        logits = tr.batched_logits(model, h)
        hm = tr.batched_mtp_hidden(model, ids[:, 1:], h[:, :-1], use_fla=False)
        mtp_logits = tr.batched_logits(model, hm)
        assert logits.std() > 0.1  # the comparison is not trivially small numbers
        for b in range(ids.shape[0]):
            ref = model(ids[b])
            torch.testing.assert_close(logits[b], ref, atol=1e-4, rtol=1e-4)
            h_ref = model.forward_hidden(ids[b], None, StepCtx(chunked=True))
            m_ref = model.logits(model.mtp_hidden(ids[b, 1:], h_ref[:-1], StepCtx(start=0), None))
            torch.testing.assert_close(mtp_logits[b], m_ref, atol=1e-4, rtol=1e-4)


def test_loss_fn_pairs_rows_like_inference():
    model = _tiny_model(True)
    win = torch.randint(0, 256, (2, 34), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        o = tr.loss_fn(model, win, mtp_weight=0.5, use_fla=False)
        T = 32
        ref_main, ref_mtp = 0.0, 0.0
        for b in range(2):
            h = model.forward_hidden(win[b, :T], None, StepCtx(chunked=True))
            lg = model.logits(h)
            ref_main += torch.nn.functional.cross_entropy(lg, win[b, 1:T + 1]).item() / 2
            ml = model.logits(model.mtp_hidden(win[b, 1:T + 1], h, StepCtx(start=0), None))
            ref_mtp += torch.nn.functional.cross_entropy(ml, win[b, 2:T + 2]).item() / 2
    assert abs(o["main"].item() - ref_main) < 1e-4
    assert abs(o["mtp"].item() - ref_mtp) < 1e-4
    assert abs(o["loss"].item() - (ref_main + 0.5 * ref_mtp)) < 1e-4


def test_default_config_fits_budget():
    cfg = tr.default_config(4096)
    mc = ModelConfig.from_dict(cfg)
    assert mc.model_type == "qwen3_5_text" and mc.tie_word_embeddings and mc.mtp_num_hidden_layers == 1
    assert mc.max_position_embeddings >= 2048 and mc.eos_token_ids == (0,)
    assert mc.layer_types == tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                   for i in range(mc.num_hidden_layers))
    n = tr.count_params(cfg)
    assert 8e6 < n <= 11e6
    assert tr.checkpoint_tensor_bytes(cfg) <= 22e6


def test_few_steps_reduce_loss():
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(tr.model_config(128, **TINY_ARCH))
    model = HybridLM(cfg)
    tr.init_params(model, 0)
    # a learnable stream: repeated short "documents"
    doc = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(3))
    stream = torch.cat([torch.cat([doc, torch.zeros(1, dtype=torch.long)])] * 30)
    sampler = tr.WindowSampler(stream, 50, 48, 2, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(12):
        o = tr.loss_fn(model, sampler.next(), 0.5, use_fla=False)
        o["loss"].backward()
        opt.step()
        opt.zero_grad()
        losses.append((o["main"].item(), o["mtp"].item()))
    assert losses[-1][0] < 0.7 * losses[0][0]
    assert losses[-1][1] < 0.8 * losses[0][1]


def test_window_sampler_deterministic():
    stream = torch.arange(1000)
    a = tr.WindowSampler(stream, 18, 16, 4, seed=5)
    b = tr.WindowSampler(stream, 18, 16, 4, seed=5)
    for _ in range(30):  # crosses epoch boundaries
        wa, wb = a.next(), b.next()
        assert torch.equal(wa, wb)
        assert torch.equal(wa[:, 1:] - wa[:, :-1], torch.ones(4, 17, dtype=torch.long))


def test_eval_windows_cover_each_target_once():
    stream = torch.arange(1, 101)
    w, m = tr.eval_windows(stream, 16)
    T = 16
    tg1 = w[:, 1:T + 1][m[:, 1:T + 1]]
    tg2 = w[:, 2:T + 2][m[:, 2:T + 2]]
    assert sorted(tg1.tolist()) == list(range(2, 101))
    assert sorted(tg2.tolist()) == list(range(3, 101))


def test_load_streams(tmp_path):
    pytest.importorskip("tokenizers")
    entries = [{"path": f"m{i}.py", "split": "heldout" if i == 0 else "train", "text": f"x = {i}\n"}
               for i in range(40)]
    corpus = tmp_path / "c.jsonl.xz"
    corpus.write_bytes(lzma.compress("".join(json.dumps(e) + "\n" for e in entries).encode()))
    s = tr.load_streams(corpus, TOKENIZER)
    n_val = sum(tr.is_val_doc(e["path"]) for e in entries[1:])
    assert int((s["heldout"] == 0).sum()) == 1 and s["heldout"][-1] == 0
    assert int((s["val"] == 0).sum()) == n_val
    assert int((s["train"] == 0).sum()) == 39 - n_val


def test_train_writes_loadable_checkpoint(tmp_path):
    pytest.importorskip("safetensors")
    from tokenizers import Tokenizer

    from hyspec.loading import load_model

    tok = Tokenizer.from_file(str(TOKENIZER))
    text = (ROOT / "hyspec" / "tiny.py").read_text()
    ids = tok.encode(text).ids
    stream = torch.tensor((ids + [0]) * 3, dtype=torch.long)
    streams = {"train": stream, "val": stream[:130], "heldout": stream[300:700]}
    out = tmp_path / "model"
    a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(out), steps=4, device="cpu", batch_size=2,
                     seq_len=64, warmup=2, log_every=2, n_evals=1, eval_max_tokens=100, arch=dict(TINY_ARCH))
    logs = []
    res = tr.train(a, streams=streams, log=logs.append)
    # --eval-max-tokens cuts the validations during training, not the final evaluations (the
    # reported held-out figures were of a 99-token prefix)
    assert all(v["tokens"] <= 100 for v in res["val"]) and res["final"]["val"]["tokens"] == 129
    assert res["steps"] == 4 and len(res["log"]) == 2
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "train_log.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 0}
    log = json.loads((out / "train_log.json").read_text())
    assert log["final"]["heldout"]["tokens"] == 399 and "mtp_top1" in log["final"]["heldout"]
    # size: 8-byte header length + JSON header + tensor bytes as computed from the config
    cfg = ModelConfig.from_dir(out)
    raw = (out / "model.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert len(raw) == 8 + hlen + tr.checkpoint_tensor_bytes(cfg)
    header = json.loads(raw[8:8 + hlen])
    assert header["model.embed_tokens.weight"]["dtype"] == "BF16"
    assert "lm_head.weight" not in header and any(k.startswith("mtp.") for k in header)
    model = load_model(out)
    assert model.has_mtp and model.cfg.tie_word_embeddings
    x = torch.tensor(ids[:20])
    with torch.no_grad():
        lg = model(x)
        # the loaded model's batched forward (what was evaluated) equals its own forward
        lb = tr.batched_logits(model, tr.batched_hidden(model, x[None], use_fla=False))[0]
    assert torch.isfinite(lg).all()
    torch.testing.assert_close(lb, lg, atol=1e-4, rtol=1e-4)


def _stopping_run(tmp_path, monkeypatch, fail, val: bool, steps: int = 6, good: int = 2, n_evals: int = 1):
    """A tiny training run whose loss function misbehaves from its third call on: `fail` is
    "nan" (a non-finite loss) or "error" (a RuntimeError, as an out-of-memory would be)."""
    from tokenizers import Tokenizer

    from hyspec.train import loop

    ids = Tokenizer.from_file(str(TOKENIZER)).encode((ROOT / "hyspec" / "tiny.py").read_text()).ids
    stream = torch.tensor((ids + [0]) * 3, dtype=torch.long)
    streams = {"train": stream, "val": stream[:130] if val else stream[:0], "heldout": stream[300:700]}
    calls = {"n": 0}
    real = loop.loss_fn

    def loss_fn(*args, **kw):
        calls["n"] += 1
        o = real(*args, **kw)
        if calls["n"] > good:
            if fail == "error":
                raise RuntimeError("CUDA out of memory (planted)\nsecond line")
            o["loss"] = o["loss"] * float("nan")
        return o

    monkeypatch.setattr(loop, "loss_fn", loss_fn)
    a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(tmp_path / "model"), steps=steps, device="cpu",
                     batch_size=2, seq_len=64, warmup=2, log_every=2, n_evals=n_evals, arch=dict(TINY_ARCH))
    logs = []
    return a, logs, (lambda: tr.train(a, streams=streams, log=logs.append))


def test_a_diverged_run_writes_no_checkpoint_and_keeps_the_old_one(tmp_path, monkeypatch):
    """A non-finite loss with no validation to go back to: no checkpoint (the weights are NaN),
    and a checkpoint already in --out stays as it was."""
    pytest.importorskip("safetensors")
    a, logs, run = _stopping_run(tmp_path, monkeypatch, "nan", val=False)
    out = Path(a.out)
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"older run")
    with pytest.raises(tr.TrainingFailed, match="non-finite loss.*no checkpoint written"):
        run()
    assert (out / "model.safetensors").read_bytes() == b"older run"
    assert not (out / "config.json").exists() and not list(out.glob(".*partial"))


def test_a_run_stopped_by_an_error_keeps_what_it_learnt_and_says_so(tmp_path, monkeypatch, capsys):
    """An error mid-run (an out-of-memory, say): one line in the log, no traceback; the best
    validated weights are written and the result says the run stopped early."""
    pytest.importorskip("safetensors")
    a, logs, run = _stopping_run(tmp_path, monkeypatch, "error", val=True)
    res = run()
    assert res["stopped"] == "error: RuntimeError: CUDA out of memory (planted)", res["stopped"]
    assert res["steps"] == 2 and res["chosen_step"] == 2
    assert (Path(a.out) / "model.safetensors").is_file() and (Path(a.out) / "train_log.json").is_file()
    assert any("training stopped early" in line for line in logs)
    assert "Traceback" not in capsys.readouterr().err


def test_a_diverged_run_with_validation_writes_the_best_step_in_strict_json(tmp_path, monkeypatch):
    """A non-finite loss after a validation that improved: that step's weights are written,
    and train_log.json stays strict JSON (the diverged losses are null, not NaN)."""
    pytest.importorskip("safetensors")
    a, logs, run = _stopping_run(tmp_path, monkeypatch, "nan", val=True, steps=8, good=4, n_evals=4)
    res = run()
    assert res["stopped"] == "non-finite loss" and res["chosen_step"] == 4 and res["steps"] == 6

    def no_constants(c):
        raise AssertionError(f"{c} in train_log.json")

    log = json.loads((Path(a.out) / "train_log.json").read_text(), parse_constant=no_constants)
    assert log["log"][-1]["loss"] is None


def test_the_cli_exit_status_of_a_run_that_stopped(monkeypatch, capsys, tmp_path):
    """hyspec train: 0 for a run that finished, 1 for one stopped early (checkpoint written)
    and for one that failed (none written), with one line on stderr."""
    from hyspec.train import cli

    out = str(tmp_path / "m")
    for stopped, code in (("steps", 0), ("time budget", 0), ("error: RuntimeError: boom", 1)):
        monkeypatch.setattr(cli, "train", lambda a, log: {"stopped": stopped, "chosen_step": 3})
        assert cli.main(["--out", out, "--steps", "4"]) == code
    assert capsys.readouterr().err.count("hyspec train: training stopped early (error: RuntimeError: boom)") == 1

    def fails(a, log):
        raise tr.TrainingFailed("training stopped before its first step (time budget): no checkpoint written")

    monkeypatch.setattr(cli, "train", fails)
    assert cli.main(["--out", out, "--steps", "4"]) == 1
    assert capsys.readouterr().err.strip() == ("hyspec train: error: training stopped before its first step "
                                               "(time budget): no checkpoint written")


def test_a_run_with_no_step_writes_nothing(tmp_path, monkeypatch):
    """A time budget spent before the first step (with --steps too): no checkpoint of the
    initial weights."""
    pytest.importorskip("safetensors")
    a, logs, run = _stopping_run(tmp_path, monkeypatch, "nan", val=False, good=10)
    a.minutes = 1e-9
    with pytest.raises(tr.TrainingFailed, match="before its first step"):
        run()
    assert not Path(a.out).exists() or not any(Path(a.out).iterdir())


def test_an_interrupted_save_leaves_the_older_checkpoint_whole(tmp_path, monkeypatch):
    """The files are written beside their names and renamed when all are complete: a save that
    fails part-way (here copying the tokenizer) leaves the older checkpoint as it was."""
    pytest.importorskip("safetensors")
    from hyspec.train import checkpoint

    out = tmp_path / "m"
    out.mkdir()
    for name in ("model.safetensors", "config.json", "train_log.json"):
        (out / name).write_text(f"older {name}")

    def broken_copy(*a, **kw):
        raise OSError("disk full (planted)")

    monkeypatch.setattr(checkpoint.shutil, "copyfile", broken_copy)
    model = _tiny_model(tied=True)
    with pytest.raises(OSError, match="planted"):
        checkpoint.save_checkpoint(model, {"a": 1}, out, TOKENIZER)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors", "train_log.json"]
    assert all(f.read_text() == f"older {f.name}" for f in out.iterdir())
    monkeypatch.undo()
    checkpoint.save_checkpoint(model, {"a": 1}, out, TOKENIZER)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json"]


def test_a_save_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """safetensors' SafetensorError ("Error while serializing: I/O error: No space left on
    device") is no OSError: `hyspec train` ended in its traceback. It is one line naming the
    file now, and the partial files are gone."""
    import safetensors
    import safetensors.torch

    from hyspec.train import checkpoint

    def full(tensors, filename, metadata=None):  # (its error on a full disk, as safetensors 0.8 words it)
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "m"
    with pytest.raises(OSError, match=rf"^cannot write {out / 'model.safetensors'}: No space left on device \(os error 28\)$"):
        checkpoint.save_checkpoint(_tiny_model(tied=True), {"a": 1}, out, TOKENIZER)
    assert list(out.iterdir()) == []


def test_the_cli_step_count_has_no_default_time_limit(tmp_path):
    """--steps N trains N steps: the default 7.5-minute budget applies only without it."""
    from hyspec.train.cli import parse_args

    out = str(tmp_path / "m")
    assert parse_args(["--out", out]).minutes == 7.5
    assert parse_args(["--out", out, "--steps", "5"]).minutes == 0
    assert parse_args(["--out", out, "--steps", "5", "--minutes", "2"]).minutes == 2
    from hyspec.train.config import TrainConfig  # the same rule in Python

    assert (TrainConfig().minutes, TrainConfig(steps=5).minutes, TrainConfig(steps=5, minutes=2).minutes) == (7.5, 0, 2)
    from hyspec.train.config import check_arch

    with pytest.raises(ValueError, match=r"model shape: --kv-heads \(2\) must divide --heads \(3\)"):
        check_arch({**TINY_ARCH, "heads": 3})  # (named config.json's fields)
    with pytest.raises(ValueError, match="--out is empty"):
        from hyspec.train.config import check_config

        check_config(tr.TrainArgs(out=""))


def test_grad_clip_zero_means_no_clipping(tmp_path):
    """--grad-clip 0 zeroed every gradient (clip_grad_norm_ to a norm of 0): the run "trained"
    with a flat loss and wrote its initial weights. 0 is now no clipping: the weights equal a
    run whose clip never bites."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER)).encode((ROOT / "hyspec" / "tiny.py").read_text()).ids
    stream = torch.tensor((ids + [0]) * 2, dtype=torch.long)
    weights = []
    for clip in (0.0, 1e30):
        a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(tmp_path / f"m{clip:g}"), steps=3, device="cpu",
                         batch_size=2, seq_len=32, warmup=1, log_every=3, n_evals=1, grad_clip=clip,
                         arch=dict(TINY_ARCH))
        tr.train(a, streams={"train": stream, "val": stream[:0], "heldout": stream[:200]}, log=lambda s: None)
        weights.append(load_file(str(tmp_path / f"m{clip:g}" / "model.safetensors")))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_train_and_its_tools_refuse_bad_input_in_one_line(tmp_path, capsys):
    """Each was a traceback or a silent bad run: --eval-max-tokens 1 (a crash in the
    evaluation), a seed past 64 bits (torch's overflow message), --fla on without CUDA (a
    warning, then a fallback or a failure after the data loaded), a tokenizer whose id 0 is
    no special token (documents were joined with '!' and '!' became the EOS), --selfcheck
    without CUDA, and the corpus / tokenizer tools' missing files and folders."""
    from tokenizers import Tokenizer, models

    from hyspec.cli.dispatch import main
    from hyspec.train import corpus, tokenizer_train

    plain = tmp_path / "plain.json"
    Tokenizer(models.WordLevel({"!": 0, "a": 1, "b": 2}, unk_token="a")).save(str(plain))
    base = ["train", "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "m"), "--steps", "1", "--device", "cpu"]
    for argv, needle in [(base + ["--eval-max-tokens", "1"], "--eval-max-tokens must be 0 (the whole split) or >= 3"),
                         (base + ["--seed", str(2 ** 64)], "--seed must be in 0..2**64-1"),
                         (base + ["--fla", "on"], "--fla on: it runs on CUDA only"),
                         (["train", "--tokenizer", str(plain), "--out", str(tmp_path / "m"), "--steps", "1",
                           "--device", "cpu"], f"--tokenizer {plain}: id 0 is '!', not a special token"),
                         (["train", "--selfcheck", "--device", "cpu"], "--selfcheck compares fla's CUDA kernels")]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m").exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for tool, argv, needle in [
            (tokenizer_train, ["--corpus", str(tmp_path / "none.xz"), "--out", str(tmp_path / "t")],
             "--corpus: no such file"),
            (tokenizer_train, ["--corpus", str(tmp_path / "none.xz"), "--out", str(a_file)], "is a file"),
            (corpus, ["--out", str(tmp_path / "c"), "--root", str(tmp_path / "nowhere")], "no such directory"),
            (corpus, ["--out", str(a_file)], "is a file")]:
        assert tool.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "error:" in err and "Traceback" not in err, err


def _fake_fla(q, k, v, g, beta, scale=None, output_final_state=False, **kw):
    """fla.chunk_gated_delta_rule's documented semantics, written out naively: q, k [B,T,H,K],
    v [B,T,HV,V], g/beta [B,T,HV]; value head h reads key head h // (HV // H)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    r = HV // H
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = q.new_zeros(B, HV, K, V)
    outs = []
    for t in range(T):
        kt = k[:, t].repeat_interleave(r, dim=1)  # [B, HV, K]
        qt = q[:, t].repeat_interleave(r, dim=1) * scale
        S = S * g[:, t].exp()[..., None, None]
        err = (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)) * beta[:, t][..., None]
        S = S + kt[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qt, S))
    return torch.stack(outs, 1).to(v.dtype), None


def test_fla_wiring_matches_torch_path(monkeypatch):
    """The fla call's layout (time-major, unexpanded key heads for GVA, scale) gives the same
    loss and gradients as our chunked_scan path."""
    monkeypatch.setattr(tr, "_FLA", _fake_fla)
    model = _tiny_model(True)
    model.train()
    win = torch.randint(0, 256, (2, 42), generator=torch.Generator().manual_seed(4))
    r = tr.compare_gdn_paths(model, win, 0.5, amp=False)
    assert abs(r["loss_fla"] - r["loss_torch"]) < 1e-5 and abs(r["mtp_fla"] - r["mtp_torch"]) < 1e-5
    assert r["logits_maxdiff"] < 1e-4
    assert r["grad_rel_err"] < 1e-4 and r["gdn_grad_rel_err_max"] < 1e-3


def test_chunked_scan_batched_matches_reference():
    from hyspec.model.gdn import chunked_scan, recurrent_scan

    g0 = torch.Generator().manual_seed(7)
    B, T, Hv, Dk, Dv = 3, 150, 4, 16, 8
    q = tr.l2norm(torch.randn(B, T, Hv, Dk, generator=g0)) * Dk ** -0.5
    k = tr.l2norm(torch.randn(B, T, Hv, Dk, generator=g0))
    v = torch.randn(B, T, Hv, Dv, generator=g0)
    g = -torch.rand(B, T, Hv, generator=g0) * 2
    beta = torch.rand(B, T, Hv, generator=g0)
    o = tr.chunked_scan_batched(q, k, v, g, beta)
    s0 = torch.zeros(Hv, Dk, Dv)
    for b in range(B):
        torch.testing.assert_close(o[b], chunked_scan(q[b], k[b], v[b], g[b], beta[b], s0)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o[b], recurrent_scan(q[b], k[b], v[b], g[b], beta[b], s0)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("presses", [1, 2, "ignored"])
def test_ctrl_c_stops_training_at_a_step_and_writes_what_it_learnt(tmp_path, monkeypatch, capsys, presses):
    """Ctrl-C in `hyspec train` wrote nothing (a KeyboardInterrupt from inside the step). One
    press now stops the loop at the next step boundary, evaluates and writes the weights
    (exit 130, the message names the step); a second press aborts at once, writing nothing.
    A process that ignores SIGINT (a background job) trains on. The SIGINT handler is the
    previous one afterwards."""
    pytest.importorskip("safetensors")
    import os
    import signal

    from hyspec.cli.dispatch import main
    from hyspec.train import loop

    paths = [p for p in (f"m{i}.py" for i in range(200)) if not tr.is_val_doc(p)][:60]
    entries = [{"path": p, "split": "heldout" if i == 0 else "train", "text": f"def f{i}(x):\n    return x + {i}\n"}
               for i, p in enumerate(paths)]
    corpus = tmp_path / "c.jsonl.xz"
    corpus.write_bytes(lzma.compress("".join(json.dumps(e) + "\n" for e in entries).encode()))
    real_loss, calls = loop.loss_fn, []

    def loss_then_ctrl_c(*args, **kw):  # the user presses Ctrl-C during the second step
        calls.append(1)
        if len(calls) == 2:
            for _ in range(1 if presses == "ignored" else presses):
                os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*args, **kw)

    monkeypatch.setattr(loop, "loss_fn", loss_then_ctrl_c)
    if presses == "ignored":
        old_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # (restored below)
    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "m"
    argv = ["train", "--corpus", str(corpus), "--tokenizer", str(TOKENIZER), "--out", str(out), "--steps", "6",
            "--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--log-every", "1",
            "--n-evals", "1"] + [f"--{k.replace('_', '-')}={v}" for k, v in TINY_ARCH.items()]
    try:
        rc = main(argv)
    finally:
        if presses == "ignored":
            signal.signal(signal.SIGINT, old_handler)
    captured = capsys.readouterr()
    if presses == "ignored":
        assert rc == 0 and len(calls) == 6 and (out / "model.safetensors").is_file(), captured.err
        return
    assert rc == 130
    assert signal.getsignal(signal.SIGINT) is before
    if presses == 2:
        assert "hyspec: interrupted" in captured.err and not out.exists() and len(calls) == 2
        return
    assert len(calls) == 2  # the second step finished, no third began
    assert f"training interrupted (Ctrl-C) at step 2; {out} holds the weights of step 2" in captured.err
    assert "Ctrl-C: training stops at step 2" in captured.out
    log = json.loads((out / "train_log.json").read_text())
    assert (log["stopped"], log["steps"], log["chosen_step"]) == ("interrupted (Ctrl-C)", 2, 2)
    assert (out / "model.safetensors").is_file()


def _ctrl_c_corpus(tmp_path):
    paths = [p for p in (f"m{i}.py" for i in range(200)) if not tr.is_val_doc(p)][:60]
    entries = [{"path": p, "split": "heldout" if i == 0 else "train", "text": f"def f{i}(x):\n    return x + {i}\n"}
               for i, p in enumerate(paths)]
    corpus = tmp_path / "c.jsonl.xz"
    corpus.write_bytes(lzma.compress("".join(json.dumps(e) + "\n" for e in entries).encode()))
    return ["train", "--corpus", str(corpus), "--tokenizer", str(TOKENIZER), "--steps", "3", "--device", "cpu",
            "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--log-every", "1", "--n-evals", "1"] + \
        [f"--{k.replace('_', '-')}={v}" for k, v in TINY_ARCH.items()]


@pytest.mark.parametrize("where", ["final evaluation", "save"])
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_after_the_last_step_finishes_the_run_or_aborts_it_whole(tmp_path, monkeypatch, capsys, presses,
                                                                       where):
    """The Ctrl-C handler of training was gone once the steps ended: one press during the
    final evaluation (minutes on a real corpus) or the write lost the whole run (exit 130,
    nothing written). Now one press there lets the run finish and write (exit 0: nothing was
    cut; the log says so), and a second aborts without writing: the older checkpoint in
    --out stays whole and no partial file is left behind."""
    pytest.importorskip("safetensors")
    import os
    import signal

    from hyspec.cli.dispatch import main
    from hyspec.train import loop

    out = tmp_path / "m"
    out.mkdir()
    for name in ("model.safetensors", "config.json", "train_log.json"):
        (out / name).write_text(f"older {name}")
    real = {"final evaluation": loop.evaluate, "save": loop.stage_checkpoint}[where]
    calls = []

    def then_ctrl_c(*args, **kw):
        r = real(*args, **kw)
        calls.append(1)
        if len(calls) == 1:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return r

    monkeypatch.setattr(loop, {"final evaluation": "evaluate", "save": "stage_checkpoint"}[where], then_ctrl_c)
    before = signal.getsignal(signal.SIGINT)
    rc = main(_ctrl_c_corpus(tmp_path) + ["--out", str(out)])
    captured = capsys.readouterr()
    assert signal.getsignal(signal.SIGINT) is before and calls
    if presses == 2:
        assert rc == 130 and "hyspec: interrupted" in captured.err
        assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors", "train_log.json"]
        assert all(f.read_text() == f"older {f.name}" for f in out.iterdir())
        return
    assert rc == 0, captured.err
    assert "Ctrl-C after the last step" in captured.out
    log = json.loads((out / "train_log.json").read_text())
    assert (log["stopped"], log["steps"]) == ("steps", 3) and "heldout" in log["final"]
    assert not [f for f in out.iterdir() if f.name.endswith(".partial")]


def test_a_ctrl_c_during_the_renames_takes_effect_after_them():
    """The renames that put a checkpoint in place run with Ctrl-C held (a press between two of
    them left a model.safetensors of one run beside the config.json of another): the press
    is delivered to the previous handler at the block's end."""
    import os
    import signal

    from hyspec.train.checkpoint import _sigint_held

    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with _sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("renamed")
    assert done == ["renamed"] and signal.getsignal(signal.SIGINT) is before


def test_train_paths_expand_the_users_home_and_a_long_window_widens_the_context(tmp_path, monkeypatch):
    """--out=~/m (the shell leaves ~ there) was checked as the home folder's m but written to
    ./~/m; --corpus ~/... did "not exist". And a --seq-len above 4096 wrote a config.json whose
    context (4096) refused prompts as long as the windows the model was trained on."""
    pytest.importorskip("safetensors")
    from hyspec.loading import load_model
    from hyspec.train.config import TrainConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    a = TrainConfig(corpus="~/c.jsonl.xz", tokenizer="~/t.json", out="~/m", steps=1)
    assert (a.corpus, a.tokenizer, a.out) == (str(tmp_path / "c.jsonl.xz"), str(tmp_path / "t.json"),
                                              str(tmp_path / "m"))
    T = 4200
    stream = torch.arange(1, 2 * T + 10, dtype=torch.long) % 200 + 1
    streams = {"train": stream, "val": stream[:0], "heldout": stream[:0]}
    a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(tmp_path / "long"), steps=1, device="cpu", batch_size=1,
                     seq_len=T, warmup=1, log_every=1, n_evals=1, arch=dict(TINY_ARCH, layers=2, full_every=2))
    tr.train(a, streams=streams, log=lambda s: None)
    model = load_model(tmp_path / "long")
    assert model.cfg.max_position_embeddings >= T


def test_a_second_ctrl_c_during_the_renames_comes_after_the_write(tmp_path, monkeypatch, capsys):
    """A second Ctrl-C that lands while the written files are renamed into place was held
    there, then raised: "interrupted" (exit 130) for a run whose new checkpoint had replaced
    the old one. The write is the run's last work: such a press is dropped, the run ends as
    written (exit 0, "wrote ...")."""
    pytest.importorskip("safetensors")
    import os
    import pathlib
    import signal

    from hyspec.cli.dispatch import main
    from hyspec.train import loop

    out = tmp_path / "m"
    real_eval, real_replace, pressed = loop.evaluate, pathlib.Path.replace, []

    def eval_then_ctrl_c(*args, **kw):  # the first press: during the final evaluation
        r = real_eval(*args, **kw)
        if not pressed:
            pressed.append("eval")
            os.kill(os.getpid(), signal.SIGINT)
        return r

    def replace_then_ctrl_c(self, target):  # the second: after the first rename into --out
        r = real_replace(self, target)
        if pathlib.Path(target).parent == out and len(pressed) == 1:
            pressed.append("rename")
            os.kill(os.getpid(), signal.SIGINT)
        return r

    monkeypatch.setattr(loop, "evaluate", eval_then_ctrl_c)
    monkeypatch.setattr(pathlib.Path, "replace", replace_then_ctrl_c)
    rc = main(_ctrl_c_corpus(tmp_path) + ["--out", str(out)])
    captured = capsys.readouterr()
    assert pressed == ["eval", "rename"]
    assert rc == 0 and "interrupted" not in captured.err and f"wrote {out}" in captured.out, captured.err
    assert json.loads((out / "train_log.json").read_text())["steps"] == 3


def test_under_wall_minutes_the_final_evaluations_keep_the_token_cap(tmp_path):
    """--wall-minutes keeps a fixed reserve for the final evaluations and the write: there the
    final evaluations stay cut to --eval-max-tokens (whole splits could run past the limit)."""
    pytest.importorskip("safetensors")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER)).encode((ROOT / "hyspec" / "tiny.py").read_text()).ids
    stream = torch.tensor((ids + [0]) * 3, dtype=torch.long)
    streams = {"train": stream, "val": stream[:130], "heldout": stream[300:700]}
    a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(tmp_path / "m"), steps=2, device="cpu", batch_size=2,
                     seq_len=64, warmup=1, log_every=1, n_evals=1, eval_max_tokens=100, wall_minutes=60.0,
                     arch=dict(TINY_ARCH))
    res = tr.train(a, streams=streams, log=lambda s: None)
    assert res["final"]["val"]["tokens"] <= 100 and res["final"]["heldout"]["tokens"] <= 100


def test_a_trained_checkpoint_over_a_make_tiny_one_drops_its_marker(tmp_path):
    """`hyspec train --out` into a make-tiny folder kept make-tiny's make_tiny.json beside the
    trained weights: a later `hyspec make-tiny --out` there replaced them as its own."""
    from hyspec.cli import main
    from hyspec.train.checkpoint import commit_checkpoint

    out = tmp_path / "m"
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(out), "--vocab-size", "64"]) == 0
    assert (out / "make_tiny.json").is_file()
    staged = tmp_path / "config.staged"
    staged.write_text((out / "config.json").read_text())
    commit_checkpoint(out, {"config.json": staged})
    assert not (out / "make_tiny.json").exists()
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(out), "--vocab-size", "64"]) == 2


def _tiny_streams():
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER)).encode((ROOT / "hyspec" / "tiny.py").read_text()).ids
    stream = torch.tensor((ids + [0]) * 3, dtype=torch.long)
    return {"train": stream, "val": stream[:130], "heldout": stream[300:400]}


def test_the_trained_weights_get_the_mode_of_the_other_files(tmp_path):
    """safetensors creates model.safetensors for its owner only (0600): the trained checkpoint's
    weights were unreadable to anyone its config.json and tokenizer.json were readable to."""
    import os

    out = tmp_path / "m"
    old = os.umask(0o022)
    try:
        tr.train(tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(out), steps=1, device="cpu", batch_size=2,
                              seq_len=32, warmup=0, log_every=1, arch=dict(TINY_ARCH)),
                 streams=_tiny_streams(), log=lambda s: None)
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


def test_train_refuses_an_out_folder_holding_another_checkpoints_shards(tmp_path, capsys):
    """The loader prefers model.safetensors.index.json (and reads every *.safetensors without
    one): a run written beside another checkpoint's shards trained for nothing, its folder then
    loading the old weights (or failing on their shapes). Refused before anything is done."""
    from hyspec.cli.dispatch import main

    out = tmp_path / "m"
    out.mkdir()
    (out / "model-00001-of-00001.safetensors").write_bytes(b"old")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00001-of-00001.safetensors"}}')
    before = sorted(p.name for p in out.iterdir())
    argv = ["train", "--tokenizer", str(TOKENIZER), "--out", str(out), "--steps", "1", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds another checkpoint's weights" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in out.iterdir()) == before
    # a folder with an earlier trained checkpoint (one model.safetensors) is still overwritten
    with pytest.raises(ValueError, match="nothing to train"):  # (past the folder check)
        tr.train(tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(tmp_path / "fresh"), steps=0, minutes=0))


def test_the_corpus_tool_refuses_to_write_an_empty_corpus(tmp_path, capsys):
    """A --root with no eligible *.py files (a user's .txt folder) wrote an empty corpus and
    exited 0; the trainer then failed on it much later."""
    from hyspec.train import corpus

    root = tmp_path / "texts"
    root.mkdir()
    (root / "notes.txt").write_text("hello there\n")
    out = tmp_path / "c"
    assert corpus.main(["--out", str(out), "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "the corpus would be empty" in err and "Traceback" not in err, err
    assert not out.exists()
    (root / "main.py").write_text("x = 1\n")  # one file, held out at 100 %: no train split
    assert corpus.main(["--out", str(out), "--root", str(root), "--heldout-percent", "100"]) == 2
    assert "no train split" in capsys.readouterr().err
    assert not out.exists()
    assert corpus.main(["--out", str(out), "--root", str(root)]) == 0
    assert (out / corpus.DEFAULT_NAME).is_file()
