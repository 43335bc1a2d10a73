"""The engine on the GPU in bf16: the Triton kernels, CUDA graphs, and exactness of MTP on vs off."""
import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.decoder import prefill_pieces
from mtpchat.engine.memory import K_MAX
from mtpchat.engine.model import prefill_attention
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.spec import ProfileDrafter
from mtpchat.kernels import attention_chunk
from mtpchat.kernels.conv import window_columns
from tools.tiny import write_tiny_checkpoint
from helpers import FLOAT32_CHUNK, GPU_MOE_SHAPE, GPU_SHAPE, assert_mtp_on_equals_off, gpu_prompts, greedy_tokens, random_ids, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu"), **GPU_SHAPE)


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_mtp_on_equals_off_bf16(ckpt, graphs):
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs, max_context=1024)
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, 4), 96, profile_ks=(1, 2, 3, 4), ks=(3,))


def test_graph_replay_equals_eager(ckpt):
    runs = []
    for graphs in (True, False):
        engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs, max_context=1024)
        ids = gpu_prompts(engine, 2)[1]
        ref = greedy_tokens(engine, ids, 96)
        runs.append((ref, greedy_tokens(engine, ids, 96, mtp=True, k=2,
                                        drafter=ProfileDrafter(ref, seed=1, vocab=engine.config.vocab_size))))
        del engine
    assert runs[0] == runs[1]


def test_gpu_logits_close_to_cpu_float32(ckpt):
    # chunks of 16: later chunks take the masked path (flash attention has no float32)
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, prefill_chunk=16)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = gpu_prompts(cpu, 3)[2]
    a, b = gpu.logits(ids).cpu(), cpu.logits(ids)
    # the chunked GDN kernel multiplies in tf32 (about 3e-3 relative per layer against float32)
    assert rel_err(a, b) < 3e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_gdn_chunk_in_bf16_within_bf16s_reach_of_float32(ckpt):
    # the plan's chunked GDN (bf16 between its kernels, bf16 products) against the same bf16 engine
    # with the chunk in float32 and tf32, both against float32 on the CPU over a prompt of several
    # 64-token chunks: the bf16 forms add no more than bf16's own distance (a wrong sum is far off)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = gpu_prompts(cpu, 4)[3] * 3
    want = cpu.logits(ids)
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512)
    default = gpu.plan
    assert default.chunk_products == "bf16" and default.chunk_solved == "bfloat16"
    got = gpu.logits(ids).float().cpu()
    gpu.plan = gpu.decoder.plan = default.replace(**FLOAT32_CHUNK)
    wide = gpu.logits(ids).float().cpu()
    err, err_wide = rel_err(got, want, ord=2), rel_err(wide, want, ord=2)
    assert err < 1.5 * err_wide + 5e-3, (err, err_wide)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_triton_prefill_attention_within_bf16s_reach_of_float32(ckpt, monkeypatch):
    # the plan's candidate prefill attention (kernels/attention_chunk.py) against torch's flash kernel in
    # the same bf16 engine, both against float32 on the CPU, over a prompt in several chunks (the
    # later ones over the keys before them); taken for every chunk, though the tiny model's are too
    # short to fill the GPU (prefill_attention_fills)
    monkeypatch.setattr(attention_chunk, "prefill_attention_fills", lambda *args: True)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = gpu_prompts(cpu, 4)[3] * 3
    want = cpu.logits(ids)
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512, prefill_chunk=48)
    assert len(ids) > 2 * 48
    flash = gpu.logits(ids).float().cpu()
    gpu.plan = gpu.decoder.plan = gpu.plan.replace(prefill_attention="triton")
    got = gpu.logits(ids).float().cpu()
    err, err_flash = rel_err(got, want, ord=2), rel_err(flash, want, ord=2)
    assert err < 1.5 * err_flash + 5e-3, (err, err_flash)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("Hq,Hkv,T,n", [(24, 4, 100, 300), (8, 2, 1, 77), (6, 6, 64, 100), (6, 6, 64, 64)])
