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
    logs = []
    res = tr.train(a, streams=streams, log=logs.append)
    assert res["final"]["val"]["tokens"] <= 100 and res["final"]["heldout"]["tokens"] <= 100
    # (and the training time is cut to what the limit leaves: --steps alone has no budget)
    assert res["train_budget_s"] is not None and res["train_budget_s"] < 3600 - 25
    assert any(line.startswith("wall-clock limit 60 min: training budget cut to") for line in logs)


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


@pytest.mark.parametrize("kw, needle", [
    (dict(batch_size=0), "--batch-size must be >= 1, got 0"),
    (dict(seq_len=1), "--seq-len must be >= 2, got 1"),
    (dict(log_every=0), "--log-every must be >= 1"),
    (dict(n_evals=0), "--n-evals must be >= 1"),
    (dict(warmup=-1), "--warmup must be >= 0"),
    (dict(lr=0.0), "--lr must be > 0"),
    (dict(lr=float("nan")), "--lr must be a finite number >= 0, got nan"),
    (dict(grad_clip=float("inf")), "--grad-clip must be a finite number >= 0, got inf"),
    (dict(mtp_weight=-0.5), "--mtp-weight must be a finite number >= 0"),
    (dict(eval_max_tokens=2), "--eval-max-tokens must be 0 (the whole split) or >= 3, got 2"),
    (dict(dropout=1.0), "--dropout in [0, 1)"),
    (dict(min_lr_ratio=1.5), "--min-lr-ratio must be in [0, 1]"),
    (dict(arch=dict(TINY_ARCH, heads=0)), "--heads must be >= 1, got 0"),
    (dict(device="tpu"), "must be cpu, cuda or cuda:N"),
])
def test_check_config_refuses_each_setting_that_cannot_train(tmp_path, kw, needle):
    """Every refusal of check_config names its flag (a batch of 0 windows, a learning rate of
    0 or NaN, dropout 1, an unknown device, ...), before anything is loaded or written."""
    from hyspec.train.config import check_config

    with pytest.raises(ValueError) as e:
        check_config(tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(tmp_path / "m"), steps=1, **kw))
    assert needle in str(e.value), str(e.value)
    assert not (tmp_path / "m").exists()


def test_an_out_folder_with_only_a_shard_index_is_refused(tmp_path):
    """The loader reads model.safetensors.index.json in preference to model.safetensors: an
    index alone (its shards deleted) in --out is another checkpoint's weights too."""
    from hyspec.train.config import check_no_other_weights

    out = tmp_path / "m"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier trained run")
    check_no_other_weights(out)  # (an earlier trained checkpoint is overwritten)
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match=r"holds another checkpoint's weights \(model.safetensors.index.json\)"):
        check_no_other_weights(out)


def test_window_sampler_epochs_use_each_window_once_in_a_new_order():
    """An epoch draws an offset in [0, stride) and uses each window offset + k*stride (the last
    one ending at the stream's end included) once, in a random order; epochs_done counts them."""
    N, win, stride, B = 18 + 7 * 16, 18, 16, 4
    s = tr.WindowSampler(torch.arange(N), win, stride, B, seed=0)
    epochs: dict[int, list[int]] = {}
    for _ in range(80):
        w = s.next()
        assert w.shape == (B, win) and torch.equal(w[:, 1:] - w[:, :-1], torch.ones(B, win - 1, dtype=torch.long))
        assert s.epoch - 1 < s.epochs_done <= s.epoch
        epochs.setdefault(s.epoch, []).extend(w[:, 0].tolist())
    del epochs[s.epoch]  # (the last may be part-way)
    offsets = set()
    for starts in epochs.values():
        off = starts[0] % stride
        every = list(range(off, N - win + 1, stride))
        assert len(set(starts)) == len(starts) == len(every) // B * B and set(starts) <= set(every), (off, starts)
        offsets.add(off)
    assert 0 in offsets and len(offsets) > 3  # (offset 0: the window ending at the stream's end is used)
    assert any(starts != sorted(starts) for starts in epochs.values())
    with pytest.raises(ValueError, match="too short for one step"):
        tr.WindowSampler(torch.arange(win + B * stride - 1), win, stride, B, seed=0)


