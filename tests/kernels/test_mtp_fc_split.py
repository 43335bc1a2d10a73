"""The MTP head with its fc split over K and finished by its layer's input norm (the kernel plan's
fc_split, engine/plan.py), run on the CPU through the split kernel under Triton's interpreter: the head's output
equals the unsplit head's within float32 rounding, for a dense and an MoE head, the catch-up's
several rows and a chained draft's one."""
from __future__ import annotations

import pytest
import torch

from kernel_checks import split_plan

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.dispatch import Ctx, Product
from mtpchat.engine.plan import KernelPlan
from tools.tiny import write_tiny_checkpoint

MOE = dict(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's engine with the split kernel under the interpreter")
@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("parts", [1, 3])
def test_split_fc_head_equals_the_unsplit_one(tmp_path, monkeypatch, moe, parts):
    # parts 3: the tiny fc's K in ranges of 32 (its own shape would take one range)
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=moe, **(MOE if moe else {}))
    engine = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=256)
    plan = KernelPlan(products=split_plan(parts))
    d = engine.decoder
    list(engine.generate(list(range(3, 40)), SamplingParams(max_tokens=4, stop_token_ids=())))
    g = torch.Generator().manual_seed(int(moe))
    H = engine.config.hidden_size
    split = []

    def product(ctx, x, w):                          # what out_linear gives in a step on the GPU
        if w is engine.head.fc:
            split.append(x.shape[0])
        return Product(x, w)
    monkeypatch.setattr(Ctx, "out_linear", product)  # every block's last product split on the CPU too
    for T in (5, 1):
        ids = torch.randint(0, engine.config.vocab_size, (T,), generator=g)
        hidden = torch.randn(T, H, generator=g)
        start = d.state.length - T
        d.plan = plan.replace(fc_split=False)
        want = d._run_head(ids, hidden, start)
        d.plan = plan.replace(fc_split=True)
        got = d._run_head(ids, hidden, start)        # the same KV rows written again
        assert ((got - want).norm() / want.norm()).item() < 1e-5, T
    assert split == [5, 1]                           # the split head really ran
