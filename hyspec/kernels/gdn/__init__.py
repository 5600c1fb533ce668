"""Gated-DeltaNet token mixing for decode / verify: the causal conv, the fused step (scan +
gated norm), the commit replay.

Contract (T rows, Hk/Hv key/value heads, Dk/Dv their dims, C = 2*Hk*Dk + Hv*Dv conv
channels, W conv width)::

    gdn_conv(x [T, >=C], state [W-1, C], weight [C, W], y [T, C], rows=T, update, xin=None)
        y[r] = silu(sum_j w[:, j] * win[r + j]), win = cat(state, x) (row-major window),
        accumulated in the input dtype like the model's conv; update=True: the window
        is advanced in place (decode); else xin receives the new rows (verify, for a
        later commit)
    gdn_step(y [T, C], proj [T, C + Hv*Dv + 2*Hv], A_log, dt_bias, norm_w, state [Hv, Dk, Dv] fp32,
             out [T, Hv*Dv], nk, nv, dk, dv, eps, rows=T, states=None, keep_state=False)
        l2norm(q, k), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the
        delta-rule scan row by row, then the gated RMSNorm norm_w * rmsnorm(o) * silu(z);
        the state after every row goes to ``states`` (verify), or nowhere (keep_state:
        the commit replays), or into ``state`` in place (decode)
    gdn_replay(y_rows [G, t, C], p_rows [G, t, P], A_log_all [G, Hv], dt_bias_all, norm_w,
               ssm [G, Hv, Dk, Dv], n [1], out_like, ...)
        advance every layer's state by rows 0..n, in one launch, with gdn_step's kernel
    gdn_window_commit(conv [G, S, W-1, C], conv_in [G, >= nb*t, C], j [nb], nb, t)
        after a verify of t rows per lane: lane b's window becomes rows j[b] .. j[b]+W-2 of
        cat(window, its t new rows), every layer and lane in one launch (copies only)

The first three take ``lanes``: rows // lanes rows per sequence (lane-major), each lane
with its own window / state (the window commit takes the lane count ``nb``).  One compiled step kernel serves decode, verify and replay (every
flag and stride is a runtime argument), so the states are bitwise the same whichever ran
them; the row count and the flags are ``do_not_specialize``.  ``block_v`` < Dv splits a
head's Dv over several programs and moves the gated norm into its own kernel
(``gated_norm``); it must not be chosen from the row count.  The kernel reduces the
state once per row (k.S and q.S of the state before the row together, the output as
``e * q.S + (q.k) delta``): the reference's arithmetic in another order, equal within
rounding (tests/test_op_gdn.py); ``STEP_LAUNCH["one_reduction"] = False`` runs the
reference's order (an ablation).

Files: ``kernel.py`` (Triton kernels + launchers), ``reference.py`` (torch).
"""
from hyspec.kernels.gdn.kernel import gdn_conv, gdn_replay, gdn_step, gdn_window_commit
from hyspec.kernels.gdn.reference import gdn_conv_ref, gdn_step_ref, gdn_window_commit_ref

__all__ = ["gdn_conv", "gdn_conv_ref", "gdn_step", "gdn_step_ref", "gdn_replay", "gdn_window_commit",
           "gdn_window_commit_ref"]
