"""The training run: optimizer, learning-rate schedule, the loop (time budget, validation,
best-checkpoint restore, fla guard), final evaluation and the checkpoint write."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hyspec.config import FULL, ModelConfig, finite_json
from hyspec.interrupt import stop_on_ctrl_c
from hyspec.model.hybrid import HybridLM
from hyspec.provenance import git_state
from hyspec.train import forward as fwd
from hyspec.train.checkpoint import (
    checkpoint_tensor_bytes,
    commit_checkpoint,
    discard_staged,
    round_to_bf16_,
    stage_checkpoint,
)
from hyspec.train.config import TrainConfig
from hyspec.train.data import WindowSampler, eval_windows, load_streams
from hyspec.train.evaluate import evaluate
from hyspec.train.forward import fla_kernel, loss_fn
from hyspec.train.kernel_check import compare_gdn_paths
from hyspec.train.memory import check_train_memory
from hyspec.train.model import EOS_ID, init_params, model_config

_PROCESS_START = time.time()


def lr_at(step: int, total: int, a: TrainConfig) -> float:
    warm = min(a.warmup, max(1, total // 10))
    if step < warm:
        return a.lr * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, total - warm))
    lo = a.lr * a.min_lr_ratio
    return lo + 0.5 * (a.lr - lo) * (1.0 + math.cos(math.pi * p))


def _param_groups(model: HybridLM, wd: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in n and not n.endswith("conv1d.weight"):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class TrainingFailed(ValueError):
    """A run that stopped (an error, a non-finite loss) before it learnt weights worth writing."""


INTERRUPTED = "interrupted (Ctrl-C)"


def train(a: TrainConfig, streams: dict[str, torch.Tensor] | None = None, log=print) -> dict:
    """Train, evaluate and write the checkpoint to a.out. Returns the log dict."""
    from hyspec.train.config import check_config

    check_config(a)
    t_start = time.time()
    git = git_state()  # the code that trains, recorded before it runs
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    torch.manual_seed(a.seed)
    if cuda:
        torch.cuda.manual_seed_all(a.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    use_fla = {"auto": None, "on": True, "off": False}[a.fla]
    if use_fla is None:
        use_fla = cuda and fla_kernel() is not None
    elif use_fla and (not cuda or fla_kernel() is None):  # (it fell back or failed after loading the data)
        why = "it runs on CUDA only" if not cuda else f"its kernel is unusable here: {fwd.FLA_UNUSABLE_REASON}"
        raise ValueError(f"--fla on: {why} (--fla auto uses it where it works)")
    amp = cuda

    from tokenizers import Tokenizer

    for flag, path, needed in (("--tokenizer", a.tokenizer, True), ("--corpus", a.corpus, streams is None)):
        if needed and not Path(path).is_file():  # (both before the memory check, which names neither)
            raise FileNotFoundError(f"{flag} {path} " + ("is a directory, not a file" if Path(path).is_dir() else
                                                            "does not exist"))
    try:
        tok = Tokenizer.from_file(str(a.tokenizer))
        vocab = tok.get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
        raise ValueError(f"--tokenizer {a.tokenizer}: not a tokenizer.json the tokenizers library reads "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    first = tok.get_added_tokens_decoder().get(EOS_ID)
    if first is None or not first.special:  # documents are joined with id 0, and it is the model's EOS
        raise ValueError(f"--tokenizer {a.tokenizer}: id {EOS_ID} is {tok.id_to_token(EOS_ID)!r}, not a special "
                         f"token: the trainer separates documents with id {EOS_ID} and writes it as the model's "
                         "EOS (hyspec.train.tokenizer_train puts <|endoftext|> there)")
    check_train_memory(a, vocab, device)  # before anything large is allocated
    if streams is None:
        streams = load_streams(a.corpus, a.tokenizer)
    log(f"data: train {streams['train'].numel():,} tokens, val {streams['val'].numel():,}, "
        f"heldout {streams['heldout'].numel():,} ({time.time() - t_start:.1f}s)")

    # (the context the checkpoint declares covers the windows it was trained on: a longer --seq-len than
    # the default 4096 wrote a model that refused prompts of its own training length)
    cfg_dict = model_config(vocab, max_positions=max(4096, a.seq_len), **a.arch)
    cfg = ModelConfig.from_dict(cfg_dict)
    model = HybridLM(cfg, with_mtp=True)
    init_params(model, a.seed)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt_bytes = checkpoint_tensor_bytes(cfg)
    log(f"model: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers} ({''.join('A' if t == FULL else 'L' for t in cfg.layer_types)}) "
        f"+ MTP, {n_params:,} params, {ckpt_bytes / 1e6:.2f} MB tensors; device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}; GDN recurrence: "
        f"{'fla chunk_gated_delta_rule' if use_fla else 'torch chunked_scan (batched)'}"
        f"{'' if use_fla or not fwd.FLA_UNUSABLE_REASON else ' -- ' + fwd.FLA_UNUSABLE_REASON}")

    opt_kw = {"fused": True} if cuda else {}
    opt = torch.optim.AdamW(_param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kw)
    T, B = a.seq_len, a.batch_size
    train_stream = streams["train"].to(device)
    sampler = WindowSampler(train_stream, T + 2, T, B, a.seed)
    budget = a.minutes * 60.0 if a.minutes > 0 else math.inf  # 0: no time limit (with --steps)
    reserve = 25.0  # seconds kept for the final evals and the save under --wall-minutes
    total = a.steps if a.steps > 0 else 0
    eval_kw = dict(T=T, batch=B, device=device, mtp_weight=a.mtp_weight, use_fla=use_fla, amp=amp,
                   max_tokens=a.eval_max_tokens or None)

    history, val_hist = [], []
    best = {"val_loss": float("inf"), "step": -1, "state": None}

    def run_val(step: int) -> float:
        t0 = time.time()
        model.eval()
        r = evaluate(model, streams["val"], **eval_kw)
        model.train()
        dt = time.time() - t0
        score = r["loss"] + a.mtp_weight * r.get("mtp_loss", 0.0)
        val_hist.append({"step": step, "tokens": step * B * T, **r, "score": score, "seconds": round(dt, 2)})
        log(f"  val @ step {step}: loss {r['loss']:.4f} (ppl {r['ppl']:.2f}, top1 {r['top1']:.3f})"
            f" mtp {r.get('mtp_loss', float('nan')):.4f} (top1 {r.get('mtp_top1', float('nan')):.3f}) [{dt:.1f}s]")
        if score < best["val_loss"]:
            best.update(val_loss=score, step=step,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})
        return dt

    model.train()
    if streams["val"].numel() > 1:
        run_val(0)
    kernel_check = None
    if use_fla and a.check_fla:
        t_chk = time.time()
        try:
            kernel_check = compare_gdn_paths(model, sampler.next()[:4], a.mtp_weight, amp)
            ok = (abs(kernel_check["loss_fla"] - kernel_check["loss_torch"]) < 0.02
                  and abs(kernel_check["mtp_fla"] - kernel_check["mtp_torch"]) < 0.02
                  and kernel_check["grad_rel_err"] < 0.1 and kernel_check["gdn_grad_rel_err_max"] < 0.25)
        except Exception as e:  # a kernel that fails here would fail in training too
            kernel_check, ok = {"error": repr(e)}, False
        kernel_check["ok"] = ok
        kernel_check["seconds"] = round(time.time() - t_chk, 1)
        log(f"fla vs torch GDN check (first batch, 4 rows): {json.dumps(kernel_check)}")
        if not ok:
            use_fla = False
            eval_kw["use_fla"] = False
            log("WARNING: fla kernel disagrees with the torch reference; training with torch chunked_scan")
        sampler = WindowSampler(train_stream, T + 2, T, B, a.seed)  # the check does not consume data
    if a.wall_minutes > 0:
        left = a.wall_minutes * 60.0 - (time.time() - _PROCESS_START) - reserve
        if left <= 0:
            raise ValueError(f"--wall-minutes {a.wall_minutes:g} leaves no time to train: the set-up took "
                             f"{time.time() - _PROCESS_START:.0f}s and {reserve:.0f}s are kept for the evaluation "
                             "and the save")
        if left < budget:
            log(f"wall-clock limit {a.wall_minutes:g} min: training budget cut to {left:.0f}s")
            budget = max(0.0, left)
    n_val_batches = math.ceil(eval_windows(streams["val"], T, eval_kw["max_tokens"])[0].shape[0] / B) \
        if streams["val"].numel() > 1 else 0
    t0 = time.time()
    st = {"step": 0, "total": total, "eval_every": max(1, total // a.n_evals) if total else 0,
          "stopped": "steps", "sigint": False}

    def train_loop() -> None:
        acc = torch.zeros(3, device=device)  # loss, main, mtp sums since last log
        n_acc, t_log, t_calib = 0, time.time(), None
        calib = (10, 30)
        while True:
            step, total = st["step"], st["total"]
            if total and step >= total:
                return
            if time.time() - t0 > budget:
                st["stopped"] = "time budget"
                return
            if st["sigint"]:
                st["stopped"] = INTERRUPTED
                log(f"Ctrl-C: training stops at step {step}; the weights are evaluated and written "
                    f"(Ctrl-C again aborts without writing)")
                return
            lr = lr_at(step, total or 10 ** 9, a) if total or step < a.warmup else a.lr
            for gr in opt.param_groups:
                gr["lr"] = lr
            win = sampler.next()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                o = loss_fn(model, win, a.mtp_weight, use_fla, a.dropout)
            o["loss"].backward()
            # (0: no clipping, the norm still measured; a max norm of 0 zeroed every gradient)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip if a.grad_clip > 0 else math.inf)
            opt.step()
            opt.zero_grad(set_to_none=True)
            acc += torch.stack([o["loss"].detach(), o["main"].detach(), o.get("mtp", o["main"]).detach()])
            n_acc += 1
            step = st["step"] = step + 1
            if not total and step == calib[0]:
                _sync(device)
                t_calib = time.time()
            if not total and step == calib[1]:
                _sync(device)
                per_step = (time.time() - t_calib) / (calib[1] - calib[0])
                eval_est = n_val_batches * 0.5 * per_step + 0.3  # a forward is ~1/3 of a step
                remaining = budget - (time.time() - t0) - a.n_evals * eval_est
                total = st["total"] = step + max(1, int(0.98 * remaining / per_step))
                st["eval_every"] = max(1, total // a.n_evals)
                log(f"timing: {per_step * 1000:.1f} ms/step ({B * T / per_step:,.0f} tok/s) -> {total} steps "
                    f"in the {budget:.0f}s budget ({total * B * T / train_stream.numel():.1f} epochs)")
            if step % a.log_every == 0 or step == total:
                _sync(device)
                now = time.time()
                tok_s = n_acc * B * T / (now - t_log)
                l, lm, lt = (acc / n_acc).tolist()
                history.append({"step": step, "tokens": step * B * T, "loss": l, "main_loss": lm, "mtp_loss": lt,
                                "lr": lr, "grad_norm": float(gn), "tok_s": tok_s,
                                "epoch": round(sampler.epochs_done, 3), "elapsed": round(now - t0, 1)})
                log(f"step {step:5d} tok {step * B * T:>11,d} loss {l:.4f} main {lm:.4f} mtp {lt:.4f} "
                    f"lr {lr:.2e} gn {float(gn):.2f} {tok_s:,.0f} tok/s ep {sampler.epochs_done:.2f} "
                    f"t {now - t0:.0f}s")
                acc.zero_()
                n_acc, t_log = 0, time.time()
                if not math.isfinite(l):
                    st["stopped"] = "non-finite loss"
                    return
            ee = st["eval_every"]
            if ee and step % ee == 0 and step != total and streams["val"].numel() > 1:
                run_val(step)
                t_log = time.time()

    def wrap_up() -> dict:
        """The final validation, evaluations and the write, with the Ctrl-C handler of the
        training loop still in place: a first Ctrl-C here (after the last step) lets the run
        finish and write, as one during training does; a second aborts without writing (it
        was the default handler here: one press lost the whole run)."""
        step, total, stopped = st["step"], st["total"], st["stopped"]

        def notice_ctrl_c() -> None:
            if st["sigint"] and stopped != INTERRUPTED and not st.get("told"):
                st["told"] = True
                log("Ctrl-C after the last step: the run finishes as planned and writes its checkpoint "
                    "(Ctrl-C again before the write aborts without writing)")
        _sync(device)
        train_seconds = time.time() - t0
        peak_mem = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else 0.0
        log(f"training stopped ({stopped}) after {step} steps, {step * B * T:,} tokens, {train_seconds:.1f}s"
            f"{f', peak GPU memory {peak_mem:.1f} GiB' if cuda else ''}")
        if streams["val"].numel() > 1:
            if not val_hist or val_hist[-1]["step"] != step:
                run_val(step)
            if best["step"] != step:
                log(f"restoring best val checkpoint from step {best['step']}")
                model.load_state_dict(best["state"])
        chosen_step = best["step"] if best["step"] >= 0 else step
        if step == 0:  # (a time budget spent before the first step, an error in it)
            raise TrainingFailed(f"training stopped before its first step ({stopped}): no checkpoint written to {a.out}")
        if stopped not in ("steps", "time budget"):
            log(f"training stopped early: {stopped}")
            diverged = stopped == "non-finite loss" and chosen_step == step  # no earlier validation to go back to
            if chosen_step == 0 or diverged or not all(torch.isfinite(p).all() for p in model.parameters()):
                what = "the initial weights" if chosen_step == 0 else "the weights that diverged"
                raise TrainingFailed(f"training stopped at step {step} ({stopped}) and kept only {what}: "
                                     f"no checkpoint written to {a.out}")
        round_to_bf16_(model)
        model.eval()
        final = {}
        # each split whole (--eval-max-tokens is for the validations during training), except under
        # --wall-minutes, whose reserve for the final evaluations and the write is fixed
        final_kw = {**eval_kw, "max_tokens": eval_kw["max_tokens"] if a.wall_minutes > 0 else None}
        for split in ("heldout", "val"):
            if streams[split].numel() > 1:
                notice_ctrl_c()
                final[split] = evaluate(model, streams[split], **final_kw)
                r = final[split]
                log(f"final {split} ({r['tokens']:,} tokens, bf16 weights): loss {r['loss']:.4f} ppl {r['ppl']:.2f} "
                    f"top1 {r['top1']:.4f} | mtp loss {r.get('mtp_loss', float('nan')):.4f} ppl "
                    f"{r.get('mtp_ppl', float('nan')):.2f} top1 {r.get('mtp_top1', float('nan')):.4f}")
        notice_ctrl_c()
        staged: dict = {}
        try:  # (a second Ctrl-C before the renames: nothing written, no partial file left)
            stage_checkpoint(model, cfg_dict, a.out, a.tokenizer, staged)
            out = Path(a.out)
            size = staged["model.safetensors"].stat().st_size
            train_tok_s = [h["tok_s"] for h in history[1:]] or [h["tok_s"] for h in history]
            result = {
                "git": git,
                "args": {k: v for k, v in asdict(a).items()},
                "config": cfg_dict,
                "params": n_params,
                "tensor_bytes": ckpt_bytes,
                "safetensors_bytes": size,
                "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""),
                "torch": torch.__version__,
                "gdn_kernel": "fla.chunk_gated_delta_rule" if use_fla else "torch chunked_scan_batched",
                "fla_unusable": None if use_fla else fwd.FLA_UNUSABLE_REASON,
                "kernel_check": kernel_check,
                "train_budget_s": round(budget, 1) if math.isfinite(budget) else None,
                "steps": step,
                "planned_steps": total,
                "stopped": stopped,
                "tokens_seen": step * B * T,
                "epochs": round(sampler.epochs_done, 3),
                "train_seconds": round(train_seconds, 1),
                "peak_gpu_mem_gib": round(peak_mem, 2),
                "median_tok_s": sorted(train_tok_s)[len(train_tok_s) // 2] if train_tok_s else None,
                "chosen_step": chosen_step,
                "data_tokens": {k: int(v.numel()) for k, v in streams.items()},
                "log": history,
                "val": val_hist,
                "final": final,
                "total_seconds": round(time.time() - t_start, 1),
            }
            staged["train_log.json"] = out / ".train_log.json.partial"
            try:
                staged["train_log.json"].write_text(json.dumps(finite_json(result), indent=1, allow_nan=False) + "\n")
            except OSError as e:  # (a full disk: "[Errno 28] No space left on device" named no file)
                raise OSError(f"cannot write {out / 'train_log.json'}: {e.strerror or e}") from None
            # (the weights and their log together, or neither; a Ctrl-C during the renames came after
            # everything was written: dropped, not an "interrupted" run whose checkpoint was replaced)
            commit_checkpoint(out, staged, late_ctrl_c=False)
        except BaseException:
            discard_staged(staged)
            raise
        notice_ctrl_c()
        log(f"wrote {out} (model.safetensors {size:,} bytes; {n_params:,} params) in {result['total_seconds']}s total")
        return result

    with stop_on_ctrl_c(st):  # (a first Ctrl-C stops at the next step; a second aborts)
        try:
            train_loop()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # keep what was learnt so far (checked below)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            st["stopped"] = f"error: {type(e).__name__}: {first}"[:300]
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
        return wrap_up()
