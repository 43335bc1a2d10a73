"""`mtpchat serve` as a real process: the official openai client, `mtpchat run --server`, /metrics,
a client that leaves mid-stream, the queue bound, the API key. Greedy output and the acceptance
figures must equal the in-process engine's on the same checkpoint."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from serve_support import CONTEXT, MAX_TOKENS, PROMPT, ServeProcess, in_process

from mtpchat import cli
from mtpchat.remote import metrics


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("serve"), "--max-waiting", "1")
    yield proc.url
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    return in_process()


def spec_of(stats: dict) -> dict:
    """The in-process figures in vLLM's per-request shape: the histogram counts the steps that accepted
    exactly j drafts, from the per-position rates (steps that accepted at least i+1)."""
    steps = stats["verify_steps"]
    at = [round(p * steps) for p in stats["per_position_acceptance"]]
    hist = [steps - at[0]] + [a - b for a, b in zip(at, at[1:] + [0])]
    assert sum(hist) == steps and sum(j * n for j, n in enumerate(hist)) == stats["accepted"]
    return {"num_spec_steps": steps, "num_draft_tokens": stats["drafted"], "num_accepted_draft_tokens": stats["accepted"],
            "acceptance_histogram": hist, "num_spec_tokens": len(at),
            "mean_acceptance_length": pytest.approx(stats["mean_acceptance_length"], abs=1e-4),
            "draft_acceptance_rate": pytest.approx(stats["draft_acceptance_rate"], abs=1e-4)}


def test_openai_client_streams_what_the_engine_gives_in_process(server, reference):
    openai = pytest.importorskip("openai")
    thinking, answer, stats = reference
    assert stats["accepted"] > 0 and stats["verify_steps"] > 0, "acceptance figures of zeros prove nothing"
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    listed = client.models.list().data
    assert len(listed) == 1 and listed[0].id.endswith("demo") and listed[0].model_extra["max_model_len"] == CONTEXT
    got_think, got_answer, spec, used = [], [], None, None
    for chunk in client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": PROMPT}], stream=True, temperature=0,
            max_tokens=MAX_TOKENS, stream_options={"include_usage": True}):
        extra = chunk.model_extra or {}
        spec = (extra.get("metrics") or {}).get("speculative_decoding") or spec
        used = chunk.usage or used
        for choice in chunk.choices:
            got_think.append((choice.delta.model_extra or {}).get("reasoning") or "")
            got_answer.append(choice.delta.content or "")
    assert ("".join(got_think), "".join(got_answer)) == (thinking, answer)
    assert used.completion_tokens == stats["new_tokens"] and used.prompt_tokens == stats["prompt_tokens"]
    assert spec == spec_of(stats)
    # not streamed: the same reply in one object
    whole = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == answer
    assert whole.model_extra["metrics"]["speculative_decoding"] == spec_of(stats)


def test_run_server_prints_the_in_process_answer_and_acceptance(server, reference, capsys, tmp_path, monkeypatch):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    thinking, answer, stats = reference
    code = cli.main(["run", "--server", server, "--prompt", PROMPT, "--temperature", "0",
                     "--max-tokens", str(MAX_TOKENS), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = json.loads(out)
    assert (got["reasoning"], got["text"]) == (thinking, answer)
    for key in ("mean_acceptance_length", "draft_acceptance_rate", "per_position_acceptance", "verify_steps",
                "drafted", "accepted", "new_tokens"):
        assert got["stats"][key] == stats[key], key
    assert got["stats"]["source"] == "per request" and got["stats"]["tokens_per_s"] > 0
    # streamed to the terminal: the answer on stdout, the summary with the acceptance on stderr
    code = cli.main(["run", "--server", server + "/v1/", "--prompt", PROMPT, "--temperature", "0",
                     "--max-tokens", str(MAX_TOKENS)])
    out, err = capsys.readouterr()
    assert code == 0 and out == answer + "\n"
    assert f"mean acceptance length {stats['mean_acceptance_length']:.2f}" in err and "Traceback" not in err


def test_metrics_around_a_request_give_its_counts(server, reference):
    _, _, stats = reference
    before = metrics.parse(httpx.get(server + "/metrics").text)
    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": MAX_TOKENS})
    after = metrics.parse(httpx.get(server + "/metrics").text)
    assert r.status_code == 200
    spec = metrics.between(before, after, stats["new_tokens"])
    assert spec.exact and spec.source == "vLLM /metrics"
    expected = spec_of(stats)
    assert (spec.verify_steps, spec.drafted, spec.accepted) == \
        (expected["num_spec_steps"], expected["num_draft_tokens"], expected["num_accepted_draft_tokens"])
    assert spec.at_least == [round(p * spec.verify_steps) for p in stats["per_position_acceptance"]]
    assert r.json()["metrics"]["speculative_decoding"] == expected
    health = httpx.get(server + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def _finished(url: str, reason: str) -> float:
    page = httpx.get(url + "/metrics").text
    for line in page.splitlines():
        if line.startswith("vllm:request_success_total") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _generated(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("vllm:generation_tokens_total"))
    return float(line.rsplit(" ", 1)[1])


# seconds of generation on the CPU unless cancelled: long enough to act on while it runs
LONG = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": CONTEXT - 64, "ignore_eos": True,
        "temperature": 0, "stream": True}


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_client_leaving_mid_stream_cancels_the_generation(server):
    aborted, generated = _finished(server, "abort"), _generated(server)
    with httpx.stream("POST", server + "/v1/chat/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
        assert len(got) >= 3
    # the connection is closed: the engine stops at its next step, long before its token limit
    _wait(lambda: _finished(server, "abort") == aborted + 1, "the generation to be cancelled")
    assert _generated(server) - generated < LONG["max_tokens"] // 2
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "x = 1"}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_one_generation_at_a_time_then_429_past_the_queue_bound(server):
    started, results = threading.Event(), {}
    release = threading.Event()     # set: the first client leaves, which ends its generation

    def long_stream():
        with httpx.stream("POST", server + "/v1/chat/completions", json=LONG, timeout=60) as r:
            lines = r.iter_lines()     # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data:")
            started.set()
            release.wait(30)

    def waiter():
        results["second"] = httpx.post(server + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "y = 2"}], "max_tokens": 4, "temperature": 0})
    first = threading.Thread(target=long_stream)
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=waiter)
    second.start()
    _wait(lambda: 'vllm:num_requests_waiting{model_name' in (page := httpx.get(server + "/metrics").text)
          and any(x.startswith("vllm:num_requests_waiting") and x.endswith(" 1.0") for x in page.splitlines()),
          "the second request to wait")
    third = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "z = 3"}], "max_tokens": 4})
    assert third.status_code == 429
    assert "busy" in third.json()["error"]["message"] and third.json()["error"]["code"] == 429
    assert third.headers["Retry-After"] == "1"
    release.set()
    first.join(30)
    second.join(60)
    assert results["second"].status_code == 200


def test_bad_requests_get_a_400_that_names_the_field(server):
    for body, word in (({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n"),
                       ({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}, "temperature")):
        r = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and word in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_stop_strings_cut_the_reply_where_they_start(server, reference):
    thinking, answer, _ = reference
    assert len(thinking) > 12
    stop = thinking[5:9]    # the output is cut at its first occurrence, before the answer begins
    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": MAX_TOKENS,
        "stop": [stop, "never in it"], "chat_template_kwargs": {"enable_thinking": True}})
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning"] == thinking[:thinking.index(stop)] and not choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] < MAX_TOKENS


def test_stop_strings_cut_a_stream_too(server, reference):
    thinking, _, _ = reference
    stop = thinking[5:9]
    think, content, finish = [], [], None
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": MAX_TOKENS,
            "stop": stop, "stream": True}) as r:
        for line in r.iter_lines():
            for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                think.append(choice["delta"].get("reasoning") or "")
                content.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    assert "".join(think) == thinking[:thinking.index(stop)] and not "".join(content) and finish == "stop"


def test_stop_strings_match_across_pieces_and_give_back_what_held_no_stop():
    from mtpchat.chat.stops import StopStrings
    stops = StopStrings(["</end>", "xyz"])
    assert stops.push("ab") + stops.push("c</e") + stops.push("nd>tail") + stops.flush() == "abc"
    assert stops.hit and stops.push("more") == ""
    stops = StopStrings(["</end>"])
    assert stops.push("hello </en") + stops.push("d-less") + stops.flush() == "hello </end-less"
    assert not stops.hit


def test_per_request_figures_round_trip_through_vllm_s_histogram():
    from mtpchat.engine.events import Stats
    from mtpchat.serve_metrics import spec_metrics
    # 10 steps of up to 3 drafts (adaptive k): 6 accepted the first, 2 the first two, none all three
    stats = Stats(verify_steps=10, drafted=26, accepted=8, accepted_at_least=[6, 2], k_histogram={2: 4, 3: 6})
    sent = spec_metrics(stats)["speculative_decoding"]
    assert sent["acceptance_histogram"] == [4, 4, 2, 0] and sent["num_spec_tokens"] == 3
    assert sent["mean_acceptance_length"] == 1.8 and sent["draft_acceptance_rate"] == pytest.approx(8 / 26)
    got = metrics.from_response({"metrics": spec_metrics(stats)})
    assert (got.verify_steps, got.drafted, got.accepted, got.at_least) == (10, 26, 8, [6, 2, 0])
    assert spec_metrics(Stats())["speculative_decoding"]["acceptance_histogram"] == [0]     # MTP off


def test_a_client_leaving_before_a_whole_answer_cancels_it_too(server):
    aborted, generated = _finished(server, "abort"), _generated(server)
    with pytest.raises(httpx.ReadTimeout):     # not streamed: the client gives up waiting
        httpx.post(server + "/v1/chat/completions", json=dict(LONG, stream=False), timeout=httpx.Timeout(60, read=2))
    _wait(lambda: _finished(server, "abort") == aborted + 1, "the generation to be cancelled")
    assert _generated(server) - generated < LONG["max_tokens"] // 2


def test_another_host_needs_a_key_and_a_keyed_server_refuses_others(tmp_path, capsys, monkeypatch):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    monkeypatch.delenv("MTPCHAT_API_KEY", raising=False)
    code = cli.main(["serve", "--host", "0.0.0.0", "--model", "/nonexistent"])
    err = capsys.readouterr().err
    assert code == 2 and "--api-key" in err and "Traceback" not in err and err.count("\n") == 1
    cli.main(["serve", "--host", "0.0.0.0", "--api-key", "k", "--model", "/nonexistent"])
    assert "--api-key" not in capsys.readouterr().err      # with a key, the bind is allowed: the model is what fails
    proc = ServeProcess(tmp_path, "--api-key", "s3cret")
    try:
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        assert httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        code = cli.main(["run", "--server", proc.url, "--api-key", "wrong", "--prompt", "hi"])
        err = capsys.readouterr().err
        assert code == 1 and "refused the API key" in err and "--api-key" in err and "Traceback" not in err
        assert err.count("\n") == 1
    finally:
        proc.stop()