def test_prefill_attention_of_a_later_chunk(Hq, Hkv, T, n):
    # the last T of n rows attend to every earlier row and causally among themselves (flash on the GPU)
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, h, m, 256, generator=g) for h, m in ((Hq, T), (Hkv, n), (Hkv, n)))
    want = prefill_attention(q, k, v, n == T, 0.0625)                     # float32 on the CPU
    got = prefill_attention(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), n == T, 0.0625)
    err = rel_err(got, want, ord=2)
    assert err < 1e-2, err


def test_chunked_prefill_matches_the_cpu(ckpt):
    # 97 prompt tokens in chunks of 32, where later chunks take flash attention's bottom-right causal
    # mask: as close to float32 on the CPU as one unchunked bf16 prefill is (a wrong mask is far off)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = gpu_prompts(cpu, 5)[4]
    want = cpu.logits(ids)
    errs = {}
    for chunk in (32, 4096):
        gpu = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512, prefill_chunk=chunk)
        got = gpu.logits(ids).float().cpu()
        errs[chunk] = rel_err(got, want, ord=2)
        del gpu
    assert errs[32] < 1.5 * errs[4096] + 1e-3, errs


@pytest.mark.parametrize("graphs", [True, False])
def test_pipelined_steps_equal_one_at_a_time(ckpt, graphs):
    # two steps in flight (the default on CUDA) against each read before the next: the same tokens
    # and, after a stop id inside an accepted window, the same committed state to the bit. The
    # GDN states are compared with every committed token run in: under the plan's fold_beside_draft
    # the step in flight past the stop folds them in its draft (fold 0), one at a time leaves them
    # to fold (fold n), and both hold the same committed state
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs, max_context=1024)
    assert engine.pipeline == 2
    ids = gpu_prompts(engine, 3)[2]
    ref = greedy_tokens(engine, ids, 60)
    states = []
    for depth in (2, 1):
        engine.pipeline = depth
        engine.reset()
        engine.mtp, engine.draft_tokens = True, 4
        engine.drafter = ProfileDrafter(ref, (1.0, 0.9, 0.8, 0.7), seed=3, vocab=engine.config.vocab_size)
        engine.decoder.most_in_flight = 0
        done = list(engine.generate(ids, SamplingParams(max_tokens=60, stop_token_ids=(ref[40],))))[-1]
        assert done.reason == "stop" and list(done.token_ids) == ref[:ref.index(ref[40]) + 1]
        assert engine.decoder.most_in_flight == depth
        s, L = engine.state, engine.state.length
        states.append([t[:L] for pair in s.kv_layers for t in pair] + [s.parity, s.conv_off] +
                      [buf.index_select(1, window_columns(s.conv_off, s.kernel, s.conv_width))
                       for buf, _, _ in s.gdn_layers] +
                      s.gdn_committed(engine.model, engine.plan.any_stride))
        states[-1] = [t.clone() for t in states[-1]]
    assert all(torch.equal(a, b) for a, b in zip(*states))


def test_logprobs_on_the_gpu_mtp_on_equal_off(ckpt):
    # the logprobs come from the logits the step already holds (bf16 rows of a verify are those of
    # single decode steps), so with MTP on they are those of MTP off; their value against a full
    # forward is tested in float32 on the CPU (tests/test_logprobs.py): in bf16 the prefill's
    # batched products round otherwise, by up to 0.85 in a logprob on this random model
    from mtpchat.engine.events import Step
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024)
    ids = gpu_prompts(engine, 1)[0]

    def steps(mtp, drafter=None):
        engine.reset()
        engine.mtp, engine.draft_tokens, engine.drafter = mtp, 3, drafter
        try:
            params = SamplingParams(max_tokens=48, stop_token_ids=(), logprobs=5)
            return [ev for ev in engine.generate(ids, params) if isinstance(ev, Step)]
        finally:
            engine.drafter = None
    off = [lp for s in steps(False) for lp in s.logprobs]
    reply = [g.token_id for g in off]
    on_steps = steps(True, ProfileDrafter(reply, seed=1, vocab=engine.config.vocab_size))
    on = [lp for s in on_steps for lp in s.logprobs]
    assert any(s.accepted > 0 for s in on_steps) and [g.token_id for g in on] == reply
    for a, b in zip(on, off):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.logprob <= 0
        assert [i for i, _ in a.top] == [i for i, _ in b.top] and a.top[0][0] == a.token_id


