"""`mtpchat serve` answers `logprobs` as OpenAI's API does: chat's `logprobs.content` entries (whole
and per streamed chunk) and the legacy completions lists, from a real server on the demo model
(MTP on, so steps emit several tokens), through the official client."""
from __future__ import annotations

import math

import httpx
import pytest
from serve_support import PROMPT, ServeProcess

MAX = 24
ASK = {"model": "demo", "temperature": 0, "max_tokens": MAX}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("serve"))
    yield proc.url
    proc.stop()


def check_greedy(entries, top):
    assert entries, "no logprobs came back"
    for e in entries:
        assert e["logprob"] <= 0 and math.isfinite(e["logprob"])
        assert e["bytes"] == list(e["token"].encode("utf-8"))
        assert len(e["top_logprobs"]) == top
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        if top:   # greedy: the token chosen is the most likely one
            assert e["top_logprobs"][0]["token"] == e["token"]
            assert abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6


def test_chat_logprobs_whole_and_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **ASK)
    entries = [e.model_dump() for e in whole.choices[0].logprobs.content]
    check_greedy(entries, 3)
    assert whole.choices[0].message.content in "".join(e["token"] for e in entries)
    streamed, chunks = [], 0
    for chunk in client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, stream=True,
                                                **ASK):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                chunks += 1
                streamed += [e.model_dump() for e in choice.logprobs.content]
    assert chunks > 1                                  # each delta carries its own tokens' entries
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(streamed, entries))
    plain = client.chat.completions.create(messages=messages, **ASK)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content
    alone = client.chat.completions.create(messages=messages, logprobs=True, **ASK)
    check_greedy([e.model_dump() for e in alone.choices[0].logprobs.content], 0)


def test_completion_logprobs_whole_and_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    whole = client.completions.create(prompt=PROMPT, logprobs=2, **ASK)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 1
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-6) and top[token] == value
    tokens, offsets = [], []
    for chunk in client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **ASK):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_top_logprobs_past_20_or_without_logprobs_are_refused(server):
    body = {**ASK, "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs")):
        got = httpx.post(server + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert got.status_code == 400 and got.json()["error"]["param"] == param
