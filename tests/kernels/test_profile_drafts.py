"""The benchmark drafter's one kernel (kernels/profile_drafts.py) against its torch reference, and
that reference against the rule spelt out draft by draft: random draws and thresholds, so that some
windows are right throughout, some wrong from the start and most right up to a point; positions at,
near and past the reference's end; odd k. Then engine/spec.py's ProfileDrafter through it (the
kernel on a GPU) against its earlier torch form from the same generator."""
from __future__ import annotations

import pytest
import torch

from mtpchat.engine.spec import ProfileDrafter
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


def test_profile_drafter_draws_as_its_torch_form_did(device):
    # the drafts written in place by the kernel are those of the earlier form in torch, a table
    # looked up, from the same generator: a seed gives the drafts it gave
    ref, V, profile = list(range(100, 140)), 512, (0.9, 0.6, 0.45, 0.2)
    drafter = ProfileDrafter(ref, profile=profile, seed=5, vocab=V)
    g, n = torch.Generator(device=device).manual_seed(5), len(ref)
    true = torch.tensor(ref + [0], device=device)
    table = torch.cat([(true + 1) % V, true])
    cond = torch.tensor([p / q for p, q in zip(profile, (1.0,) + profile[:-1])] + [0.0] * 16, device=device)
    fed = torch.full((9,), -1, dtype=torch.long, device=device)             # the decoder's x_L, then its drafts
    for t, k in zip(range(0, 60, 3), [4, 1, 3, 6, 2] * 4):                   # past the reference's end too
        at_t = t if t % 2 else torch.tensor([t], device=device)               # a host int or a device tensor
        got = drafter(at_t, fed[1:1 + k])
        right = (torch.rand(k, generator=g, device=device) < cond[:k]).cumprod(0)
        at = (t + torch.arange(k, device=device)).clamp(max=n)
        assert got.data_ptr() == fed[1:].data_ptr() and torch.equal(fed[1:1 + k], table[at + right * (n + 1)])
