"""The engine against Hugging Face transformers' Qwen3_5ForCausalLM on tiny checkpoints (float32, CPU)."""
import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.decoder import Decoder, chunk_size, eager_prefill_length, prefill_pieces
from mtpchat.engine.memory import EARLY_GRAPHS, EARLY_ROWS, PREFILL_GRAPHS
from mtpchat.engine.state import DecodeState
from mtpchat.kernels import attention
from mtpchat.engine.events import Finished, Prefilled, Step
from tools.tiny import write_tiny_checkpoint
from helpers import random_ids, record_forms, rel_err

transformers = pytest.importorskip("transformers")

SHAPES = {
    "gqa3": dict(),                                                     # Hv/Hk = 3, untied
    "tied": dict(tie=True, linear_num_value_heads=4, num_hidden_layers=8, seed=1),   # Hv/Hk = 2, tied
}
PREFILL_CHUNK = 48      # prompts below cross it, and the GDN chunk of 64


@pytest.fixture(scope="module", params=list(SHAPES))
def ckpt(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **SHAPES[request.param])
    engine = Engine.load(path, prefill_chunk=PREFILL_CHUNK, max_context=512)
    reference = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return engine, reference


@pytest.mark.parametrize("n", [1, 7, 47, 48, 49, 64, 65, 97, 130])
def test_prefill_logits_match_transformers(ckpt, n):
    engine, ref = ckpt
    ids = random_ids(n, n, engine.config.vocab_size)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert rel_err(engine.logits(ids), expected) < 1e-4


