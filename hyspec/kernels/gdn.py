"""Gated DeltaNet recurrent step(s) for decode / verify, plus the causal conv1d update.

The recurrence (per value head h, key head h // r with r = Hv // Hk; S is [Dk, Dv] fp32)::

    S = S * exp(g[h])                 # log decay g <= 0
    delta = (v[h] - k^T S) * beta[h]  # (k^T S)[j] = sum_i k[i] S[i, j]     -> [Dv]
    S = S + k (outer) delta
    o[h] = (scale * q)^T S                                                  -> [Dv]

q and k arrive already l2-normalised (q NOT yet scaled: ``scale`` is applied here, as
``q * scale`` before the product, the order transformers' ``torch_recurrent_gated_delta_rule``
uses).  All math is fp32; o is cast to v.dtype.

Row invariance: the Triton kernel scans the T rows one after another with identical code
per row, so row r's output and state do not depend on T -- a t-row verify equals t
1-row decode steps bitwise (the state round-trips through fp32 memory losslessly).
``states`` (optional) receives the state after every row: the per-row checkpoints a
speculative rollback restores from.

Glossary: T rows (tokens), Hk key heads, Hv value heads, Dk key dim, Dv value dim,
C conv channels, W conv width.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = [
    "gdn_recurrent_ref",
    "gdn_recurrent",
    "conv_update_ref",
    "conv_update",
]


def _check_gdn(q, k, v, g, beta, state):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"gdn: want q, k [T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, Hk, Dk = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"gdn: want v [T={T}, Hv, Dv], got {tuple(v.shape)}")
    Hv, Dv = v.shape[1], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"gdn: value heads Hv={Hv} not a multiple of key heads Hk={Hk}")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"gdn: want g, beta [T={T}, Hv={Hv}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    if state.shape != (Hv, Dk, Dv) or state.dtype != torch.float32:
        raise ValueError(f"gdn: want state [Hv={Hv}, Dk={Dk}, Dv={Dv}] float32, got {tuple(state.shape)} {state.dtype}")
    return T, Hk, Dk, Hv, Dv


def gdn_recurrent_ref(
    q: torch.Tensor,  # [T, Hk, Dk], l2-normalised
    k: torch.Tensor,  # [T, Hk, Dk], l2-normalised
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32, not modified
    *,
    scale: float,
    return_states: bool = False,
):
    """Plain-torch reference.  Returns ``(o [T, Hv, Dv] in v.dtype, final_state [Hv, Dk, Dv]
    fp32 (a new tensor), states [T, Hv, Dk, Dv] fp32 or None)``; ``states[t]`` is the state
    after row t, so ``states[-1] == final_state``."""
    T, Hk, Dk, Hv, Dv = _check_gdn(q, k, v, g, beta, state)
    r = Hv // Hk
    # head h reads key head h // r: repeat each key head r times along the head axis
    qf = q.float().repeat_interleave(r, dim=1) * scale  # [T, Hv, Dk]
    kf = k.float().repeat_interleave(r, dim=1)  # [T, Hv, Dk]
    vf, gf, bf = v.float(), g.float(), beta.float()
    S = state.clone()
    o = torch.empty((T, Hv, Dv), dtype=torch.float32, device=v.device)
    states = torch.empty((T, Hv, Dk, Dv), dtype=torch.float32, device=v.device) if return_states else None
    for t in range(T):
        S = S * gf[t].exp()[:, None, None]
        kS = (kf[t][:, :, None] * S).sum(1)  # [Hv, Dv]
        delta = (vf[t] - kS) * bf[t][:, None]
        S = S + kf[t][:, :, None] * delta[:, None, :]
        o[t] = (qf[t][:, :, None] * S).sum(1)
        if states is not None:
            states[t] = S
    return o.to(v.dtype), S, states


def conv_update_ref(
    x: torch.Tensor,  # [T, C]
    conv_state: torch.Tensor,  # [C, W-1]: the last W-1 inputs, oldest first; not modified
    weight: torch.Tensor,  # [C, W]
):
    """Causal depthwise conv1d over T new rows with carried state, then SiLU.

    ``y[t, c] = silu(sum_j weight[c, j] * xx[c, t + j])`` with ``xx = cat(conv_state, x.T)``
    (length W-1+T).  Returns ``(y [T, C] in x.dtype, new_state [C, W-1] = xx[:, -(W-1):]``
    in conv_state.dtype).  fp32 math, taps summed j = 0..W-1 in order."""
    T, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape != (C, W - 1):
        raise ValueError(f"conv_update: want weight [C={C}, W] and conv_state [C, W-1], got "
                         f"{tuple(weight.shape)} and {tuple(conv_state.shape)}")
    xx = torch.cat([conv_state.float(), x.float().t()], dim=1)  # [C, W-1+T]
    wf = weight.float()
    acc = torch.zeros((C, T), dtype=torch.float32, device=x.device)
    for j in range(W):
        acc = acc + wf[:, j : j + 1] * xx[:, j : j + T]
    y = F.silu(acc).t().to(x.dtype)
    return y, xx[:, T:].to(conv_state.dtype).contiguous()


# --------------------------------------------------------------------------------------
# Triton kernels (lazy)
# --------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def _gdn_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s0_ptr, o_ptr, sf_ptr, st_ptr,
        T, Dk, Dv, R, scale,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
        s0_h, s0_k, sf_h, sf_k, so_t, so_h, st_t, st_h, st_k,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, STORE_STATES: tl.constexpr,
    ):
        # one program per (Dv block, value head); the state tile [BLOCK_K, BLOCK_V] lives in
        # registers for the whole scan.  Last dims of q/k/v/o/states are contiguous (stride 1).
        pid_v = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // R
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mk = offs_k < Dk
        mv = offs_v < Dv
        m2 = mk[:, None] & mv[None, :]
        S = tl.load(s0_ptr + h * s0_h + offs_k[:, None] * s0_k + offs_v[None, :], mask=m2, other=0.0)
        S = S.to(tl.float32)
        # row t+1's inputs are loaded before row t is computed, so their memory latency
        # overlaps the math (a plain loop would wait on every row's loads in turn)
        zk = tl.zeros_like(offs_k)
        zv = tl.zeros_like(offs_v)
        qn = tl.load(q_ptr + hk * sq_h + offs_k, mask=mk, other=0.0)
        kn = tl.load(k_ptr + hk * sk_h + offs_k, mask=mk, other=0.0)
        vn = tl.load(v_ptr + h * sv_h + offs_v, mask=mv, other=0.0)
        gn = tl.load(g_ptr + h * sg_h)
        bn = tl.load(b_ptr + h * sb_h)
        for t in range(T):
            qv = qn.to(tl.float32) * scale
            kv = kn.to(tl.float32)
            vv = vn.to(tl.float32)
            gt = gn.to(tl.float32)
            bt = bn.to(tl.float32)
            nx = t + 1
            more_k = (zk + nx) < T
            more_v = (zv + nx) < T
            nx_s = tl.minimum(nx, T - 1)  # a valid row for the scalar loads of the last step
            qn = tl.load(q_ptr + nx * sq_t + hk * sq_h + offs_k, mask=mk & more_k, other=0.0)
            kn = tl.load(k_ptr + nx * sk_t + hk * sk_h + offs_k, mask=mk & more_k, other=0.0)
            vn = tl.load(v_ptr + nx * sv_t + h * sv_h + offs_v, mask=mv & more_v, other=0.0)
            gn = tl.load(g_ptr + nx_s * sg_t + h * sg_h)
            bn = tl.load(b_ptr + nx_s * sb_t + h * sb_h)
            S = S * tl.exp(gt)
            kS = tl.sum(kv[:, None] * S, axis=0)  # [BLOCK_V]
            delta = (vv - kS) * bt
            S = S + kv[:, None] * delta[None, :]
            ov = tl.sum(qv[:, None] * S, axis=0)
            tl.store(o_ptr + t * so_t + h * so_h + offs_v, ov.to(o_ptr.dtype.element_ty), mask=mv)
            if STORE_STATES:
                tl.store(st_ptr + t * st_t + h * st_h + offs_k[:, None] * st_k + offs_v[None, :], S, mask=m2)
        tl.store(sf_ptr + h * sf_h + offs_k[:, None] * sf_k + offs_v[None, :], S, mask=m2)

    @triton.jit(do_not_specialize=["T"])
    def _conv_kernel(
        x_ptr, s_ptr, w_ptr, y_ptr, ns_ptr,
        T, C,
        sx_t, ss_c, sw_c, sy_t, sns_c,
        W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        # one program per BLOCK_C channels; rows scanned in order, taps summed j = 0..W-1.
        # xx[c, p] = conv_state[c, p] for p < W-1, x[p-(W-1), c] otherwise.
        pid = tl.program_id(0)
        offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = offs_c < C
        for t in range(T):
            acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
            for j in tl.static_range(W):
                p = t + j  # position in xx
                i = tl.zeros_like(offs_c) + (p - (W - 1))  # row of x (negative: from the state)
                xs = tl.load(x_ptr + i * sx_t + offs_c, mask=mc & (i >= 0), other=0.0).to(tl.float32)
                ss = tl.load(s_ptr + offs_c * ss_c + (i + (W - 1)), mask=mc & (i < 0), other=0.0).to(tl.float32)
                wj = tl.load(w_ptr + offs_c * sw_c + j, mask=mc, other=0.0).to(tl.float32)
                acc += wj * (xs + ss)  # one of xs, ss is an exact 0
            y = acc * tl.sigmoid(acc)
            tl.store(y_ptr + t * sy_t + offs_c, y.to(y_ptr.dtype.element_ty), mask=mc)
        # new state [C, W-1] = xx[:, T : T+W-1]
        offs_w = tl.arange(0, BLOCK_W)
        mw = offs_w < (W - 1)
        p2 = T + offs_w[None, :]
        i2 = p2 - (W - 1)
        m2 = mc[:, None] & mw[None, :]
        xs = tl.load(x_ptr + i2 * sx_t + offs_c[:, None], mask=m2 & (i2 >= 0), other=0.0)
        ss = tl.load(s_ptr + offs_c[:, None] * ss_c + p2, mask=m2 & (i2 < 0), other=0.0)
        ns = xs.to(tl.float32) + ss.to(tl.float32)
        tl.store(ns_ptr + offs_c[:, None] * sns_c + offs_w[None, :], ns.to(ns_ptr.dtype.element_ty), mask=m2)

    return _gdn_kernel, _conv_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _lastdim_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_recurrent(
    q: torch.Tensor,  # [T, Hk, Dk], l2-normalised
    k: torch.Tensor,  # [T, Hk, Dk], l2-normalised
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32, read only (unless final_state is state)
    *,
    scale: float,
    return_states: bool = False,
    final_state: torch.Tensor | None = None,  # [Hv, Dk, Dv] fp32 output; may BE `state`
    states: torch.Tensor | None = None,  # [T, Hv, Dk, Dv] fp32 output for per-row states
    out: torch.Tensor | None = None,  # [T, Hv, Dv] v.dtype output
    block_v: int | None = None,
    num_warps: int = 4,
):
    """Triton version of :func:`gdn_recurrent_ref`, same return ``(o, final_state, states)``.

    Outputs: ``final_state`` is written into the given tensor, else a new one; passing
    ``final_state=state`` updates the state in place (safe: each program reads its own
    [Dk, BLOCK_V] slice once before the scan and writes it back at the end).  Per-row states
    are written when ``states`` is given or ``return_states`` is true (``states[t]`` = state
    after row t); otherwise the third return value is None.  q/k/v may be strided views
    (e.g. slices of a projection output) as long as their last dim is contiguous.
    Supports Dk, Dv <= 256 (any size: blocks are powers of two with masks).
    """
    T, Hk, Dk, Hv, Dv = _check_gdn(q, k, v, g, beta, state)
    if Dk > 256 or Dv > 256:
        raise ValueError(f"gdn_recurrent: Dk={Dk}, Dv={Dv}; at most 256 supported")
    q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
    if state.stride(-1) != 1:
        raise ValueError("gdn_recurrent: state's last dim must be contiguous")
    dev = v.device
    if final_state is None:
        final_state = torch.empty((Hv, Dk, Dv), dtype=torch.float32, device=dev)
    elif final_state.shape != (Hv, Dk, Dv) or final_state.dtype != torch.float32 or final_state.stride(-1) != 1:
        raise ValueError(f"gdn_recurrent: final_state must be [{Hv}, {Dk}, {Dv}] float32, last dim contiguous")
    if states is None and return_states:
        states = torch.empty((T, Hv, Dk, Dv), dtype=torch.float32, device=dev)
    if states is not None and (states.shape != (T, Hv, Dk, Dv) or states.dtype != torch.float32
                               or states.stride(-1) != 1):
        raise ValueError(f"gdn_recurrent: states must be [{T}, {Hv}, {Dk}, {Dv}] float32, last dim contiguous, "
                         f"got {tuple(states.shape)} {states.dtype}")
    if out is None:
        out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=dev)
    elif out.shape != (T, Hv, Dv) or out.stride(-1) != 1:
        raise ValueError(f"gdn_recurrent: out must be [{T}, {Hv}, {Dv}], last dim contiguous")
    if T == 0:
        if final_state.data_ptr() != state.data_ptr():
            final_state.copy_(state)
        return out, final_state, states
    BLOCK_K = max(16, _next_pow2(Dk))
    if block_v is None:
        # ~4096 fp32 state values per program: Dk=128 -> BLOCK_V=32 -> Hv*Dv/32 programs
        block_v = min(max(16, _next_pow2(Dv)), max(16, 4096 // BLOCK_K))
    st = states if states is not None else final_state  # placeholder pointer when unused
    st_strides = (states.stride(0), states.stride(1), states.stride(2)) if states is not None else (0, 0, 0)
    gdn_kernel, _ = _kernels()
    grid = (-(-Dv // block_v), Hv)
    gdn_kernel[grid](
        q, k, v, g, beta, state, out, final_state, st,
        T, Dk, Dv, Hv // Hk, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), final_state.stride(0), final_state.stride(1),
        out.stride(0), out.stride(1), *st_strides,
        BLOCK_K=BLOCK_K, BLOCK_V=block_v, STORE_STATES=states is not None,
        num_warps=num_warps,
    )
    return out, final_state, states


def conv_update(
    x: torch.Tensor,  # [T, C]
    conv_state: torch.Tensor,  # [C, W-1], read only
    weight: torch.Tensor,  # [C, W]
    *,
    out: torch.Tensor | None = None,  # [T, C] x.dtype
    new_state: torch.Tensor | None = None,  # [C, W-1]; must NOT alias conv_state
    block_c: int = 256,
):
    """Triton version of :func:`conv_update_ref`; returns ``(y, new_state)``.

    ``new_state`` is written into the given tensor (else a new one, conv_state.dtype); it
    must not overlap ``conv_state`` (other threads of a program may still read the old
    state).  To update in place, pass a scratch tensor and copy it back, or ping-pong two
    buffers.  Rows are scanned in order with the taps summed j = 0..W-1, so row r does not
    depend on T."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"conv_update: want x [T, C], weight [C, W], got {tuple(x.shape)}, {tuple(weight.shape)}")
    T, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape != (C, W - 1) or W < 2:
        raise ValueError(f"conv_update: want weight [C={C}, W>=2] and conv_state [C, W-1], got "
                         f"{tuple(weight.shape)} and {tuple(conv_state.shape)}")
    x = _lastdim_contig(x)
    if conv_state.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("conv_update: conv_state and weight need a contiguous last dim")
    if out is None:
        out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    elif out.shape != (T, C) or out.stride(-1) != 1:
        raise ValueError(f"conv_update: out must be [{T}, {C}], last dim contiguous")
    if new_state is None:
        new_state = torch.empty((C, W - 1), dtype=conv_state.dtype, device=x.device)
    elif new_state.shape != (C, W - 1) or new_state.stride(-1) != 1:
        raise ValueError(f"conv_update: new_state must be [{C}, {W - 1}], last dim contiguous")
    if new_state.data_ptr() == conv_state.data_ptr():
        raise ValueError("conv_update: new_state must not alias conv_state")
    if T == 0:
        new_state.copy_(conv_state)
        return out, new_state
    _, conv_kernel = _kernels()
    conv_kernel[(-(-C // block_c),)](
        x, conv_state, weight, out, new_state,
        T, C,
        x.stride(0), conv_state.stride(0), weight.stride(0), out.stride(0), new_state.stride(0),
        W=W, BLOCK_C=block_c, BLOCK_W=max(2, _next_pow2(W - 1)),
        num_warps=4,
    )
    return out, new_state
