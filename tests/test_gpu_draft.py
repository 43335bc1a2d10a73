"""On the GPU in bf16, CUDA graphs on: greedy output with the trimmed draft vocabulary and adaptive
k equals MTP off, 8 prompts x 256 tokens, with the real head and with drafts of a chosen
acceptance; the trimmed head's draft is the argmax of its rows."""
import ctypes

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.policy import AdaptiveK
from mtpchat.engine.runner import capture_stream
from mtpchat.engine.spec import ProfileDrafter
from mtpchat.kernels import int4
from tools.tiny import write_tiny_checkpoint
from helpers import (GPU_LIKE, GPU_MOE_SHAPE, GPU_SHAPE as SHAPE, assert_mtp_on_equals_off, gpu_prompts, greedy,
                     greedy_tokens)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu_draft"), **SHAPE)


def test_trimmed_head_and_adaptive_k_equal_mtp_off_bf16(ckpt):
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, draft_vocab=160, adaptive=True)
    assert engine.decoder.draft_rows.w.shape[0] == 160 + 16          # the subset and its context rows
    ks = set()
    for i, ids in enumerate(gpu_prompts(engine, 8)):
        ref = greedy_tokens(engine, ids, n=256)
        for profile in ((0.9, 0.7, 0.5, 0.3), (0.0,) * 4, None):
            engine.policy = AdaptiveK(4, costs=GPU_LIKE) if profile != (0.0,) * 4 else AdaptiveK(4)
            drafter = ProfileDrafter(ref, profile, seed=i, vocab=engine.config.vocab_size) if profile else None
            engine.adaptive = True
            engine.reset()
            engine.mtp, engine.draft_tokens, engine.drafter = True, 4, drafter
            done = list(engine.generate(ids, SamplingParams(max_tokens=256, stop_token_ids=())))[-1]
            engine.drafter = None
            assert list(done.token_ids) == ref, (i, profile)
            ks |= set(done.stats.k_histogram)
    assert len(ks) >= 3                     # the policy really changed k along the way


