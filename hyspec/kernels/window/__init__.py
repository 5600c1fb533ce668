"""The penalty window's update on the device: a round's pushes in one Triton launch.

Contract::

    window_push(last_n int64 [B], length int64 [B], ring int64 [B, C], counts int32 [B, V],
                tokens int [B, m], n_valid int [B]) -> None (in place)

    per lane b, for i in 0 .. m-1 with i < n_valid[b], in order: append tokens[b, i] to
    the lane's window exactly as ``hyspec.gpu.penalties.PenaltyWindow.push_ref`` (the torch
    reference) does: the ring slot ``length % N`` of a finite window (N = last_n > 0)
    gives up its token (its count drops when the window is full and the id is in
    [0, V)), the new id is counted when N != 0 and it lies in [0, V), a finite window's
    ring keeps it, and length grows by one.

The torch form is ~30 small launches per pushed token (gathers, compares, scatter-adds);
a penalised K=3 round pushes about ten times (the drafter's scratch window, the verify
rows' counts, the commit), ~300 launches inside the graphs. Here one program per lane
walks its m tokens: the counts move by integer atomic adds (order-free), the ring's store
is followed by a barrier before the next token's load of a possibly equal slot. Integer
arithmetic only: the same counts and ring as the reference on every device.
"""
from hyspec.kernels.window.kernel import window_push

__all__ = ["window_push"]
