"""Chat turns with thinking on: the template drops the <think> block of earlier replies, so a new
turn's prompt is not an extension of the tokens the engine fed. The engine resumes from a snapshot
of the state at the end of the rendered conversation (engine/snapshots.py), prefills only what
follows it, and answers exactly what a fresh full prefill of the same prompt answers."""
import shutil

import pytest
import torch

from mtpchat.chat.prompt import build_prompt, offers_preserve_thinking
from mtpchat.engine import Engine, SamplingParams, memory
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.decoder import prefill_pieces
from mtpchat.engine.plan import KernelPlan
from helpers import record_forms

# In the form of Qwen3.6's own template (ChatML; the last real user query found from the end, past
# tool responses; reasoning rendered for the turns after it, or for all with preserve_thinking).
OFFICIAL_STYLE = """\
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
           and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "system" or message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content.strip('\\n') %}
        {%- if (preserve_thinking is defined and preserve_thinking) or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""

QUESTIONS = ["Hello there, what is a river?", "And a mountain?", "Compare the two, please."]
GREEDY = dict(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def official(gqa3, tmp_path_factory):
    folder = tmp_path_factory.mktemp("official") / "ckpt"
    shutil.copytree(gqa3, folder)
    (folder / "chat_template.jinja").write_text(OFFICIAL_STYLE)
    return folder


def reply_message(engine, token_ids) -> dict:
    """The reply as the app keeps it: the thinking apart from the answer (the prompt opened <think>)."""
    text = engine.tokenizer.decode([t for t in token_ids if t not in engine.stop_ids])
    thinking, _, answer = text.partition("</think>")
    if not answer:   # a random model rarely closes its thinking: split it in two so both are there
        thinking, answer = text[:len(text) // 2], text[len(text) // 2:]
    return {"role": "assistant", "content": answer.strip("\n") or "ok", "reasoning_content": thinking.strip("\n")}


def fresh_tokens(folder, ids, mtp: bool, k: int = 3) -> list[int]:
    fresh = Engine.load(folder, device="cpu", dtype=torch.float32, max_context=2048, snapshots=0,
                        mtp=mtp, draft_tokens=k)
    return list(list(fresh.generate(ids, SamplingParams(**GREEDY)))[-1].token_ids)


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("step_prefill", [0, 2])
def test_three_turns_prefill_only_what_follows_the_snapshot(official, mtp, step_prefill):
    # step_prefill 2 and graph-sized chunks (a GPU's plan): the generation prompt after the snapshot
    # goes in the step form, a short message in chunks of the graphs' sizes
    plan = KernelPlan.choose("cpu", ModelConfig.load(official), fp8=False)
    if step_prefill:
        plan = plan.replace(step_prefill=step_prefill, prefill_graphs=(8, 16, 32))
    engine = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048, mtp=mtp, plan=plan)
    assert engine.decoder.snapshots.count == memory.DEFAULT_SNAPSHOTS
    forms, calls = [], []                        # each target forward's (tokens, form); each prefill's
    hook = record_forms(engine.model, forms)     # (tokens fed, its forwards' forms)
    prefill = engine.decoder.prefill

    def recorded(ids, **kw):
        forms.clear()
        h = prefill(ids, **kw)
        calls.append((len(ids), list(forms)))
        return h

    engine.decoder.prefill = recorded
    messages, history_before, graphed = [], None, 0
    for turn, question in enumerate(QUESTIONS):
        calls.clear()
        messages.append({"role": "user", "content": question})
        ids, keep_at = build_prompt(engine.tokenizer, messages, think=True)
        history = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        assert keep_at == (len(history),) and ids[:len(history)] == history
        events = list(engine.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))
        prefilled, done = events[0], events[-1]
        if turn == 0:
            assert prefilled.cached_tokens == 0
        else:
            # the last reply's thinking is gone from the prompt: the state at the end of the previous
            # rendered conversation is where this prompt leaves what was fed
            assert prefilled.cached_tokens == done.stats.reused_tokens == history_before
            assert ids[:history_before] == engine.tokenizer.apply_chat_template(messages[:-2],
                                                                                add_generation_prompt=False)
        assert sum(n for n, _ in calls) == len(ids) - prefilled.cached_tokens   # what follows, no more
        # the generation prompt (10 tokens of this tokenizer): two pieces of 5 in the step form
        assert calls[-1][1] == ([(5, "step"), (5, "step")] if step_prefill else [(10, None)]), calls
        if turn and step_prefill:                # the message: chunks of the graphs' sizes, step pieces
            n, message = calls[-2]
            assert message == prefill_pieces(n, engine.decoder.R, 2, (8, 16, 32), plan.prefill_pieces), calls
            graphed += any(form == "graph" for _, form in message)
        assert list(done.token_ids) == fresh_tokens(official, ids, mtp), turn
        messages.append(reply_message(engine, done.token_ids))
        history_before = len(history)
    hook.remove()
    assert graphed == (2 if step_prefill else 0)     # both later messages took a graph-sized chunk
    assert len(engine.decoder.snapshots.held) <= engine.decoder.snapshots.count


def test_regenerate_resumes_at_the_end_of_the_conversation(official):
    engine = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ids, keep_at = build_prompt(engine.tokenizer, messages, think=True)
    first = list(engine.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))
    again = list(engine.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))
    assert again[0].cached_tokens == keep_at[0]       # only the generation prompt is fed again
    assert again[-1].token_ids == first[-1].token_ids


def test_a_snapshot_whose_positions_were_rewritten_is_not_used(official):
    engine = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048)
    chat_a = [{"role": "user", "content": QUESTIONS[0]}]
    ids_a, keep_a = build_prompt(engine.tokenizer, chat_a, think=True)
    done = list(engine.generate(ids_a, SamplingParams(**GREEDY), snapshot_at=keep_a))[-1]
    # another chat fills the same positions, then chat A goes on: its snapshots are void
    other, keep_o = build_prompt(engine.tokenizer, [{"role": "user", "content": "Something else " * 20}], True)
    list(engine.generate(other, SamplingParams(**GREEDY), snapshot_at=keep_o))
    chat_a += [reply_message(engine, done.token_ids), {"role": "user", "content": QUESTIONS[1]}]
    ids, keep_at = build_prompt(engine.tokenizer, chat_a, think=True)
    events = list(engine.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))
    assert events[0].cached_tokens == 0
    assert list(events[-1].token_ids) == fresh_tokens(official, ids, mtp=True)


def test_snapshots_stay_within_their_slots_and_the_plan(official):
    engine = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048, snapshots=2)
    messages = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        ids, keep_at = build_prompt(engine.tokenizer, messages, think=True)
        done = list(engine.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))[-1]
        messages.append(reply_message(engine, done.token_ids))
        assert len(engine.decoder.snapshots.held) <= 2
    plan = memory.plan_memory(engine.config, 2048, engine.k_max, "float32", snapshots=2)
    assert engine.memory()["snapshots"] == plan.snapshots == 2 * memory.snapshot_bytes(engine.config, "float32")
    off = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048, snapshots=0)
    ids, keep_at = build_prompt(off.tokenizer, messages[:1], think=True)
    list(off.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))
    assert off.memory()["snapshots"] == 0 and not off.decoder.snapshots.held


def test_preserve_thinking_is_offered_where_the_template_reads_it(official, gqa3):
    engine = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048)
    assert offers_preserve_thinking(engine.tokenizer)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
                {"role": "user", "content": "c"}]
    dropped, _ = build_prompt(engine.tokenizer, messages, think=True)
    kept, keep_at = build_prompt(engine.tokenizer, messages, think=True, keep_thinking=True)
    decode = engine.tokenizer.decode
    assert "<think>\nr\n</think>\n\nb" in decode(kept) and "<think>\nr" not in decode(dropped)
    assert keep_at and decode(kept[keep_at[0]:]) == "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("mtp", [False, True])
def test_the_end_of_a_reply_is_a_resume_point(official, mtp):
    # the state after a reply, the GDN fold of its last step pending, is kept: two different follow-ups
    # of that reply (an edited message, with the reply's own tokens kept) each resume right after it
    engine = Engine.load(official, device="cpu", dtype=torch.float32, max_context=2048, mtp=mtp)
    tok = engine.tokenizer
    ids, keep_at = build_prompt(tok, [{"role": "user", "content": QUESTIONS[0]}], think=True)
    reply = list(list(engine.generate(ids, SamplingParams(**GREEDY), snapshot_at=keep_at))[-1].token_ids)
    end = ids + reply[:-1]                         # what the engine fed: all but the reply's last token
    for follow_up in ("Tell me more.", "No, about mountains instead."):
        nxt = ids + reply + tok.encode(f"\n{follow_up}")
        events = list(engine.generate(nxt, SamplingParams(**GREEDY)))
        assert events[0].cached_tokens == len(end)
        assert list(events[-1].token_ids) == fresh_tokens(official, nxt, mtp)


def test_the_bench_times_a_turn_after_a_long_history(gqa3):
    from mtpchat.engine import bench
    engine = Engine.load(gqa3, device="cpu", dtype=torch.float32, max_context=512)
    turn = bench.second_turn(engine, history=300, new=20, reply=4, repeats=1)
    assert turn["second_reused"] == 300 and turn["first_ms"] > 0 and turn["second_ms"] > 0