def test_drafts_past_the_captured_ones_keep_mtp_on_equal_off(ckpt):
    # k = 5..8 run eagerly beside the captured graphs of k <= 4 (engine/memory.py CAPTURED_K, K_MAX)
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, k_max=K_MAX)
    assert engine.cuda_graphs and K_MAX == 8
    runs = assert_mtp_on_equals_off(engine, gpu_prompts(engine, 2), 96, profile_ks=(5, 8), ks=(6,))
    # per prompt: profile drafts at k = 5 and 8, then the head's at 6; steps of that many drafts ran
    assert [max(r.stats.k_histogram) for r in runs] == [5, 8, 6, 5, 8, 6]


def test_conv_in_recurrence_changes_no_token(ckpt):
    # the GDN conv computed by the recurrence kernel (KernelPlan.conv_in_recurrence) in no step, in
    # one-token steps only (a verify's tokens then folded in by a decode with the conv inside, and
    # the other way round) and in every step; by the in_proj's kernel (conv_in_product) in every
    # step, in one-token steps with the recurrence's in the others, or in steps of one and two
    # tokens with the conv kernel in the others: the same greedy tokens, MTP off and on
    runs = []
    for tokens, product in ((0, 0), (1, 0), (1 << 10, 0), (0, 1 << 10), (1 << 10, 1), (0, 2)):
        plan = KernelPlan.choose("cuda", ModelConfig.load(ckpt), fp8=False).replace(conv_in_recurrence=tokens,
                                                                                    conv_in_product=product)
        engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, plan=plan)
        runs.append(assert_mtp_on_equals_off(engine, gpu_prompts(engine, 3)[1:], 96, profile_ks=(1, 3), ks=(2,)))
        del engine
    tokens = [[list(done.token_ids) for done in run] for run in runs]
    assert all(t == tokens[0] for t in tokens[1:])


@pytest.mark.parametrize("tokens,product", [(0, 1 << 10), (1 << 10, 1)])
def test_the_conv_in_the_product_keeps_mtp_exact_on_an_moe(tmp_path, tokens, product):
    # the tiny MoE model, whose key heads of 64 and rows of 776 made the recurrence compile one form
    # for a decode and another for a verify over the product's q | k | v views (greedy MTP on != off
    # with the head's own drafts) until the plan took the kernel's form that compiles in no row
    # stride (KernelPlan.any_stride): MTP on == off with the conv in the product in every step, and
    # in one-token steps with the recurrence's in the others. (The dense model's key heads of 32
    # compile one form either way: it cannot catch this.)
    ckpt = write_tiny_checkpoint(tmp_path / "m", moe=True, **GPU_MOE_SHAPE)
    plan = KernelPlan.choose("cuda", ModelConfig.load(ckpt), fp8=False).replace(conv_in_recurrence=tokens,
                                                                                conv_in_product=product)
    assert plan.any_stride
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=1024, plan=plan)
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, 3), 96, profile_ks=(3,), ks=(1, 3))


@pytest.mark.parametrize("graphs", [True, False])
def test_a_short_turn_through_the_graphs(ckpt, graphs):
    # a GPU's plan prefills a few tokens as verifies (step pieces of at most 5) and a few more as
    # chunks of the sizes captured at load, then step pieces: after a history, a turn's last logits
    # as close to float32 on the CPU as the chunked form's; the same replayed or eager; greedy MTP
    # on == off from prompts that short
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512, cuda_graphs=graphs)
    dec, plan = gpu.decoder, gpu.plan
    assert plan.step_prefill == 2 and plan.prefill_graphs and dec.runner.graphs_on == graphs
    keys, run = [], dec.runner.run
    dec.runner.run = lambda key, fn: (keys.append(key), run(key, fn))[1]
    if graphs:
        assert {("prefill", T) for T in plan.prefill_graphs} <= dec.runner.graphs.keys()
    history, V = gpu_prompts(cpu, 3)[2], gpu.config.vocab_size - 64
    try:
        for n in (1, 3, 7, 10, 11, 37, 63, 130):
            turn = random_ids(n, n, V)
            want = cpu.logits(history + turn)[-1:]
            pieces = prefill_pieces(n, dec.R, 2, plan.prefill_graphs, plan.prefill_pieces)
            errs = {}
            for short in (False, True):
                dec.plan = plan if short else plan.replace(step_prefill=0, prefill_pieces=0)
                gpu.reset()
                dec.begin(history)
                keys.clear()
                dec.begin(history + turn)
                assert keys == ([("verify" if f == "step" else "prefill", T - (f == "step")) for T, f in pieces]
                                if short else [])
                errs[short] = rel_err(dec.last_logits.float().cpu(), want, ord=2)
            # bf16 on a random model: another path may land twice as far; a wrong state lands far off
            assert errs[True] < max(3 * errs[False], 0.1), (n, errs)
    finally:
        dec.runner.run = run
        dec.plan = plan
    assert_mtp_on_equals_off(gpu, [random_ids(n, 50 + n, V) for n in (2, 10, 37, 63)], 48, ks=(1, 3), profile_ks=(2, 4))


