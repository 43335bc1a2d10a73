"""The benchmark drafter's one kernel (kernels/profile_drafts.py) against its torch reference, and
that reference against the rule spelt out draft by draft: random draws and thresholds, so that some
windows are right throughout, some wrong from the start and most right up to a point; positions at,
near and past the reference's end; odd k."""
from __future__ import annotations

import pytest
import torch

from mtpchat.kernels import profile_drafts as pd


def case(k: int, n: int, position: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(k, generator=g)
    cond = torch.rand(k + 3, generator=g) * 0.6 + 0.5         # 0.5..1.1: long and short runs of right
    true = torch.randint(0, 50_000, (n + 1,), generator=g)
    table = torch.cat([true + 1, true])                        # wrong tokens first, as ProfileDrafter's
    at = torch.tensor([position])
    return [t.to(device) for t in (u, cond, at, table)]


def spelt_out(u, cond, position: int, table) -> list[int]:
    n = table.shape[0] // 2 - 1
    out, right = [], True
    for i in range(u.shape[0]):
        right = right and bool(u[i] < cond[i])
        out.append(int(table[(n + 1 if right else 0) + min(position + i, n)]))
    return out


@pytest.mark.parametrize("k,n,position", [(1, 7, 0), (3, 129, 40), (4, 129, 127), (5, 33, 33), (7, 300, 296),
                                          (13, 61, 10), (17, 1000, 990), (2, 5, 9)])
def test_profile_drafts_against_the_reference(device, k, n, position):
    for seed in range(6):
        u, cond, at, table = case(k, n, position, 100 * k + seed, device)
        want = pd.profile_drafts_ref(u.cpu(), cond.cpu(), at.cpu(), table.cpu(), torch.full((k,), -1, dtype=torch.long))
        assert want.tolist() == spelt_out(u.cpu(), cond.cpu(), position, table.cpu())
        out = torch.full((k,), -7, dtype=torch.long, device=device)              # written over, in place
        got = pd.profile_drafts(u, cond, at, table, out)                         # the kernel on a GPU
        assert got is out and torch.equal(out.cpu(), want)
        # the kernel itself, also where the dispatcher takes the reference (a CPU, under the interpreter)
        assert torch.equal(pd.profile_drafts_triton(u, cond, at, table, out.fill_(-7)).cpu(), want)