def test_eval_windows_cover_each_target_once_at_every_length():
    T = 8
    for n in range(2, 4 * T + 4):
        w, m = tr.eval_windows(torch.arange(1, n + 1), T)
        assert sorted(w[:, 1:T + 1][m[:, 1:T + 1]].tolist()) == list(range(2, n + 1)), n
        assert sorted(w[:, 2:T + 2][m[:, 2:T + 2]].tolist()) == list(range(3, n + 1)), n


def test_lr_schedule_warms_up_then_decays_to_its_floor():
    """Linear warm-up over --warmup steps (at most a tenth of the run), then a cosine from --lr
    down to --lr x --min-lr-ratio at the last step."""
    a = tr.TrainArgs(lr=1e-3, warmup=10, min_lr_ratio=0.1, steps=100)
    assert tr.lr_at(0, 100, a) == pytest.approx(1e-4)
    assert tr.lr_at(4, 100, a) == pytest.approx(5e-4)
    assert tr.lr_at(9, 100, a) == pytest.approx(1e-3) == tr.lr_at(10, 100, a)
    assert tr.lr_at(55, 100, a) == pytest.approx(1e-4 + 0.5 * 0.9e-3)
    assert tr.lr_at(100, 100, a) == pytest.approx(1e-4)
    lrs = [tr.lr_at(s, 100, a) for s in range(10, 101)]
    assert lrs == sorted(lrs, reverse=True)
    a = tr.TrainArgs(lr=1e-3, warmup=100, min_lr_ratio=0.1, steps=20)  # warm-up capped at 20 // 10 steps
    assert tr.lr_at(0, 20, a) == pytest.approx(5e-4) and tr.lr_at(1, 20, a) == pytest.approx(1e-3)


def test_weight_decay_applies_to_matrices_only():
    model = _tiny_model(True)
    decay, no_decay = tr._param_groups(model, 0.3)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    for p in decay["params"]:
        n = names[id(p)]
        assert p.dim() >= 2 and "embed_tokens" not in n and not n.endswith("conv1d.weight"), n
    for p in no_decay["params"]:
        n = names[id(p)]
        assert p.dim() < 2 or "embed_tokens" in n or n.endswith("conv1d.weight"), n
    assert len(decay["params"]) + len(no_decay["params"]) == len(names) and decay["params"]