def test_a_first_prompt_through_the_early_chunks(ckpt):
    # a first prompt of a few hundred tokens goes as graph chunks of 256 / 512 (KernelPlan.
    # prefill_early), their attention over the cache's first 1,024 rows alone: its last logits as
    # close to float32 on the CPU as eager chunks'; after a history past those rows, none of them;
    # greedy MTP on == off from such prompts
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=2048)
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=2048)
    dec, plan = gpu.decoder, gpu.plan
    assert plan.prefill_early == (256, 512) and plan.prefill_early_rows == 1024
    assert {("prefill", 256, 1024), ("prefill", 512, 1024)} <= dec.runner.graphs.keys()
    keys, run = [], dec.runner.run
    dec.runner.run = lambda key, fn: (keys.append(key), run(key, fn))[1]
    V = gpu.config.vocab_size - 64
    try:
        for history, n in ((0, 300), (0, 512), (0, 700), (200, 520), (900, 300)):
            ids = random_ids(history + n, 7 * n + history, V)
            want = cpu.logits(ids)[-1:]
            pieces = prefill_pieces(n, dec.R, 2, plan.prefill_graphs, plan.prefill_pieces, history,
                                    plan.prefill_early, plan.prefill_early_rows)
            assert pieces is not None and any(T in plan.prefill_early for T, _ in pieces) == (history + 256 <= 1024)
            errs = {}
            for graphed in (False, True):
                dec.plan = plan if graphed else plan.replace(step_prefill=0, prefill_pieces=0)
                gpu.reset()
                if history:
                    dec.begin(ids[:history])
                keys.clear()
                dec.begin(ids)
                assert keys == ([("verify", T - 1) if f == "step" else dec.chunk_key(T) for T, f in pieces]
                                if graphed else [])
                errs[graphed] = rel_err(dec.last_logits.float().cpu(), want, ord=2)
            assert errs[True] < max(3 * errs[False], 0.1), (history, n, errs)
    finally:
        dec.runner.run = run
        dec.plan = plan
    assert_mtp_on_equals_off(gpu, [random_ids(n, 90 + n, V) for n in (300, 520)], 48, ks=(1, 3), profile_ks=(2,))


def test_no_garbage_collection_inside_a_capture(ckpt):
    # A model switched: engines dropped in the same process are freed by the garbage collector
    # whenever it runs, and a pinned buffer freed inside a graph's capture could invalidate it, so
    # runner.Runner.capture keeps the collector out of its captures. With the collector running at
    # nearly every allocation, none runs while a capture is under way, every graph is captured, and
    # the new engine answers as the first one did.
    import gc
    first = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=256)
    ids = gpu_prompts(first, 2)[1]
    want = greedy_tokens(first, ids, 24)
    for _ in range(2):
        dropped = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=256)
        greedy_tokens(dropped, ids, 8, mtp=True, k=2)          # its pinned buffers used by copies
        dropped.cycle = dropped                                 # unreachable once dropped, until collected
        del dropped
    capturing = []
    watch = lambda phase, info: capturing.append(torch.cuda.is_current_stream_capturing()) if phase == "start" else None
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(watch)
    try:
        engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=256)
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
    assert capturing and not any(capturing), "a collection ran inside a capture"
    assert engine.decoder.runner.graphs and gc.isenabled()
    assert greedy_tokens(engine, ids, 24) == want
