"""Gated DeltaNet: the linear-attention layer of Qwen3-Next / Qwen3.5.

Per token, per value head h (key head h // r, r = Hv / Hk), with state S [Dk, Dv]:
    S <- S * exp(g_h)                 decay (g <= 0, in log space)
    delta = (v_h - k^T S) * beta_h    what the state fails to predict, scaled
    S <- S + k (outer) delta          delta-rule write
    o_h = q^T S                       read (q already scaled by Dk^-0.5)
The state is computed in fp32 (fp64 for fp64 models) and stored in fp32 too, unless the
config asks for another storage dtype (`mamba_ssm_dtype`, e.g. bfloat16: half the state's
bytes): then the state is rounded to it after every row, as a one-row decode step that
writes it back would, so a T-row scan still equals T one-row steps. Two forms live here: a
row-by-row scan (decode / verify; can also return the state after every row for rollback)
and a chunked form (prefill; a WY/UT-transform over chunks of 64 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyspec.config import ModelConfig
from hyspec.model.ops import GatedRMSNorm, Linear, StepCtx, acc_dtype, row_reduce, sigmoid, silu, softplus


state_dtype = acc_dtype  # the recurrent state is computed at the accumulation precision


def ssm_store_dtype(cfg: ModelConfig | str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype a model of `dtype` stores its Gated DeltaNet state in: the config's
    `mamba_ssm_dtype` (or that name itself) when set, else the accumulation dtype."""
    name = cfg.mamba_ssm_dtype if isinstance(cfg, ModelConfig) else cfg
    return state_dtype(dtype) if name is None else getattr(torch, name)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(row_reduce(x, _sum_square) + eps)