@pytest.mark.parametrize("four_bit", [False, True])
@pytest.mark.parametrize("pick", [False, True])
def test_trimmed_draft_is_the_argmax_of_its_rows(ckpt, pick, four_bit):
    """The draft the argmax of the trimmed head's logits (torch's argmax, or the two kernels of
    draft_pick), its rows in bf16 or in 4 bits (draft_head_int4, a default on a GPU): against the
    float32 logits of the rows as stored, a row reaching the max; the 4-bit product's logits are
    its own sums, so there within two bf16 steps of it."""
    config = ModelConfig.load(ckpt)
    assert config.hidden_size % int4.GROUP == 0                      # else the rows stay bf16
    plan = KernelPlan.choose("cuda", config, fp8=False).replace(draft_pick=pick, draft_head_int4=four_bit)
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=256, draft_vocab=160, plan=plan)
    rows = engine.decoder.draft_rows
    assert rows.four_bit == four_bit
    w = int4.dequantize_ref(rows.w) if four_bit else rows.w.float()
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(16):
        h = torch.randn(1, engine.config.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
        into = torch.zeros(1, dtype=torch.long, device="cuda")
        engine.decoder._greedy(h, into)
        logits = (h.float() @ w.T)[0]
        picked, top = logits[(rows.ids == into).nonzero()[0, 0]], logits.max()
        if four_bit:
            assert top - picked <= top.abs() * 2 ** -7, (picked, top)
        else:                                                     # a row reaching the max (bf16 ties allowed)
            assert picked.to(torch.bfloat16) == top.to(torch.bfloat16)


@pytest.mark.parametrize("moe", [False, True])
def test_draft_kernels_keep_mtp_on_equal_to_off(tmp_path, monkeypatch, moe):
    """The plan's defaults for the draft step: the MTP head's fc split over K and finished by its
    layer's input norm (fc_split), and the draft's argmax as two kernels (draft_pick): taken
    (counted), and greedy MTP on equals off with the real head, k = 1..4, trimmed and full draft
    heads, dense and MoE."""
    from mtpchat.engine import decoder, dispatch
    used = {"fc": 0, "pick": 0}
    split, pick = dispatch.matvec_parts_triton, decoder.pick_argmax

    def split_spy(x, w, norm=None, plan=None):
        used["fc"] += norm is not None and norm[0] is None
        return split(x, w, norm, plan)

    def pick_spy(*a):
        used["pick"] += 1
        return pick(*a)
    monkeypatch.setattr(dispatch, "matvec_parts_triton", split_spy)
    monkeypatch.setattr(decoder, "pick_argmax", pick_spy)
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=moe, **(GPU_MOE_SHAPE if moe else SHAPE))
    for draft_vocab in (0, 160):
        engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, draft_vocab=draft_vocab)
        assert engine.plan.fc_split and engine.plan.draft_pick
        assert (engine.decoder.draft_rows is not None) == bool(draft_vocab)
        assert_mtp_on_equals_off(engine, gpu_prompts(engine, 4), 128, ks=(1, 2, 3, 4))
    assert used["fc"] > 0 and used["pick"] > 0, used
    # the draft itself: the same token under both argmax forms, trimmed head and full
    for draft_vocab in (0, 160):
        d = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=256, draft_vocab=draft_vocab).decoder
        kernels, torch_argmax = d.plan, d.plan.replace(draft_pick=False)
        g = torch.Generator(device="cuda").manual_seed(draft_vocab)
        for _ in range(200):
            h = torch.randn(1, d.model.c.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
            picked, want = (torch.empty(1, dtype=torch.long, device="cuda") for _ in range(2))
            d.plan = kernels
            d._greedy(h, picked)
            d.plan = torch_argmax
            d._greedy(h, want)
            assert torch.equal(picked, want), draft_vocab


@pytest.mark.parametrize("moe", [False, True])
def test_head_input_in_one_kernel_gives_the_heads_bits(tmp_path, monkeypatch, moe):
    """The MTP head's input in one kernel (the plan's head_input) against the lookup, the two norms
    and the concatenation: the head's output the same bits, in the step form (the catch-up's rows
    and a chained draft's one, fc split or not) and the prefill form; greedy MTP on == off with it
    (the kernel counted, so the plan really reached it)."""
    from mtpchat.kernels import norm
    calls, kernel = [0], norm.head_input_triton

    def spy(*a):
        calls[0] += 1
        return kernel(*a)
    monkeypatch.setattr(norm, "head_input_triton", spy)
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=moe, **(GPU_MOE_SHAPE if moe else SHAPE))
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512)
    d = engine.decoder
    list(engine.generate(list(range(3, 60)), SamplingParams(max_tokens=4, stop_token_ids=())))
    g = torch.Generator().manual_seed(int(moe))
    H = engine.config.hidden_size
    for T in (5, 1):
        ids = torch.randint(0, engine.config.vocab_size, (T,), generator=g).cuda()
        hidden = torch.randn(T, H, generator=g).to(device="cuda", dtype=torch.bfloat16)
        start = d.state.length - T
        for fc_split in (True, False):
            outs = []
            for on in (False, True):
                d.plan = engine.plan.replace(head_input=on, fc_split=fc_split)
                before = calls[0]
                step = d.head(d.model.embed, ids, hidden, d.state.mtp, d._ctx(start, T, step=True))
                outs.append((step, d._run_head(ids, hidden, start)))     # the same KV rows written again
                assert calls[0] - before == 2 * on, (T, fc_split, on)
            assert torch.equal(outs[0][0], outs[1][0]), ("step", T, fc_split)
            assert torch.equal(outs[0][1], outs[1][1]), ("prefill", T, fc_split)
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024)
    assert engine.plan.head_input                    # the default
    calls[0] = 0
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, 3), 96, ks=(1, 3))
    assert calls[0] > 0


@pytest.mark.parametrize("moe", [False, True])
def test_draft_chain_in_one_kernel_keeps_the_drafts(tmp_path, monkeypatch, moe):
    """The catch-up's hand-off to the chained drafts in one kernel (the plan's draft_chain): in the
    engine's own drafts its row and positions are torch's three kernels' bit for bit (compared
    where nothing is being captured), the drafts the same from one state, and greedy MTP on == off
    with it, k = 1..4."""
    from mtpchat.engine import decoder
    from mtpchat.kernels.accept import chain_start_ref
    calls, checked, kernel = [0], [0], decoder.chain_start

    def spy(out, pend_n, pos, steps):
        calls[0] += 1
        got = kernel(out, pend_n, pos, steps)
        if not torch.cuda.is_current_stream_capturing():
            want = chain_start_ref(out, pend_n, pos, steps)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (pend_n, pos, steps)
            checked[0] += 1
        return got
    monkeypatch.setattr(decoder, "chain_start", spy)
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=moe, **(GPU_MOE_SHAPE if moe else SHAPE))
    plan = KernelPlan.choose("cuda", ModelConfig.load(ckpt), False).replace(draft_chain=True)
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, plan=plan)
    prompts = gpu_prompts(engine, 3)
    assert_mtp_on_equals_off(engine, prompts, 96, ks=(1, 2, 3, 4))
    assert calls[0] > 0
    d = engine.decoder
    for n in (17, 40):                          # stopped after a window of some accepted drafts
        greedy(engine, prompts[0], n, mtp=True, k=4)
        drafts = []
        for on in (False, True):
            d.plan = engine.plan.replace(draft_chain=on)
            d.draft(4)                          # the same head KV rows written again
            drafts.append(d.drafts[:4].clone())
        assert torch.equal(drafts[0], drafts[1]), n
    assert checked[0] >= 2


