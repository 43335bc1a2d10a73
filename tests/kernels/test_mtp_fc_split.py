"""The MTP head with its fc split over K and finished by its layer's input norm (engine/mtp.py
FC_SPLIT), run on the CPU through the split kernel under Triton's interpreter: the head's output
equals the unsplit head's within float32 rounding, for a dense and an MoE head, the catch-up's
several rows and a chained draft's one."""
from __future__ import annotations

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine import mtp
from mtpchat.engine.model import Product
from tools.tiny import write_tiny_checkpoint
from mtpchat.kernels import matvec_parts

MOE = dict(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's engine with the split kernel under the interpreter")
@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("parts", [1, 3])
def test_split_fc_head_equals_the_unsplit_one(tmp_path, monkeypatch, moe, parts):
    # parts 3: the tiny fc's K in ranges of 32 (its own shape would take one range)
    monkeypatch.setattr(matvec_parts, "_split_config", lambda N, K, itemsize: (parts, 16, 32, 4, 2))
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=moe, **(MOE if moe else {}))
    engine = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=256)
    d = engine.decoder
    list(engine.generate(list(range(3, 40)), SamplingParams(max_tokens=4, stop_token_ids=())))
    g = torch.Generator().manual_seed(int(moe))
    H = engine.config.hidden_size
    split = []

    def product(x, w, rowwise):                      # what out_linear gives in a step on the GPU
        split.append(x.shape[0])
        return Product(x, w)
    for T in (5, 1):
        ids = torch.randint(0, engine.config.vocab_size, (T,), generator=g)
        hidden = torch.randn(T, H, generator=g)
        start = d.state.length - T
        want = d._run_head(ids, hidden, start)
        monkeypatch.setattr(mtp, "FC_SPLIT", True)
        monkeypatch.setattr(mtp, "out_linear", product)
        got = d._run_head(ids, hidden, start)        # the same KV rows written again
        monkeypatch.setattr(mtp, "FC_SPLIT", False)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, T
    assert split == [5, 1]                           # the split head really ran
