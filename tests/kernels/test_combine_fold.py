"""The kernel plan's fold_combine (engine/plan.py) in the tiny MoE engine on the CPU, with the
kernels under Triton's interpreter where the GPU would run them: an MoE's combine folded into the
residual add and the norm after it (kernels/norm.py combine_add_rmsnorm, every step's MoE output
through it: the next layer's input norm, the final norm into the decoder's buffer, the MTP head's
norm) gives the tokens of the combine kernel followed by the norm kernel, greedy MTP on == off."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_mtp_on_equals_off, greedy_tokens, random_ids
from mtpchat.engine import Engine
from mtpchat.kernels import moe, norm
from tools.tiny import write_tiny_checkpoint


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's engine with the kernels under the interpreter")
@pytest.mark.parametrize("shared", [40, 56])     # as wide as a routed expert (a choice), or wider (apart, gated)
def test_folded_combine_kernel_in_the_engine(tmp_path, monkeypatch, shared):
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=True, seed=4, shared_expert_intermediate_size=shared)
    base = Engine.load(ckpt, max_context=300)
    engine = Engine.load(ckpt, max_context=300, plan=base.plan.replace(fold_combine=True))
    folded = []

    def fold(*args, **kw):
        folded.append(args[1].shape[0])
        return norm.combine_add_rmsnorm_triton(*args, **kw)
    # the kernels where a step on the GPU takes them: the combine and the norm apart, or folded
    monkeypatch.setattr(moe, "combine", moe.combine_triton)
    monkeypatch.setattr(norm, "add_rmsnorm", norm.add_rmsnorm_triton)
    monkeypatch.setattr(norm, "combine_add_rmsnorm", fold)
    ids = random_ids(9, 5, base.config.vocab_size)
    want = greedy_tokens(base, ids, 10)
    assert not folded
    assert greedy_tokens(engine, ids, 10) == want
    assert folded.count(1) >= 9 * engine.config.num_hidden_layers
    assert_mtp_on_equals_off(engine, [ids], 10, ks=(3,))
    assert 4 in folded                                  # a verify's 4 rows