def test_the_checkpoint_keeps_the_decay_parameters_in_fp32(tmp_path):
    """A_log and dt_bias are written in fp32 (bf16 would move every decay rate), the rest in
    bf16; round_to_bf16_ (applied before the final evaluation) gives the weights the
    checkpoint holds."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    model = _tiny_model(True)
    out = tmp_path / "m"
    tr.save_checkpoint(model, {"a": 1}, out, None)
    saved = load_file(str(out / "model.safetensors"))
    sd = model.state_dict()
    keep = [k for k in sd if k.endswith(("A_log", "dt_bias"))]
    assert any(k.endswith("A_log") for k in keep) and any(k.endswith("dt_bias") for k in keep)
    for k, v in saved.items():
        assert v.dtype == (torch.float32 if k in keep else torch.bfloat16), k
    before = {k: v.clone() for k, v in sd.items()}
    tr.round_to_bf16_(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k].to(v.dtype)), k
        if k in keep:
            assert torch.equal(v, before[k]), k


def test_a_run_follows_its_settings(tmp_path, monkeypatch):
    """What the loop does with its settings: each step's loss takes --mtp-weight and --dropout,
    the logged loss is the mean over the steps since the last line (and the last step is
    logged), the lr follows lr_at, AdamW decays with --weight-decay, --n-evals validations are
    spread over the run, and the final figures are those of the written (bf16) checkpoint."""
    pytest.importorskip("safetensors")
    from hyspec.loading import load_model
    from hyspec.train import loop

    real_loss, seen = loop.loss_fn, []

    def loss_fn(model, win, mtp_weight, use_fla, dropout=0.0, *args, **kw):
        o = real_loss(model, win, mtp_weight, use_fla, dropout, *args, **kw)
        seen.append((mtp_weight, dropout, o["loss"].item()))
        return o

    real_adamw, groups = torch.optim.AdamW, []

    def adamw(params, **kw):
        groups.extend(params)
        return real_adamw(params, **kw)

    monkeypatch.setattr(loop, "loss_fn", loss_fn)
    monkeypatch.setattr(torch.optim, "AdamW", adamw)
    streams = _tiny_streams()
    out = tmp_path / "m"
    a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(out), steps=5, device="cpu", batch_size=2, seq_len=32,
                     warmup=2, log_every=2, n_evals=2, mtp_weight=0.25, dropout=0.05, weight_decay=0.3,
                     lr=3e-3, min_lr_ratio=0.2, arch=dict(TINY_ARCH))
    res = tr.train(a, streams=streams, log=lambda s: None)
    assert [s[:2] for s in seen] == [(0.25, 0.05)] * 5
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert [h["step"] for h in res["log"]] == [2, 4, 5]
    for h, window in zip(res["log"], ([0, 1], [2, 3], [4])):
        assert h["loss"] == pytest.approx(sum(seen[i][2] for i in window) / len(window), rel=1e-5)
        assert h["loss"] == pytest.approx(h["main_loss"] + 0.25 * h["mtp_loss"], rel=1e-5)
        assert h["lr"] == pytest.approx(tr.lr_at(h["step"] - 1, 5, a))
        assert h["tokens"] == h["step"] * 2 * 32
    assert [v["step"] for v in res["val"]] == [0, 2, 4, 5] and res["tokens_seen"] == 5 * 2 * 32
    assert all(v["score"] == pytest.approx(v["loss"] + 0.25 * v["mtp_loss"]) for v in res["val"])
    model = load_model(out, dtype=torch.float32)
    r = tr.evaluate(model, streams["heldout"], T=32, batch=2, device="cpu", mtp_weight=0.25, use_fla=False,
                    amp=False)
    for k in ("tokens", "loss", "top1", "mtp_loss", "mtp_top1"):
        assert r[k] == pytest.approx(res["final"]["heldout"][k], rel=1e-6, abs=1e-7), k


def test_the_seed_sets_the_initial_weights_and_the_data_order(tmp_path, monkeypatch):
    """--seed is the init and data order seed: the same seed trains the same weights, another
    starts from other weights and draws other windows."""
    pytest.importorskip("safetensors")
    from hyspec.train import loop

    real_loss, wins = loop.loss_fn, []
    monkeypatch.setattr(loop, "loss_fn", lambda model, win, *a, **kw: (wins.append(win.clone()),
                                                                         real_loss(model, win, *a, **kw))[1])
    runs = []
    for i, seed in enumerate((0, 0, 1)):
        wins.clear()
        out = tmp_path / f"m{i}"
        a = tr.TrainArgs(tokenizer=str(TOKENIZER), out=str(out), steps=1, device="cpu", batch_size=2, seq_len=16,
                         warmup=0, log_every=1, n_evals=1, seed=seed, arch=dict(TINY_ARCH))
        res = tr.train(a, streams=_tiny_streams(), log=lambda s: None)
        runs.append((res["val"][0]["loss"], list(wins), (out / "model.safetensors").read_bytes()))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    assert all(torch.equal(x, y) for x, y in zip(runs[0][1], runs[1][1]))
    assert runs[2][0] != runs[0][0]  # other initial weights
    assert not torch.equal(runs[2][1][0], runs[0][1][0])  # other windows


def test_the_cpu_memory_check_refuses_what_does_not_fit_and_names_a_batch_that_does(monkeypatch):
    """A CPU run whose estimate passes 90 % of the available memory is refused, naming the
    largest --batch-size that fits; a GPU run is not judged by the host's memory."""
    from hyspec.train import memory

    a = tr.TrainArgs(batch_size=8, seq_len=256, steps=1)
    need = memory.estimate_train_bytes(a, 4096)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(need / 0.9) + 1)
    memory.check_train_memory(a, 4096, "cpu")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(need / 0.9) - 1)
    with pytest.raises(ValueError, match=r"needs about .* GB .*--batch-size 7 fits"):
        memory.check_train_memory(a, 4096, "cpu")
    memory.check_train_memory(a, 4096, "cuda")  # (no CUDA needed: the check is for the CPU only)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1)
    with pytest.raises(ValueError, match="even --batch-size 1 does not fit"):
        memory.check_train_memory(a, 4096, "cpu")


