"""Shared check for hyspec.kernels.fused.gdn_replay (CPU interpreter and CUDA tests)."""
import torch

from hyspec.kernels import fused


def _replay_case(dev="cpu", dtype=torch.float32, G=3, T=4, nk=2, nv=4, dk=16, dv=16, block_v=None):
    C = 2 * nk * dk + nv * dv
    P = C + nv * dv + 2 * nv
    g = torch.Generator(device=dev).manual_seed(11)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    y_rows, p_rows = r(G, T, C), r(G, T, P)
    A_all = torch.rand(G, nv, generator=g, device=dev).mul(3).add(0.1).log()
    dtb_all = torch.randn(G, nv, generator=g, device=dev)
    nw = (torch.randn(dv, generator=g, device=dev) * 0.1 + 1).to(dtype)
    ssm0 = torch.randn(G, nv, dk, dv, generator=g, device=dev) * 0.1
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6, block_v=block_v)
    return y_rows, p_rows, A_all, dtb_all, nw, ssm0, kw


def check_replay_equals_recorded_states(dev="cpu", dtype=torch.float32, block_v=None):
    """gdn_replay (the commit of a verify) leaves every layer's state bitwise equal to the
    state the verify's own rows reach (mode 2 records them) and to n+1 decode steps; a
    verify with keep_state writes nothing and gives the same output."""
    y_rows, p_rows, A_all, dtb_all, nw, ssm0, kw = _replay_case(dev, dtype, block_v=block_v)
    G, T = y_rows.shape[:2]
    nv, dv = kw["nv"], kw["dv"]
    recorded, outs = [], []
    for gi in range(G):
        st = torch.empty(T, *ssm0.shape[1:], device=dev)
        o = torch.empty(T, nv * dv, device=dev, dtype=dtype)
        fused.gdn_step(y_rows[gi], p_rows[gi], A_all[gi], dtb_all[gi], nw, ssm0[gi], o, rows=T, states=st, **kw)
        recorded.append(st)
        outs.append(o)
        keep = ssm0[gi].clone()
        o_keep = torch.empty_like(o)
        fused.gdn_step(y_rows[gi], p_rows[gi], A_all[gi], dtb_all[gi], nw, keep, o_keep, rows=T,
                       keep_state=True, **kw)
        assert torch.equal(keep, ssm0[gi]) and torch.equal(o_keep, o)
        S = ssm0[gi].clone()  # decode steps, state in place
        for r in range(T):
            o1 = torch.empty(1, nv * dv, device=dev, dtype=dtype)
            fused.gdn_step(y_rows[gi, r : r + 1], p_rows[gi, r : r + 1], A_all[gi], dtb_all[gi], nw, S, o1, rows=1,
                           **kw)
            assert torch.equal(S, st[r]) and torch.equal(o1[0], o[r])
    for n in range(T):
        ssm = ssm0.clone()
        fused.gdn_replay(y_rows, p_rows, A_all, dtb_all, nw, ssm, torch.tensor([n], device=dev), outs[0], **kw)
        for gi in range(G):
            assert torch.equal(ssm[gi], recorded[gi][n]), (gi, n)

