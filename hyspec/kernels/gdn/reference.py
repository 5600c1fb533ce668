"""Torch references of :func:`hyspec.kernels.gdn.gdn_conv` and
:func:`~hyspec.kernels.gdn.gdn_step` (whose kernel :func:`~hyspec.kernels.gdn.gdn_replay`
re-runs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gdn_conv_ref", "gdn_step_ref", "gdn_window_commit_ref"]


def gdn_conv_ref(x, state, weight):
    """x [T, C] new conv inputs, state [W-1, C] (row-major window), weight [C, W].
    y[r] = silu(sum_j w[:, j] * win[r + j]) with win = cat(state, x), accumulated in
    x.dtype like the model's conv. Returns (y [T, C], new state [W-1, C])."""
    W = weight.shape[1]
    T = x.shape[0]
    win = torch.cat([state.to(x.dtype), x])
    w = weight.to(x.dtype)
    y = win[0:T] * w[:, 0]
    for i in range(1, W):
        y = y + win[i : i + T] * w[:, i]
    return F.silu(y), win[T:].clone()


def gdn_step_ref(y, proj, A_log, dt_bias, norm_w, state, *, nk, nv, dk, dv, eps, return_states=False):
    """Fused Gated-DeltaNet step over T rows.

    y [T, C] conv output (q | k | v), proj [T, C + Hv*Dv + 2*Hv] (its z | b | a columns
    after the first C), state [Hv, Dk, Dv] fp32 (not modified), or bf16 / fp16: then it is
    computed in fp32 and rounded to its dtype after every row (the row's output reads it
    before rounding).  Returns (o [T, Hv*Dv] gated-normed in y.dtype, final state,
    states [T, Hv, Dk, Dv] or None), the states in the state's dtype."""
    T = y.shape[0]
    kd, vd = nk * dk, nv * dv
    C = 2 * kd + vd
    r = nv // nk
    store = state.dtype
    sd = torch.float64 if store == torch.float64 else torch.float32
    q = y[:, :kd].reshape(T, nk, dk).to(sd)
    k = y[:, kd : 2 * kd].reshape(T, nk, dk).to(sd)
    v = y[:, 2 * kd : C].reshape(T, nv, dv).to(sd)
    z = proj[:, C : C + vd].reshape(T, nv, dv)
    b = proj[:, C + vd : C + vd + nv].to(sd)
    a = proj[:, C + vd + nv : C + vd + 2 * nv].to(sd)

    def l2(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    # every per-row quantity is computed on that row alone: torch's CPU kernels pick
    # vector or scalar code (other last bits for exp, softplus, sums) from the tensor's
    # whole size, so on some CPUs a row's bits would otherwise depend on T
    S = state.to(sd, copy=True)
    o = torch.empty(T, nv, dv, dtype=sd, device=y.device)
    states = torch.empty(T, nv, dk, dv, dtype=store, device=y.device) if return_states else None
    dt = y.dtype
    out = torch.empty(T, nv, dv, dtype=dt, device=y.device)
    decay = -A_log.to(sd).exp()
    for t in range(T):
        qt = l2(q[t]).repeat_interleave(r, 0) * dk ** -0.5
        kt = l2(k[t]).repeat_interleave(r, 0)
        beta = torch.sigmoid(b[t])
        g = decay * F.softplus(a[t] + dt_bias.to(sd))
        S = S * g.exp()[:, None, None]
        kS = (S * kt[:, :, None]).sum(-2)
        delta = (v[t] - kS) * beta[:, None]
        S = S + kt[:, :, None] * delta[:, None, :]
        o[t] = (S * qt[:, :, None]).sum(-2)
        S = S.to(store).to(sd)  # a no-op for an fp32 state
        if states is not None:
            states[t] = S
        of = o[t].to(dt).float()
        xhat = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
        yv = norm_w.to(dt) * xhat.to(dt)
        out[t] = (yv * F.silu(z[t].float())).to(dt)
    return out.reshape(T, vd), S.to(store), states


def gdn_window_commit_ref(conv, conv_in, j, nb: int, t: int):
    """After a verify of t rows per lane: each lane's conv window becomes the W-1 rows after
    its first j[b] rows of cat(window, the verify's t new rows), in place.  conv [G, S,
    W-1, C] (lanes' windows), conv_in [G, >= nb*t, C] (lane b's rows at b*t ..), j [nb]
    (1 .. t: the rows the lane keeps)."""
    G, C = conv.shape[0], conv.shape[-1]
    W1 = conv.shape[2]
    window = torch.cat([conv[:, :nb], conv_in[:, : nb * t].view(G, nb, t, C)], 2)
    offs = torch.arange(W1, device=conv.device)
    idx = (j[:, None] + offs[None, :])[None, :, :, None].expand(G, nb, W1, C)
    conv[:, :nb].copy_(window.gather(2, idx))
    return conv