@pytest.mark.parametrize("moe,yields", [(False, False), (True, False), (False, True)])
def test_fold_beside_the_draft_keeps_mtp_exact(tmp_path, moe, yields):
    """The last step's accepted tokens folded into the GDN states on a second stream of the draft's
    graph (the plan's fold_beside_draft; under fold_yields, that stream's kernels of a lower
    priority than the draft's), so each verify folds none: greedy MTP on == off at k = 1..4 with
    the profile's drafts and the head's, and after a generation the state a draft folds is, bit for
    bit, what the step kernels' fold gives (DecodeState.gdn_committed)."""
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=moe, **(GPU_MOE_SHAPE if moe else SHAPE))
    plan = KernelPlan.choose("cuda", ModelConfig.load(ckpt), False).replace(fold_beside_draft=8, fold_yields=yields)
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, plan=plan)
    assert engine.decoder.runner.graphs, "the draft's graph holds the fold's stream"
    prompts = gpu_prompts(engine, 3)
    assert_mtp_on_equals_off(engine, prompts, 96, ks=(1, 2, 3, 4), profile_ks=(1, 3, 4))
    ref = greedy_tokens(engine, prompts[0], 40)
    greedy(engine, prompts[0], 13, mtp=True, k=3,
           drafter=ProfileDrafter(ref, (1.0,) * 4, seed=0, vocab=engine.config.vocab_size))
    d = engine.decoder
    assert int(d.state.fold) == 4
    want = d.state.gdn_committed(engine.model, plan.any_stride)
    d.draft(3)                                   # eagerly: the fold on its own stream, as captured
    torch.cuda.synchronize()
    assert int(d.state.fold) == 0
    for (_, state, _), w in zip(d.state.gdn_layers, want):
        assert torch.equal(state, w)


def _kernel_priorities(graph: torch.cuda.CUDAGraph) -> list[int]:
    """The priority of each kernel node of a graph captured with keep_graph (CUDA's driver API)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    g, n = ctypes.c_void_p(graph.raw_cuda_graph()), ctypes.c_size_t(0)
    assert cuda.cuGraphGetNodes(g, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert cuda.cuGraphGetNodes(g, nodes, ctypes.byref(n)) == 0
    out = []
    for node in nodes:
        kind = ctypes.c_int()
        assert cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
        if kind.value == 0:                                             # CU_GRAPH_NODE_TYPE_KERNEL
            value = (ctypes.c_char * 64)()                              # CUlaunchAttributeValue
            assert cuda.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), 8, value) == 0   # its priority
            out.append(int.from_bytes(value.raw[:4], "little", signed=True))
    return out


@pytest.mark.parametrize("yields", [False, True])
def test_the_fold_yields_to_the_draft_in_its_graph(ckpt, yields):
    """Under fold_yields the draft's graph holds the fold's kernels (the fold and the zeroing of its
    count) at CUDA's lowest priority and every other kernel at the capture stream's higher one, as
    the runner captures it (runner.capture_stream); without it, one priority for all."""
    plan = KernelPlan.choose("cuda", ModelConfig.load(ckpt), False).replace(fold_yields=yields)
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=256, plan=plan)
    stream = capture_stream(plan)
    assert engine.decoder.runner.stream.priority == stream.priority
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream):
        engine.decoder.draft(3)
    priorities = _kernel_priorities(graph)
    low = [p for p in priorities if p == engine.decoder.fold_stream.priority]
    if yields:
        assert stream.priority < engine.decoder.fold_stream.priority == 0
        assert 1 <= len(low) <= 2 and set(priorities) == {stream.priority, 0}, priorities
    else:
        assert set(priorities) == {0}, priorities
