"""The speculative round's commit bookkeeping for a batch of lanes, one launch: accepted
count, bonus, the stop cut, and every per-lane buffer the next round reads.

Contract (nb lanes, t = k + 1 verify rows per lane, H hidden; all int buffers int64)::

    commit_round(argmax [>=nb, >=t], verify_tokens [>=nb, >=t], k_lane [>=nb],
                 stop_ids [>=nb, STOP], live [>=nb], pos [>=nb], pending [>=nb],
                 n_keep [>=nb], j [>=nb], result [>=nb, 2 + >=k], fill_tokens [>=nb, >=t + 1],
                 fill_start [>=nb], fill_rows [>=nb], fill_h [>=nb, >=t + 1, H],
                 h_last [>=nb, H], seed_hidden [>=nb, >=t, H], nb, t, accepted=None)

    per lane b:
      n      = accepted[0][b] if given (a sampled round's accept test), else the number of
               leading drafts d_i = verify_tokens[b, 1 + i] equal to argmax[b, i], at most
               k_lane[b]
      bonus  = accepted[1][b] if given, else argmax[b, n]
      first  = the first i < n whose draft is one of the lane's stop ids (else k)
      n_keep = min(n, first); keep = draft first if first < n else bonus; j = n_keep + 1
      n_keep[b], j[b]                         (for the GDN replay and the conv-window commit)
      result[b] = (n, bonus, d_0 .. d_{k-1})   (read by the host)
      fill_tokens[b, :t] = verify_tokens[b, :t], then fill_tokens[b, j] = keep
      fill_h[b, 0] = h_last[b] (before), fill_h[b, 1:t+1] = seed_hidden[b, :t],
      h_last[b] = seed_hidden[b, n_keep]
      fill_start[b] = max(pos[b] - 1, 0) * live[b]; fill_rows[b] = j + 1 if live[b] else 1
      pos[b] += j * live[b]; pending[b] = keep

``bad_rows`` (one launch, beside the commit): each lane's first verify row whose logits
hold NaN or +inf (its value at the row's argmax is one), the batched decoder's overflow
check (hyspec.gpu.batch: result[:, -1]).

Integer bookkeeping and copies only: the kernel and the torch reference give the same
values, bit for bit. It replaces the ~30 small torch launches of the batched decoder's
commit graph (hyspec.gpu.batch). Files: ``kernel.py`` (Triton), ``reference.py`` (torch).
"""
from hyspec.kernels.commit.kernel import bad_rows, commit_round
from hyspec.kernels.commit.reference import bad_rows_ref, commit_round_ref, first_flagged

__all__ = ["commit_round", "commit_round_ref", "bad_rows", "bad_rows_ref", "first_flagged"]
