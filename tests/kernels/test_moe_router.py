"""The router product and its routing in one kernel (kernels/moe_router.py) against its float32
reference (the same split sums, then moe.route_ref) and against the two kernels it replaces."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import check, randn

from mtpchat.kernels import matvec, moe, moe_layout, moe_router


@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("E,k,gate,shared", [(12, 3, True, False), (12, 3, False, False), (37, 8, True, True),
                                             (200, 8, True, True)])
def test_route_fused_equals_its_reference(device, monkeypatch, T, E, k, gate, shared):
    monkeypatch.setattr(moe_router, "_programs", lambda device: 6)     # 6 "SMs" on the CPU too
    g = torch.Generator().manual_seed(T * E + k)
    H = 300
    x = randn(T, H, gen=g).to(device)
    w = randn(E + gate, H, gen=g, scale=0.3).to(device)
    for _ in range(2):                                                # the count is back at 0
        ids, weights, gates, lay = moe_router.route_fused(x, w, k, E, shared)
        assert int(matvec._counts[x.device].abs().sum()) == 0
    ids_r, w_r, g_r = moe_router.route_fused_ref(x.cpu(), w.cpu(), k, E, shared, P=6)
    assert torch.equal(ids.cpu(), ids_r)
    check(weights.cpu(), w_r, 1e-6, "weights")
    if gate and not shared:
        check(gates.cpu(), g_r, 1e-6, "gate")
    else:
        assert gates is None and g_r is None
    assert isinstance(lay, moe_layout.StepLayout) and lay.blocks == min(E + shared, T * (k + shared))
    # the two kernels it replaces route the same (the logits differ by the order of their sums only)
    ids2, w2, _, _ = moe.route_step(matvec.matvec(x, w), k, E, shared) if device == "cuda" else \
        (*moe.route_ref(matvec.matvec_ref(x, w), k, E, shared), None)
    assert torch.equal(ids.cpu(), ids2.cpu())
    check(weights.cpu(), w2.cpu(), 1e-5, "weights against the unfused routing")


def test_the_split(monkeypatch):
    # the 35B-A3B's router on an H100: 257 rows in 5 blocks, 2,048 columns in 8 tiles, one a part
    assert moe_router._split(257, 2048, 2, 132) == (64, 256, 8, 1)
    assert moe_router._split(257, 2048, 2, 20) == (64, 256, 4, 2)      # fewer SMs, fewer parts
    assert moe_router._split(13, 300, 4, 6) == (64, 128, 3, 1)


@pytest.mark.gpu
def test_35b_router_rows_alone_and_together():
    g = torch.Generator().manual_seed(0)
    x = randn(9, 2048, gen=g).to("cuda", torch.bfloat16)
    w = randn(257, 2048, gen=g, scale=0.02).to("cuda", torch.bfloat16)
    ids, weights, _, _ = moe_router.route_fused(x, w, 8, 256, shared=True)
    ids_r, w_r, _ = moe_router.route_fused_ref(x.cpu(), w.cpu(), 8, 256, True,
                                               P=torch.cuda.get_device_properties(0).multi_processor_count)
    # the GPU's sums run in another order than the CPU's: a logit on a bf16 rounding boundary may round
    # the other way and reorder a near tie (exact ties order alike: route_first_ref)
    assert (ids.cpu() == ids_r).float().mean() > 0.99
    for i in range(9):
        alone = moe_router.route_fused(x[i:i + 1], w, 8, 256, shared=True)
        assert torch.equal(alone[0][0], ids[i]) and torch.equal(alone[1][0], weights[i]), i
    for _ in range(10):
        assert torch.equal(moe_router.route_fused(x, w, 8, 256, shared=True)[1], weights)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's engine with the kernel under the interpreter")
@pytest.mark.parametrize("shared_as_expert", [True, False])
def test_the_moe_block_with_the_fused_router(tmp_path, monkeypatch, shared_as_expert):
    # engine/model.py ROUTER_FUSED: a step's MoE block routed by the fused kernel (here through the
    # interpreter on the CPU) gives the block's output of the unfused routing
    from mtpchat.engine import Engine, model
    from mtpchat.engine.model import Ctx
    from tools.tiny import write_tiny_checkpoint
    monkeypatch.setattr(moe_router, "_programs", lambda device: 6)
    monkeypatch.setattr(model, "SHARED_AS_EXPERT", shared_as_expert)
    shape = dict(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    engine = Engine.load(write_tiny_checkpoint(tmp_path / "m", moe=True, **shape), device="cpu",
                         dtype=torch.float32, max_context=64)
    block = engine.model.layers[0].mlp
    x = randn(5, engine.config.hidden_size, seed=3)
    ctx = Ctx(torch.arange(5), 0, True, None, None, None)
    want = block(x, ctx)
    calls = []
    fused = moe_router.route_fused
    monkeypatch.setattr(model, "ROUTER_FUSED", True)
    monkeypatch.setattr(model, "use_triton", lambda *t: True)           # as on a GPU, for the router
    monkeypatch.setattr(moe_router, "route_fused", lambda *a, **kw: calls.append(a[3]) or fused(*a, **kw))
    got = block(x, ctx)
    assert calls == [12]
    check(got, want, 1e-5, "the block's output")


@pytest.mark.parametrize("live", [0, 1, 3, 5])
@pytest.mark.parametrize("fused", [False, True])
def test_stale_rows_route_as_the_last_live_one(device, monkeypatch, live, fused):
    # the MTP head's catch-up: rows past `rows` take the last live row's experts and weights (so the
    # step reads no expert for them), the live rows route as without `rows`; no host sync needed
    monkeypatch.setattr(moe_router, "_programs", lambda device: 6)
    g = torch.Generator().manual_seed(live)
    T, E, k = 5, 37, 4
    x = randn(T, 300, gen=g).to(device)
    w = randn(E + 1, 300, gen=g, scale=0.3).to(device)
    rows = torch.tensor([live], device=device)
    if fused:
        route = lambda r: moe_router.route_fused(x, w, k, E, shared=True, rows=r)
    else:
        logits = matvec.matvec(x, w)
        route = lambda r: moe.route(logits, k, E, step=True, shared=True, rows=r)
    ids, weights, _, _ = route(rows)
    ids0, weights0, _, _ = route(None)
    last = max(live, 1) - 1
    assert torch.equal(ids[:live], ids0[:live]) and torch.equal(weights[:live], weights0[:live])
    for r in range(live, T):
        assert torch.equal(ids[r], ids0[last]) and torch.equal(weights[r], weights0[last]), r
    assert len(set(ids[:, :k].flatten().tolist())) == len(set(ids0[:max(live, 1), :k].flatten().tolist()))
    if fused:
        ids_r, w_r, _ = moe_router.route_fused_ref(x.cpu(), w.cpu(), k, E, True, P=6, rows=rows.cpu())
        assert torch.equal(ids.cpu(), ids_r)
        check(weights.cpu(), w_r, 1e-6, "weights")
    else:                                        # the routing kernel itself (the interpreter on the CPU)
        ids_k, weights_k, _, _ = moe.route_step(logits, k, E, shared=True, rows=rows)
        assert torch.equal(ids_k.cpu(), ids.cpu())
        check(weights_k.cpu(), weights.cpu(), 1e-6, "the kernel's weights")


@pytest.mark.gpu
def test_ties_take_the_smaller_expert_first():
    # five router rows alike give five equal logits: both routing kernels order them by expert
    g = torch.Generator().manual_seed(1)
    w = randn(257, 2048, gen=g, scale=0.01)
    w[[1, 2, 4, 8, 16]] = randn(2048, gen=g, scale=0.05).abs()        # far above the rest, for x > 0
    x = randn(3, 2048, gen=g).abs().to("cuda", torch.bfloat16)
    w = w.to("cuda", torch.bfloat16)
    logits = matvec.matvec(x, w)
    assert (logits[:, [1, 2, 4, 8, 16]] == logits[:, 1:2]).all()
    for ids in (moe.route_step(logits, 8, 256)[0], moe_router.route_fused(x, w, 8, 256)[0]):
        assert (ids[:, :5] == torch.tensor([1, 2, 4, 8, 16], device="cuda", dtype=ids.dtype)).all(), ids
    assert torch.equal(moe_router.route_first_ref(logits.cpu(), 8, 256)[0][:, :5].long(),
                       torch.tensor([[1, 2, 4, 8, 16]] * 3))