def test_the_cli_flags_and_exit_statuses(monkeypatch, capsys, tmp_path):
    """The model-shape flags default to DEFAULT_ARCH, --no-check-fla turns the check off, and
    a run stopped by a non-finite loss exits 1 as one stopped by an error; a Ctrl-C before
    the first step (nothing written) exits 130."""
    from hyspec.train import cli

    out = str(tmp_path / "m")
    a = cli.parse_args(["--out", out])
    assert a.arch == tr.DEFAULT_ARCH and a.check_fla is True
    a = cli.parse_args(["--out", out, "--no-check-fla", "--hidden", "64"])
    assert a.check_fla is False and a.arch == dict(tr.DEFAULT_ARCH, hidden=64)
    monkeypatch.setattr(cli, "train", lambda a, log: {"stopped": "non-finite loss", "chosen_step": 2})
    assert cli.main(["--out", out, "--steps", "4"]) == 1
    assert "training stopped early (non-finite loss)" in capsys.readouterr().err

    def interrupted(a, log):
        raise tr.TrainingFailed("training stopped before its first step (interrupted (Ctrl-C)): no checkpoint written")

    monkeypatch.setattr(cli, "train", interrupted)
    assert cli.main(["--out", out, "--steps", "4"]) == 130


def test_the_fla_guard_sees_a_wrong_kernel(monkeypatch):
    """compare_gdn_paths, which decides whether training uses fla, reports a kernel whose
    output is off (here scaled by 1.5) by its loss, gradients and the worst GDN parameter."""

    def off(*args, **kw):
        o, s = _fake_fla(*args, **kw)
        return o * 1.5, s

    monkeypatch.setattr(tr, "_FLA", off)
    model = _tiny_model(True)
    model.train()
    win = torch.randint(0, 256, (2, 42), generator=torch.Generator().manual_seed(4))
    r = tr.compare_gdn_paths(model, win, 0.5, amp=False)
    assert r["logits_maxdiff"] > 1e-3 and r["grad_rel_err"] > 1e-3
    assert r["gdn_grad_rel_err_max"] > 1e-3 and "linear_attn" in r["gdn_grad_worst"]


