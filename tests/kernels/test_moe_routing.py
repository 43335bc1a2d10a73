"""The MoE routing (kernels/moe_routing.py) against its float32 reference: softmax, top k and
renormalisation, the shared expert's gate or the shared expert as every row's last choice; the
step's layout written by the routing kernel; stale rows routed as the last live one; ties."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import INTERPRETED, check, randn

from mtpchat.kernels import matvec, moe_layout, moe_routing


# (9, 256, 8): a verify of 8 drafts routes 72 pairs, past the 64 the step's bookkeeping holds at least
@pytest.mark.parametrize("T,E,k", [(1, 12, 3), (5, 12, 3), (4, 256, 8), (3, 7, 7), (9, 256, 8)])
@pytest.mark.parametrize("gate", [True, False])
def test_route_step_equals_reference(device, T, E, k, gate):
    logits = randn(T, E + gate, seed=T * E + k, scale=2.0).to(device)
    ids, w, g, lay = moe_routing.route_step(logits, k, E)
    ids_r, w_r, g_r = moe_routing.route_ref(logits.cpu(), k, E)
    assert torch.equal(ids.cpu(), ids_r)
    check(w.cpu(), w_r, 1e-6, "weights")
    assert torch.allclose(w.sum(-1).cpu(), torch.ones(T), atol=1e-6)           # renormalised
    if gate:
        check(g.cpu(), g_r, 1e-6, "shared gate")
    else:
        assert g is None and g_r is None
    assert isinstance(lay, moe_layout.StepLayout) and lay.blocks == min(E, T * k)


# (9, 256, 8, True): a verify of 8 drafts with the shared expert routes 81 pairs, 128 in the bookkeeping;
# (16, 3, 2, True): 16 rows on 3 experts, whole blocks of 16 pairs; live: the rows that count (stale_rows)
@pytest.mark.parametrize("T,E,k,shared,live", [(1, 12, 3, False, None), (1, 256, 8, True, None), (5, 12, 3, True, None),
                                               (4, 40, 8, False, None), (3, 7, 7, False, None), (9, 256, 8, True, None),
                                               (16, 3, 2, True, None), (5, 12, 3, True, 2)])
def test_routing_writes_the_step_layout(device, T, E, k, shared, live):
    """The routing kernel's last row writes the step's layout (ProductPlan.routed_layout): every
    block's expert and pairs as layout_ref gives them, the blocks and places not taken -1 (over
    memory a layout held before); the routing itself the same bits as without; the count back at 0.
    (The interpreter runs the rows one after another: the last row to arrive is always the last.)"""
    rows = None if live is None else torch.tensor([live], dtype=torch.int32, device=device)
    before = moe_routing.route_step(randn(T, E + 1, seed=1, scale=2.0).to(device), k, E, shared=shared, layout=True)[3]
    del before                                      # its layout's memory free for the next one to take
    for seed in range(4):                           # several sets of rows
        logits = randn(T, E + 1, seed=T * E + k + 1000 * seed, scale=2.0).to(device)
        ids, w, g, lay = moe_routing.route_step(logits, k, E, shared=shared, rows=rows, layout=True)
        ids0, w0, g0, lay0 = moe_routing.route_step(logits, k, E, shared=shared, rows=rows)
        assert torch.equal(ids, ids0) and torch.equal(w, w0) and (g is None) == (g0 is None), seed
        assert lay0.expert is None and lay.blocks == lay0.blocks == min(E + shared, T * (k + shared))
        ref = moe_layout.layout_ref(ids.cpu(), E + shared, moe_layout.STEP_ROWS, lay.blocks)
        assert torch.equal(lay.expert.cpu(), ref.expert), seed
        assert torch.equal(lay.pairs.cpu(), ref.pairs), seed
    assert not moe_routing.route_count(logits.device).any(), "the routing left its count set"


@pytest.mark.parametrize("shared", [True, False])
def test_a_row_routes_to_the_same_bits_at_any_row_count(device, shared):
    """A decode's row must equal the same row in a verify, bit for bit, whether the routing writes
    the layout or not: each row count compiles its own layout kernel (BP and BB follow it), and a
    sum over a layout the compiler picks gave a decode's weights other last bits than a verify's
    (in about 40 % of rows, in the one-row form with the shared expert and the two-row form
    without). So every window of 1 to 9 rows of several 9-row sets, against the set routed whole.
    (The interpreter runs one form for all: there it cannot fail, and one set's first rows are enough.)"""
    E, k, T = 256, 8, 9
    for seed in range(1 if INTERPRETED else 6):
        logits = randn(T, E + 1, seed=7 + 2 * seed + shared, scale=2.0).to(device)
        ids9, w9, g9, _ = moe_routing.route_step(logits, k, E, shared=shared)
        for n in range(1, T + 1):
            for r in (range(T - n + 1) if not INTERPRETED else (0,)):
                for layout in (False, True):
                    ids, w, g, _ = moe_routing.route_step(logits[r:r + n].contiguous(), k, E, shared=shared,
                                                          layout=layout)
                    at = (seed, r, n, layout)
                    assert torch.equal(ids, ids9[r:r + n]) and torch.equal(w, w9[r:r + n]), at
                    assert shared or torch.equal(g, g9[r:r + n]), at


@pytest.mark.parametrize("live", [0, 1, 3, 5])
def test_stale_rows_route_as_the_last_live_one(device, live):
    # the MTP head's catch-up: rows past `rows` take the last live row's experts and weights (so the
    # step reads no expert for them), the live rows route as without `rows`; no host sync needed
    g = torch.Generator().manual_seed(live)
    T, E, k = 5, 37, 4
    x = randn(T, 300, gen=g).to(device)
    w = randn(E + 1, 300, gen=g, scale=0.3).to(device)
    rows = torch.tensor([live], device=device)
    logits = matvec.matvec(x, w)
    route = lambda r: moe_routing.route(logits, k, E, step=True, shared=True, rows=r)
    ids, weights, _, _ = route(rows)
    ids0, weights0, _, _ = route(None)
    last = max(live, 1) - 1
    assert torch.equal(ids[:live], ids0[:live]) and torch.equal(weights[:live], weights0[:live])
    for r in range(live, T):
        assert torch.equal(ids[r], ids0[last]) and torch.equal(weights[r], weights0[last]), r
    assert len(set(ids[:, :k].flatten().tolist())) == len(set(ids0[:max(live, 1), :k].flatten().tolist()))
    ids_k, weights_k, _, _ = moe_routing.route_step(logits, k, E, shared=True, rows=rows)   # the kernel itself
    assert torch.equal(ids_k.cpu(), ids.cpu())
    check(weights_k.cpu(), weights.cpu(), 1e-6, "the kernel's weights")


@pytest.mark.gpu
def test_ties_take_the_smaller_expert_first():
    # five router rows alike give five equal logits: the routing kernel orders them by expert
    g = torch.Generator().manual_seed(1)
    w = randn(257, 2048, gen=g, scale=0.01)
    w[[1, 2, 4, 8, 16]] = randn(2048, gen=g, scale=0.05).abs()        # far above the rest, for x > 0
    x = randn(3, 2048, gen=g).abs().to("cuda", torch.bfloat16)
    w = w.to("cuda", torch.bfloat16)
    logits = matvec.matvec(x, w)
    assert (logits[:, [1, 2, 4, 8, 16]] == logits[:, 1:2]).all()
    ids = moe_routing.route_step(logits, 8, 256)[0]
    assert (ids[:, :5] == torch.tensor([1, 2, 4, 8, 16], device="cuda", dtype=ids.dtype)).all(), ids


@pytest.mark.parametrize("four_bit", [False, True])
def test_a_prefill_takes_blocks_as_wide_as_its_pairs_an_expert(device, four_bit):
    """A prefill's layout groups its pairs in blocks of 16, 32 or 64 (ProductPlan.prefill_block_rows,
    from the mean of pairs an expert: a short chunk's blocks of 64 stood mostly empty), 4-bit experts
    on their own thresholds; on the GPU launched for the most blocks those pairs could take at that
    size (most_blocks: a graph's chunk waits on no count), the blocks past the layout's own empty."""
    from mtpchat.kernels.plan import ProductPlan
    plan = ProductPlan(programs=6)
    lo, hi = plan.int4_moe_prefill_blocks if four_bit else plan.moe_prefill_blocks
    E, k = 8, 2
    for T, want in ((1, 16), (lo * E // k - 1, 16), (lo * E // k, 32), (hi * E // k, 64)):
        logits = randn(T, E, seed=T, scale=2.0).to(device)
        ids, _, _, lay = moe_routing.route(logits, k, E, step=False, plan=plan, four_bit=four_bit)
        assert lay.pairs.shape[1] == want == plan.prefill_block_rows(T * k, E, four_bit), (T, want)
        ref = moe_layout.layout_ref(ids.cpu(), E, want)
        n = ref.expert.shape[0]
        assert torch.equal(lay.pairs[:n].cpu(), ref.pairs) and torch.equal(lay.expert[:n].cpu(), ref.expert)
        assert lay.expert.shape[0] == (moe_layout.most_blocks(T * k, E, want) if device == "cuda" else n)
        assert bool((lay.expert[n:] == -1).all())
    # a plan of other thresholds takes other blocks
    ids, _, _, lay = moe_routing.route(randn(8, E, seed=9, scale=2.0).to(device), k, E, step=False, four_bit=four_bit,
                                       plan=ProductPlan(programs=6, moe_prefill_blocks=(1, 2), int4_moe_prefill_blocks=(1, 2)))
    assert lay.pairs.shape[1] == 64