def test_prefill_chunks_are_equal_and_aligned():
    # as few chunks as the most a chunk takes allows, equal, rounded up to the GDN's 64
    assert chunk_size(8195, 8192) == 4160 and chunk_size(8192, 8192) == 8192 and chunk_size(100, 8192) == 8192
    assert chunk_size(16385, 8192) == 5504 and chunk_size(260, 256) == 192 and chunk_size(40, 16) == 16
    for n, most in [(8195, 8192), (131077, 8192), (600, 512), (97, 48), (1, 48)]:
        size = chunk_size(n, most)
        assert size <= most and -(-n // size) == -(-n // most)


def test_a_prompt_just_past_a_chunk_goes_in_equal_chunks(ckpt):
    # 200 tokens under chunks of 192 go as 128 + 72, not 192 + 8, and the logits stay transformers'
    engine, ref = ckpt
    ids = random_ids(200, 200, engine.config.vocab_size)
    sizes = []
    hook = engine.model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    engine.decoder.prefill_chunk = 192
    try:
        got = engine.logits(ids)
    finally:
        engine.decoder.prefill_chunk = PREFILL_CHUNK
        hook.remove()
    assert sizes == [128, 72]
    with torch.no_grad():
        assert rel_err(got, ref(torch.tensor([ids])).logits[0]) < 1e-4


def prefill_with_forms(engine, plan, ids: list[int]):
    """A decoder of its own under `plan` prefills ids: (every row's logits, the forwards' forms)."""
    dec = Decoder(engine.model, None, DecodeState(engine.config, len(ids), engine.k_max, "cpu", torch.float32, False),
                  plan, PREFILL_CHUNK)
    forms = []
    hook = record_forms(engine.model, forms)
    try:
        return dec.logits(dec.prefill(ids, keep_all=True), rowwise=False), forms
    finally:
        hook.remove()


@pytest.mark.parametrize("n", [1, 4, 5, 7, 10])
def test_a_short_prefill_in_the_step_form_matches_transformers(ckpt, n):
    # a GPU's plan: a prompt of at most two pieces of a step's rows (CAPTURED_K + 1 = 5) goes as
    # verifies of equal pieces that keep every row; each piece folds the one before into the state
    engine, ref = ckpt
    ids = random_ids(n, 300 + n, engine.config.vocab_size)
    got, forms = prefill_with_forms(engine, engine.plan.replace(step_prefill=2), ids)
    pieces = -(-n // 5)
    assert forms == [(n // pieces + (i < n % pieces), "step") for i in range(pieces)]
    with torch.no_grad():
        assert rel_err(got, ref(torch.tensor([ids])).logits[0]) < 1e-4


def test_a_short_prefill_goes_in_graph_sized_chunks_and_step_pieces():
    # as few replays as the largest chunks that fit make, the rest in step pieces
    sizes = (8, 16, 24, 32, 40, 48, 56, 64)
    assert prefill_pieces(3, 5, 2, sizes, 4) == [(3, "step")]
    assert prefill_pieces(10, 5, 2, sizes, 4) == [(5, "step"), (5, "step")]
    assert prefill_pieces(11, 5, 2, sizes, 4) == [(8, "graph"), (3, "step")]
    assert prefill_pieces(63, 5, 2, sizes, 2) == [(56, "graph"), (4, "step"), (3, "step")]
    assert prefill_pieces(120, 5, 2, sizes, 2) == [(64, "graph"), (56, "graph")]
    assert prefill_pieces(138, 5, 2, sizes, 2) == [(64, "graph"), (64, "graph"), (5, "step"), (5, "step")]
    assert prefill_pieces(139, 5, 2, sizes, 2) is None               # more chunks: one eager forward
    assert prefill_pieces(200, 5, 2, sizes, 4) == [(64, "graph")] * 3 + [(8, "graph")]
    assert prefill_pieces(512, 5, 2, sizes, 2) is None and prefill_pieces(1000, 5, 2, sizes, 4) is None
    assert prefill_pieces(62, 5, 2, (8, 16, 32), 4) == [(32, "graph"), (16, "graph"), (8, "graph"),
                                                        (3, "step"), (3, "step")]
    assert prefill_pieces(63, 5, 2, (16, 32), 4) is None             # 32 + 16 + 15: three steps' rows
    assert prefill_pieces(56, 5, 2, (8, 16, 32), 4) == [(32, "graph"), (16, "graph"), (8, "graph")]
    # a length no graph route takes, which the load's warm-up prefills on a GPU (Engine.time_steps)
    for sizes_, most in ((PREFILL_GRAPHS, 2), (PREFILL_GRAPHS[:-2], 2), ((), 2), ((8, 16, 32), 4),
                         (PREFILL_GRAPHS, 3), (PREFILL_GRAPHS[:-2], 3), (PREFILL_GRAPHS[:-2], 1)):
        n = eager_prefill_length(5, 2, sizes_, most)
        assert prefill_pieces(n, 5, 2, sizes_, most) is None and prefill_pieces(n - 1, 5, 2, sizes_, most) is not None
    assert [eager_prefill_length(5, 2, s_, 2) for s_ in (PREFILL_GRAPHS, PREFILL_GRAPHS[:-2], ())] == [267, 139, 11]
    # the GPU plans' (KernelPlan.choose) without their early chunks: a bf16, FP8 or 4-bit MoE model, a
    # dense 4-bit one, and a plan of one chunk at most; then with them (a prompt from an empty cache
    # may take them)
    gpu_plans = ((PREFILL_GRAPHS, 3), (PREFILL_GRAPHS[:-2], 3), (PREFILL_GRAPHS[:-2], 1))
    assert [eager_prefill_length(5, 2, s_, m) for s_, m in gpu_plans] == [395, 203, 75]
    early = [eager_prefill_length(5, 2, s_, m, EARLY_GRAPHS, EARLY_ROWS) for s_, m in gpu_plans]
    assert early == [459, 203, 75]
    for n, (s_, m) in zip(early, gpu_plans):
        assert prefill_pieces(n, 5, 2, s_, m, 0, EARLY_GRAPHS, EARLY_ROWS) is None
    assert eager_prefill_length(5, 0, (), 2) == 1                     # the CPU's plan: every prefill eager
    # the GPU's sizes
    assert PREFILL_GRAPHS[-2:] == (96, 128)
    assert prefill_pieces(200, 5, 2, PREFILL_GRAPHS, 2) == [(128, "graph"), (64, "graph"), (4, "step"), (4, "step")]
    assert prefill_pieces(100, 5, 2, PREFILL_GRAPHS, 2) == [(96, "graph"), (4, "step")]
    assert prefill_pieces(266, 5, 2, PREFILL_GRAPHS, 2) == [(128, "graph")] * 2 + [(5, "step")] * 2
    assert prefill_pieces(267, 5, 2, PREFILL_GRAPHS, 2) is None
    assert prefill_pieces(37, 5, 2, sizes, 0) is None and prefill_pieces(37, 5, 0, sizes, 4) is None
    assert prefill_pieces(40, 5, 0, sizes, 4) == [(40, "graph")]
    assert prefill_pieces(8, 5, 0, (), 4) is None


def test_a_first_prompt_goes_in_the_early_chunks():
    # the larger sizes only where the chunk ends within the first EARLY_ROWS positions, counted with
    # the others (three chunks at most), the largest that fit first
    assert EARLY_GRAPHS == (256, 512) and EARLY_ROWS == 1024
    pieces = lambda n, start: prefill_pieces(n, 5, 2, PREFILL_GRAPHS, 3, start, EARLY_GRAPHS, EARLY_ROWS)
    assert pieces(512, 0) == [(512, "graph")]
    assert pieces(300, 0) == [(256, "graph"), (40, "graph"), (4, "step")]
    assert pieces(400, 0) == [(256, "graph"), (128, "graph"), (16, "graph")]
    assert pieces(700, 0) == [(512, "graph"), (128, "graph"), (56, "graph"), (4, "step")]
    assert pieces(1034, 0) == [(512, "graph"), (512, "graph"), (8, "graph"), (2, "step")]
    assert pieces(1000, 0) is None                                 # 512 + 256 + 128 leave 104: eager
    assert pieces(100, 0) == prefill_pieces(100, 5, 2, PREFILL_GRAPHS, 3)   # short: as before
    # after a history: an early chunk only as far as the first 1,024 rows
    assert pieces(300, 768) == [(256, "graph"), (40, "graph"), (4, "step")]    # ends at 1,024
    assert pieces(300, 769) == [(128, "graph"), (128, "graph"), (40, "graph"), (4, "step")]
    assert pieces(512, 600) == [(256, "graph"), (128, "graph"), (128, "graph")]
    assert pieces(512, 8192) is None and pieces(200, 8192) == prefill_pieces(200, 5, 2, PREFILL_GRAPHS, 3)
    eager = [n for n in range(11, 1035) if pieces(n, 0) is None]
    assert len(eager) == 243 and eager[:2] == [459, 460] and 512 not in eager
    # the candidate prefill_early_beside: one early chunk beside the three others, so that only
    # 971-991 and 1,003-1,023 of them go eager, in four chunks at most; after a long history nothing changes
    beside = lambda n, start: prefill_pieces(n, 5, 2, PREFILL_GRAPHS, 3, start, EARLY_GRAPHS, EARLY_ROWS, 1)
    assert beside(500, 0) == [(256, "graph"), (128, "graph"), (96, "graph"), (16, "graph"), (4, "step")]
    assert beside(1034, 0) == pieces(1034, 0) and beside(300, 0) == pieces(300, 0)
    assert [n for n in range(11, 1035) if beside(n, 0) is None] == [*range(971, 992), *range(1003, 1024)]
    assert max(sum(f == "graph" for _, f in beside(n, 0)) for n in range(11, 971)) == 4
    assert all(beside(n, 8192) == pieces(n, 8192) for n in range(1, 600, 7))
    assert eager_prefill_length(5, 2, PREFILL_GRAPHS, 3, EARLY_GRAPHS, EARLY_ROWS, 1) == 971


@pytest.mark.parametrize("history", [0, 70])
def test_early_chunks_read_the_first_rows_and_match_transformers(ckpt, history, monkeypatch):
    # a GPU's plan on the CPU (eager, no graphs) with early sizes of 48 and 64 over the first 128
    # rows: a first prompt's chunks take them, their attention over those rows alone, and the logits
    # stay transformers'; after a history of 70 the 64 no longer fits below 128 rows
    engine, ref = ckpt
    plan = engine.plan.replace(step_prefill=2, prefill_graphs=(8, 16, 32), prefill_pieces=3,
                               prefill_early=(48, 64), prefill_early_rows=128)
    ids = random_ids(history + 100, 900 + history, engine.config.vocab_size)
    dec = Decoder(engine.model, None, DecodeState(engine.config, 256, engine.k_max, "cpu", torch.float32, False),
                  plan, PREFILL_CHUNK)
    assert dec.state.rows > 256
    cache_rows, attend = [], attention.decode_attention

    def watched(q, k_cache, *args, **kw):
        cache_rows.append((q.shape[0], k_cache.shape[0]))
        return attend(q, k_cache, *args, **kw)

    forms = []
    hook = record_forms(engine.model, forms)
    monkeypatch.setattr(attention, "decode_attention", watched)
    try:
        kept = [dec.prefill(ids[:history], keep_all=True)] if history else []
        forms.clear()
        cache_rows.clear()
        kept.append(dec.prefill(ids[history:], keep_all=True))
        got = dec.logits(torch.cat(kept), rowwise=False)
    finally:
        hook.remove()
    want = [(64, "graph"), (32, "graph"), (4, "step")] if not history else \
        [(48, "graph"), (32, "graph"), (16, "graph"), (4, "step")]
    assert forms == want == prefill_pieces(100, dec.R, 2, (8, 16, 32), 3, history, (48, 64), 128)
    early = {T for T, f in want if T in (48, 64)}
    attention_layers = sum(1 for t in engine.config.layer_types if t == "full_attention")
    assert sorted(rows for T, rows in cache_rows if T in early) == [128] * attention_layers
    assert all(rows == dec.state.rows for T, rows in cache_rows if T not in early and T > 5)
    # an early size's graph names its rows: a plan swapped in with other rows finds none to replay
    assert [dec.chunk_key(T) for T in (32, 48, 64)] == [("prefill", 32), ("prefill", 48, 128), ("prefill", 64, 128)]
    dec.plan = plan.replace(prefill_early_rows=256)
    assert dec.chunk_key(64) == ("prefill", 64, 256) and dec.chunk_key(32) == ("prefill", 32)
    with torch.no_grad():
        assert rel_err(got, ref(torch.tensor([ids])).logits[0]) < 1e-4


@pytest.mark.parametrize("n", [11, 37, 56, 88])
def test_a_short_prefill_in_graph_sized_chunks_matches_transformers(ckpt, n):
    # a GPU's plan on the CPU (eager, no graphs): chunks of the captured sizes, their start read on
    # the device (attention by the steps' form), then step pieces; logits still transformers'
    engine, ref = ckpt
    plan = engine.plan.replace(step_prefill=2, prefill_graphs=(8, 16, 32), prefill_pieces=4)
    ids = random_ids(n, 500 + n, engine.config.vocab_size)
    got, forms = prefill_with_forms(engine, plan, ids)
    assert forms == prefill_pieces(n, engine.decoder.R, 2, (8, 16, 32), 4) and any(f == "graph" for _, f in forms)
    with torch.no_grad():
        assert rel_err(got, ref(torch.tensor([ids])).logits[0]) < 1e-4


@pytest.mark.parametrize("n", [1, 3, 8, 11])
def test_a_short_turn_in_the_step_form_goes_on_from_the_state(ckpt, n):
    # after a chunked history, a turn of n tokens in the step form (11: past two pieces, chunked)
    # leaves the state a chunked prefill leaves, and the logits of the whole sequence
    engine, ref = ckpt
    dec, V = engine.decoder, engine.config.vocab_size
    history, turn = random_ids(70, 70, V), random_ids(n, 400 + n, V)
    ends, forms = {}, []
    hook = record_forms(engine.model, forms)
    try:
        for pieces in (0, 2):
            dec.plan = engine.plan.replace(step_prefill=pieces)
            engine.reset()
            dec.begin(history)
            forms.clear()
            dec.begin(history + turn)
            assert {form for _, form in forms} == {"step" if pieces and n <= 10 else None}
            committed = dec.state.gdn_committed(engine.model, engine.plan.any_stride)
            kv = [k[:dec.length].clone() for k, _ in dec.state.kv_layers]
            ends[pieces] = dec.last_logits.clone(), committed, kv, dec.length, int(dec.pos)
    finally:
        dec.plan = engine.plan
        hook.remove()
        engine.reset()
    (chunked, s0, kv0, n0, p0), (stepped, s1, kv1, n1, p1) = ends[0], ends[2]
    assert n0 == n1 == p0 == p1 == len(history) + n
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(s0 + kv0, s1 + kv1))
    with torch.no_grad():
        expected = ref(torch.tensor([history + turn])).logits[0, -1:]
    assert rel_err(chunked, expected) < 1e-4 and rel_err(stepped, expected) < 1e-4


def test_the_plan_never_shrinks_as_the_context_grows():
    # the graphs' attention partials counted at the most spans of any cache up to the size, so the
    # search for the longest context that fits may bisect (memory.max_context_that_fits)
    from pathlib import Path
    from mtpchat.engine import memory
    from mtpchat.engine.config import ModelConfig
    config = ModelConfig.load(Path(__file__).resolve().parents[1] / "engine" / "configs" / "qwen3.6-27b.json")
    totals = [memory.plan_memory(config, n, weights="fp8").total for n in range(4096, 140_000, 1024)]
    assert all(a <= b for a, b in zip(totals, totals[1:]))


def test_tied_head_is_the_embedding(ckpt):
    engine, _ = ckpt
    c = engine.config
    assert (engine.model.head is engine.model.embed) == c.tie_word_embeddings
    assert not hasattr(engine.model, "lm_head") or not c.tie_word_embeddings


def test_decode_through_state_matches_full_forward(ckpt):
    engine, _ = ckpt
    ids = random_ids(90, 3, engine.config.vocab_size)
    full = engine.logits(ids)
    engine.mtp = False
    dec = engine.decoder
    with torch.inference_mode():
        dec.reset()
        dec.begin(ids[:20])                       # prefill the first 20, then one token at a time
        got = [dec.last_logits[0]]
        dec.limit(len(ids), set())
        for tok in ids[20:]:
            dec.next_tok.fill_(tok)                 # feed the prompt's token instead of the sampled one
            dec.last = tok
            dec.step(0, SamplingParams(), None)
            got.append(dec.v_logits[0].clone())
    assert rel_err(torch.stack(got[:-1]), full[19:-1]) < 1e-4
    engine.reset()


def test_greedy_generation_matches_transformers_generate(ckpt):
    engine, ref = ckpt
    engine.mtp = False
    for seed in range(3):
        ids = random_ids(11 + 17 * seed, 100 + seed, engine.config.vocab_size)
        with torch.no_grad():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        engine.reset()
        events = list(engine.generate(ids, SamplingParams(max_tokens=64, stop_token_ids=())))
        assert list(events[-1].token_ids) == expected


def test_events_and_stats(ckpt):
    engine, _ = ckpt
    engine.reset()
    engine.mtp = False
    events = list(engine.generate(random_ids(9, 5, engine.config.vocab_size), SamplingParams(max_tokens=12, stop_token_ids=())))
    assert isinstance(events[0], Prefilled) and events[0].prompt_tokens == 9
    steps = [e for e in events if isinstance(e, Step)]
    done = events[-1]
    assert isinstance(done, Finished) and done.reason == "length"
    assert [t for s in steps for t in s.token_ids] == list(done.token_ids) and len(done.token_ids) == 12
    assert done.stats.new_tokens == 12 and done.stats.steps == 11 and done.stats.tokens_per_s > 0
    assert done.stats.mean_acceptance_length == 1.0


def test_stop_token_ends_generation(ckpt):
    engine, _ = ckpt
    engine.mtp = False
    ids = random_ids(9, 5, engine.config.vocab_size)
    engine.reset()
    free = list(engine.generate(ids, SamplingParams(max_tokens=20, stop_token_ids=())))[-1].token_ids
    stop_at = free[6]
    engine.reset()
    done = list(engine.generate(ids, SamplingParams(max_tokens=20, stop_token_ids=(stop_at,))))[-1]
    assert done.reason == "stop" and done.token_ids == free[:free.index(stop_at) + 1]


def test_sampling_is_reproducible_for_a_seed(ckpt):
    engine, _ = ckpt
    engine.mtp = False
    ids = random_ids(9, 6, engine.config.vocab_size)
    params = SamplingParams(temperature=4.0, top_k=50, top_p=0.95, min_p=0.01, seed=7, max_tokens=24, stop_token_ids=())
    runs = []
    for seed in (7, 7, 8):
        engine.reset()
        runs.append(list(engine.generate(ids, SamplingParams(**{**params.__dict__, "seed": seed})))[-1].token_ids)
    assert runs[0] == runs[1] != runs[2]


def test_chat_turns_reuse_the_state(ckpt):
    engine, _ = ckpt
    engine.mtp = False
    ids = random_ids(30, 8, engine.config.vocab_size)
    p = SamplingParams(max_tokens=10, stop_token_ids=())
    engine.reset()
    first = list(engine.generate(ids, p))[-1].token_ids
    follow = ids + list(first) + random_ids(5, 9, engine.config.vocab_size)
    events = list(engine.generate(follow, p))
    assert events[0].cached_tokens == len(ids) + len(first) - 1   # the last emitted token was never fed
    engine.reset()
    fresh = list(engine.generate(follow, p))
    assert events[-1].token_ids == fresh[-1].token_ids and fresh[0].cached_tokens == 0