def test_evaluate_scores_each_target_once_per_head():
    """evaluate's loss, perplexity and top-1 (target and MTP) over a stream that does not fill
    its last batch or window: each window scored on its own, as the per-sequence model does."""
    import math

    import torch.nn.functional as F

    model = _tiny_model(True)
    stream = torch.randint(1, 256, (61,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the model's own greedy text up to 40, so that top-1 is not 0
        for i in range(1, 40):
            stream[i] = model(stream[:i])[-1].argmax()
    T = 16
    r = tr.evaluate(model, stream, T=T, batch=3, device="cpu", mtp_weight=0.5, use_fla=False, amp=False)
    ce, ok, ce2, ok2 = [], [], [], []
    with torch.no_grad():
        for s in range(0, stream.numel() - 1, T):
            ids = stream[s:s + T]
            h = model.forward_hidden(ids, None, StepCtx(chunked=True))
            lg = model.logits(h)
            tgt = stream[s + 1:s + T + 1]
            ce += F.cross_entropy(lg[:len(tgt)], tgt, reduction="none").tolist()
            ok += (lg[:len(tgt)].argmax(-1) == tgt).tolist()
            tgt2 = stream[s + 2:s + T + 2]
            if len(tgt2):
                ml = model.logits(model.mtp_hidden(stream[s + 1:s + 1 + len(tgt2)], h[:len(tgt2)], StepCtx(start=0), None))
                ce2 += F.cross_entropy(ml, tgt2, reduction="none").tolist()
                ok2 += (ml.argmax(-1) == tgt2).tolist()
    assert r["tokens"] == len(ce) == 60 and len(ce2) == 59 and 0 < r["top1"] < 1
    assert r["loss"] == pytest.approx(sum(ce) / len(ce), abs=1e-5) and r["ppl"] == pytest.approx(math.exp(r["loss"]))
    assert r["top1"] == pytest.approx(sum(ok) / len(ok))
    assert r["mtp_loss"] == pytest.approx(sum(ce2) / len(ce2), abs=1e-5)
    assert r["mtp_top1"] == pytest.approx(sum(ok2) / len(ok2))


def test_the_validation_split_is_pinned():
    """The ~3 % of the train split kept out for validation is a pure function of the path
    (sha256 of "val:" + path below VAL_PERCENT): the shipped checkpoint's best step was picked
    on these files."""
    files = (ROOT / "data" / "train_files.txt").read_text().split()
    val = [p for p in files if tr.is_val_doc(p)]
    assert len(files) == 702 and len(val) == 27 and val[0] == "asyncio/proactor_events.py"
    assert not tr.is_val_doc("argparse.py") and not tr.is_val_doc("os.py")


def test_load_streams_keeps_the_val_documents_out_of_training(tmp_path):
    """The val documents (m75, m119, m128 here) form the val stream, in corpus order, and are
    not trained on; the others are the train stream, each document followed by EOS."""
    from tokenizers import Tokenizer

    entries = [{"path": f"m{i}.py", "split": "heldout" if i == 0 else "train", "text": f"x = {i}\n"}
               for i in range(130)]
    corpus = tmp_path / "c.jsonl.xz"
    corpus.write_bytes(lzma.compress("".join(json.dumps(e) + "\n" for e in entries).encode()))
    s = tr.load_streams(corpus, TOKENIZER)
    tok = Tokenizer.from_file(str(TOKENIZER))

    def docs(stream):
        text = tok.decode(stream.tolist(), skip_special_tokens=False)
        assert text.endswith("<|endoftext|>")
        return text.split("<|endoftext|>")[:-1]

    val = [e["text"] for e in entries[1:] if tr.is_val_doc(e["path"])]
    assert val == ["x = 75\n", "x = 119\n", "x = 128\n"]
    assert docs(s["val"]) == val
    assert docs(s["train"]) == [e["text"] for e in entries[1:] if e["text"] not in val]
    assert docs(s["heldout"]) == ["x = 0\n"]


def test_available_memory_is_capped_by_the_cgroup_limit(monkeypatch):
    """In a container the cgroup's memory.max (less what it uses) bounds what a CPU run may
    take, below the host's MemAvailable; "max" is no limit."""
    from hyspec.train import memory

    files = {"/proc/meminfo": "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n",
             "/sys/fs/cgroup/memory.max": "3000000000\n", "/sys/fs/cgroup/memory.current": "1000000000\n"}

    class FakePath:
        def __init__(self, p):
            self.p = str(p)

        def read_text(self):
            if self.p not in files:
                raise FileNotFoundError(self.p)
            return files[self.p]

    monkeypatch.setattr(memory, "Path", FakePath)
    assert memory.available_memory_bytes() == 2_000_000_000
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert memory.available_memory_bytes() == 8_000_000 * 1024