def _sum_square(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------
# Recurrence: reference forms (plain torch). Inputs are already preprocessed:
#   q, k [T, Hv, Dk] (l2-normed, expanded to value heads; q scaled), v [T, Hv, Dv],
#   g, beta [T, Hv]; all in the state dtype.
# ---------------------------------------------------------------------------------------
def recurrent_scan(q, k, v, g, beta, state, want_states: bool = False):
    """Row-by-row scan. state [Hv, Dk, Dv] (not modified), stored in its own dtype and
    computed in q's. Returns (o [T, Hv, Dv], final state, per-row states [T, Hv, Dk, Dv] or
    None), the states in the storage dtype. Row r's arithmetic does not depend on T, so a
    T-row scan equals T one-row scans bit for bit: with a narrower storage dtype the state
    is rounded to it after every row (a row's output reads the state before rounding)."""
    T = q.shape[0]
    store = state.dtype
    S = state.to(q.dtype)
    outs, states = [], []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        kv_mem = (S * k[t][:, :, None]).sum(-2)  # [Hv, Dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append((S * q[t][:, :, None]).sum(-2))
        if store != q.dtype:
            S = S.to(store).to(q.dtype)
        if want_states:
            states.append(S.to(store))
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return o, S.to(store), (torch.stack(states) if want_states else None)


def chunked_scan(q, k, v, g, beta, state, chunk: int = 64):
    """Same result as recurrent_scan (up to rounding), computed chunk by chunk.

    Shapes as recurrent_scan, optionally with leading batch dims (q [B, T, Hv, Dk], state
    [B, Hv, Dk, Dv], ...); autograd-friendly (no in-place writes), so training uses it too.

    Within a chunk of C rows, the delta rule's sequential writes are solved at once: with
    cumulative decays G_i = sum_{s<=i} g_s, the "effective" values u satisfy the unit
    lower-triangular system (I + A) u = beta*(v - decayed reads of the incoming state),
    A[i, j] = beta_i * exp(G_i - G_j) * k_i . k_j for j < i. Then outputs are the incoming
    state read by the decayed queries plus causal intra-chunk attention over u."""
    if k.dim() == 3:  # one sequence
        o, S = chunked_scan(q[None], k[None], v[None], g[None], beta[None], state[None], chunk)
        return o[0], S[0]
    B, T, Hv, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, n, chunk, Hv, -1).transpose(2, 3) for x in (q, k, v))  # [B, n, Hv, C, D]
    g, beta = (x.reshape(B, n, chunk, Hv).transpose(2, 3) for x in (g, beta))  # [B, n, Hv, C]
    G = g.cumsum(-1)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(0)  # j >= i masked
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # j > i masked
    decay = G[..., :, None] - G[..., None, :]  # [B, n, Hv, C, C] log decay from j to i
    A = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay.masked_fill(strict, float("-inf")).exp()
    L = torch.eye(chunk, dtype=q.dtype, device=q.device) + A  # unit lower triangular
    # keys that read the incoming state are decayed from the chunk start
    u0 = torch.linalg.solve_triangular(L, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(L, k * (beta * G.exp())[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay.masked_fill(causal, float("-inf")).exp()  # [B, n, Hv, C, C]
    q_dec = q * G.exp()[..., None]
    k_tail_t = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # decayed to chunk end
    chunk_decay = G[..., -1].exp()[..., None, None]  # [B, n, Hv, 1, 1]
    store = state.dtype  # a narrower storage dtype: read up, the final state rounded once
    S = state.to(q.dtype)
    outs = []
    for c in range(n):
        u = u0[:, c] - w[:, c] @ S  # [B, Hv, C, Dv]
        outs.append(q_dec[:, c] @ S + qk[:, c] @ u)
        S = S * chunk_decay[:, c] + k_tail_t[:, c] @ u
    o = torch.stack(outs, 1)  # [B, n, Hv, C, Dv]
    return o.transpose(2, 3).reshape(B, n * chunk, Hv, Dv)[:, :T], S.to(store)


# ---------------------------------------------------------------------------------------
@dataclass
class GdnRecord:
    """What a verify forward keeps so a linear layer can be rolled back to any row.

    xcat [W-1+T, C]: the conv window before the forward followed by the T new conv
    inputs; the conv state after row r is xcat[r+1 : r+W].
    states [T, Hv, Dk, Dv] (record="states"): SSM state after each row.
    inputs (record="inputs"): the preprocessed recurrence inputs (q, k, v, g, beta) to
    re-scan the first rows from the snapshot state."""

    xcat: torch.Tensor
    states: torch.Tensor | None = None
    inputs: tuple[torch.Tensor, ...] | None = None

    def nbytes(self) -> int:
        n = self.xcat.numel() * self.xcat.element_size()
        if self.states is not None:
            n += self.states.numel() * self.states.element_size()
        if self.inputs is not None:
            n += sum(t.numel() * t.element_size() for t in self.inputs)
        return n


class LinearState:
    """Conv window [W-1, C] (model dtype) and SSM state [Hv, Dk, Dv] (ssm_store_dtype) of one layer."""

    def __init__(self, cfg: ModelConfig, device, dtype) -> None:
        W = cfg.linear_conv_kernel_dim
        self.conv = torch.zeros(W - 1, cfg.conv_dim, device=device, dtype=dtype)
        self.ssm = torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                               cfg.linear_value_head_dim, device=device, dtype=ssm_store_dtype(cfg, dtype))
        self.record: GdnRecord | None = None


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.family = cfg.family
        self.ssm_dtype = cfg.mamba_ssm_dtype  # storage dtype of the state (None: accumulation dtype)
        H = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.W = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        if self.family == "qwen3_next":
            # grouped per key head: [q dk | k dk | v r*dv | z r*dv] and [b r | a r]
            self.in_proj_qkvz = Linear(H, 2 * key_dim + 2 * value_dim)
            self.in_proj_ba = Linear(H, 2 * self.nv)
        else:
            self.in_proj_qkv = Linear(H, 2 * key_dim + value_dim)
            self.in_proj_z = Linear(H, value_dim)
            self.in_proj_b = Linear(H, self.nv)
            self.in_proj_a = Linear(H, self.nv)
        conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Module()  # keeps the checkpoint name conv1d.weight [C, 1, W]
        self.conv1d.weight = nn.Parameter(torch.empty(conv_dim, 1, self.W))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, H)

    # -- projections ----------------------------------------------------------------
    def project(self, x: torch.Tensor, ctx: StepCtx):
        """x [T, H] -> qkv [T, C] (conv input, order q|k|v), z [T, Hv, Dv], b, a [T, Hv]."""
        T = x.shape[0]
        if self.family == "qwen3_next":
            r = self.nv // self.nk
            qkvz = self.in_proj_qkvz(x, ctx).view(T, self.nk, 2 * self.dk + 2 * r * self.dv)
            q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            ba = self.in_proj_ba(x, ctx).view(T, self.nk, 2 * r)
            b, a = ba[..., :r].reshape(T, self.nv), ba[..., r:].reshape(T, self.nv)
            qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
            z = z.reshape(T, self.nv, self.dv)
        else:
            qkv = self.in_proj_qkv(x, ctx)
            z = self.in_proj_z(x, ctx).view(T, self.nv, self.dv)
            b, a = self.in_proj_b(x, ctx), self.in_proj_a(x, ctx)
        return qkv, z, b, a

    def conv(self, xcat: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU. xcat [W-1+T, C] -> [T, C]; each output row is the
        same fixed sum over the window whatever T is."""
        w = self.conv1d.weight[:, 0, :].to(xcat.dtype)  # [C, W]
        T = xcat.shape[0] - (self.W - 1)
        y = xcat[0:T] * w[:, 0]
        for i in range(1, self.W):
            y = y + xcat[i : i + T] * w[:, i]
        return silu(y)

    def prepare(self, y: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Conv output [T, C] + b, a -> recurrence inputs in the state dtype:
        q, k [T, Hv, Dk] (l2-normed, expanded over value heads, q scaled), v [T, Hv, Dv], g, beta [T, Hv]."""
        T = y.shape[0]
        sd = state_dtype(y.dtype)
        kd = self.nk * self.dk
        q = y[:, :kd].reshape(T, self.nk, self.dk).to(sd)
        k = y[:, kd : 2 * kd].reshape(T, self.nk, self.dk).to(sd)
        v = y[:, 2 * kd :].reshape(T, self.nv, self.dv).to(sd)
        r = self.nv // self.nk
        q = l2norm(q).repeat_interleave(r, dim=1) * self.dk ** -0.5
        k = l2norm(k).repeat_interleave(r, dim=1)
        beta = sigmoid(b.to(sd))
        g = -self.A_log.to(sd).exp() * softplus(a.to(sd) + self.dt_bias.to(sd))
        return q, k, v, g, beta

    # -- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: StepCtx, st: LinearState | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. With st, the conv window and SSM state advance by T rows."""
        return self.forward_batch(x, [ctx], [st], [x.shape[0]])

    def forward_batch(self, x: torch.Tensor, ctxs: list[StepCtx], states: list, sizes: list[int]) -> torch.Tensor:
        """Rows of several sequences stacked (x [N, H], sizes[i] rows each): the projections
        run on all rows at once, the conv and the recurrence per sequence on its own state."""
        qkv, z, b, a = self.project(x, ctxs[0])
        outs = [self._mix(*parts, ctx, st) for *parts, ctx, st in
                zip(qkv.split(sizes), b.split(sizes), a.split(sizes), ctxs, states)]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        o = self.norm(o.to(x.dtype), z)  # [N, Hv, Dv]
        return self.out_proj(o.reshape(x.shape[0], -1), ctxs[0])

    def _mix(self, qkv, b, a, ctx: StepCtx, st: LinearState | None) -> torch.Tensor:
        """One sequence's conv + recurrence: qkv [T, C], b, a [T, Hv] -> o [T, Hv, Dv]."""
        T = qkv.shape[0]
        if st is None:
            xcat = torch.cat([qkv.new_zeros(self.W - 1, qkv.shape[1]), qkv])
            s0 = qkv.new_zeros(self.nv, self.dk, self.dv, dtype=ssm_store_dtype(self.ssm_dtype, qkv.dtype))
        else:
            xcat = torch.cat([st.conv.to(qkv.dtype), qkv])  # [W-1+T, C]
            s0 = st.ssm
        y = self.conv(xcat)
        q, k, v, g, beta = self.prepare(y, b, a)
        states = None
        if ctx.chunked:
            o, s_final = chunked_scan(q, k, v, g, beta, s0)
        else:
            o, s_final, states = recurrent_scan(q, k, v, g, beta, s0, want_states=ctx.record == "states")
        if st is not None:
            st.conv = xcat[T:].clone()
            st.ssm = s_final
            if ctx.record == "states":
                st.record = GdnRecord(xcat=xcat, states=states)
            elif ctx.record == "inputs":
                # (v: its own rows; in a float32 model it is a view of y, whose whole [T, C] it kept)
                st.record = GdnRecord(xcat=xcat, inputs=(q, k, v.contiguous(), g, beta))
            else:
                st.record = None
        return o
