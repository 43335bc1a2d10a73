"""Qwen3.8-style chat templates: reasoning_effort (xhigh by default, medium, low; anything else raised
by the template), preserve_thinking on by default, reasoning read from reasoning_content only. The
template is tests/data/qwen38_style.jinja, written for the tests with that behaviour; it is rendered
through the chat layer, `run` and `serve`, and a second turn resumes with every token reused."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)
from mtpchat import cli, loader, models
from mtpchat.chat import prompt as P
from mtpchat.chat.prompt import SwitchError, Switches, build_prompt, request_switches
from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.tokenizer import Tokenizer, TokenizerError

TEMPLATE = (Path(__file__).parent / "data" / "qwen38_style.jinja").read_text()
XHIGH = "Reasoning effort: extra high."
LOW = "Reasoning effort: low."
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello, what is a river?"}]
GREEDY = dict(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def q38(gqa3, tmp_path_factory):
    folder = tmp_path_factory.mktemp("q38") / "ckpt"
    shutil.copytree(gqa3, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def tok(q38):
    return Tokenizer.load(q38)


@pytest.fixture(scope="module")
def tok36(gqa3):
    return Tokenizer.load(gqa3)      # the bundled Qwen3.5/3.6-style template: no reasoning_effort


def text(tok, ids):
    return tok.decode(ids)


# ---- aliases ------------------------------------------------------------------------------------

def test_the_aliases_name_qwen38_and_plan_its_memory(capsys, monkeypatch):
    for name, repo, fmt in (("Qwen3.8-27B", "Qwen/Qwen3.8-27B", "bf16"), ("Qwen3.8-27B-FP8", "Qwen/Qwen3.8-27B-FP8", "fp8")):
        assert models.classify(name.lower()) == ("repo", repo, models.lookup_alias(name))
        assert models.lookup_alias(name).format == fmt
    assert models.release("Qwen3.8-27B", "fp8").name == "Qwen3.8-27B-FP8"
    assert models.alias_config(models.lookup_alias("Qwen3.8-27B")) == models.alias_config(
        models.lookup_alias("Qwen3.6-27B"))                 # the same architecture and shapes
    assert "Qwen3.8-27B-FP8" in "\n".join(models.list_models())
    assert models.suggest_alias("Qwen3.8-72B") == "Qwen3.8-27B"
    monkeypatch.setattr(loader, "pick_device", lambda requested, said=None: ("cuda", False))
    monkeypatch.setattr(loader, "device_memory", lambda device: (40 * 2 ** 30, 80 * 2 ** 30))
    code = cli.main(["run", "--model", "Qwen3.8-27B", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 1 and "model: Qwen3.8-27B" in out and "Traceback" not in err
    assert "what fits: --model Qwen3.8-27B-FP8" in out       # the error hint names its FP8 release
    code = cli.main(["run", "--model", "Qwen3.8-27B-FP8", "--dry-run"])
    assert code == 0 and "FP8 weights" in capsys.readouterr().out


# ---- the template's switches, rendered ----------------------------------------------------------

def test_levels_and_defaults_are_read_from_the_template(tok, tok36):
    assert P.reasoning_efforts(tok) == ("low", "medium", "xhigh") and P.default_effort(tok) == "xhigh"
    assert P.keeps_thinking_by_default(tok)
    assert P.reasoning_efforts(tok36) == () and P.default_effort(tok36) is None
    assert not P.keeps_thinking_by_default(tok36)


@pytest.mark.parametrize("effort, think, note", [
    (None, True, XHIGH), ("xhigh", True, XHIGH), ("medium", True, None), ("low", True, LOW),
    ("xhigh", False, None), ("low", False, None), ("medium", False, None)])
def test_each_effort_and_thinking_off_render(tok, effort, think, note):
    ids, keep_at = build_prompt(tok, CHAT, think, effort=effort)
    shown = text(tok, ids)
    system = "<|im_start|>system\n" + (note + " " if note else "")
    assert shown.startswith(system)
    # the instruction leads the system message, before the user's own system prompt
    if note:
        assert shown.index(note) < shown.index("Be terse.")
    else:
        assert "Reasoning effort" not in shown and shown.startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert shown.endswith("<|im_start|>assistant\n" + ("<think>\n" if think else "<think>\n\n</think>\n\n"))
    # the markup is single special ids, the text plain: the ids are what transformers would make
    assert ids[0] == tok.im_start_id and ids.count(tok.im_start_id) == 3
    tail = [tok.think_start_id] + tok.encode("\n") if think else \
        [tok.think_start_id] + tok.encode("\n\n") + [tok.think_end_id] + tok.encode("\n\n")
    assert ids[-len(tail):] == tail
    assert keep_at == (len(tok.apply_chat_template(CHAT, add_generation_prompt=False, enable_thinking=think,
                                                   **({"reasoning_effort": effort} if effort else {}))),)


def test_the_instruction_comes_before_the_tools(tok):
    shown = tok.render_chat(CHAT, tools=TOOLS, reasoning_effort="low")
    assert shown.index(LOW) < shown.index("# Tools") < shown.index('"weather"') < shown.index("Be terse.")
    bare = tok.render_chat(CHAT[1:], reasoning_effort="medium")
    assert bare.startswith("<|im_start|>user\n")            # medium and no system prompt: no system message


def test_a_level_the_template_refuses_is_one_clear_line(tok, tok36):
    with pytest.raises(SwitchError, match=r"^reasoning_effort 'high': this model's chat template takes low, "
                                          r"medium, xhigh$"):
        build_prompt(tok, CHAT, True, effort="high")
    with pytest.raises(SwitchError, match="has no reasoning_effort"):
        build_prompt(tok36, CHAT, True, effort="low")
    # rendered straight, the template's own refusal is a TokenizerError, not a jinja traceback
    with pytest.raises(TokenizerError, match="reasoning_effort must be one of xhigh, medium, low; got max"):
        tok.apply_chat_template(CHAT, reasoning_effort="max")


def test_thinking_is_preserved_by_default_and_read_from_reasoning_content(tok, tok36):
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": "<think>inline</think>\n\nb", "reasoning_content": "kept"},
               {"role": "user", "content": "c"}]
    shown = text(tok, build_prompt(tok, history, True)[0])
    assert "<think>\nkept\n</think>\n\n<think>inline</think>\n\nb<|im_end|>" in shown
    assert "kept" not in text(tok, build_prompt(tok, history, True, keep_thinking=False)[0])
    # inline tags in an answer stay text: no reasoning_content taken from them
    bare = [history[0], {"role": "assistant", "content": "<think>inline</think>b"}, history[2]]
    assert "<think>\n\n</think>\n\n<think>inline</think>b" in text(tok, build_prompt(tok, bare, True)[0])
    # the Qwen3.5/3.6 template still takes an answer's leading thinking as its reasoning
    assert "inline" not in text(tok36, build_prompt(tok36, bare, True)[0])


# ---- serve's per-request switches ---------------------------------------------------------------

def test_request_switches_merge_over_the_server_defaults(tok, tok36):
    base = Switches(think=True, keep_thinking=None, effort="low")
    assert request_switches(tok, base, {}) == base
    assert request_switches(tok, base, {"reasoning_effort": "medium"}).effort == "medium"
    got = request_switches(tok, base, {"reasoning_effort": "medium", "chat_template_kwargs": {
        "reasoning_effort": "xhigh", "enable_thinking": False, "preserve_thinking": False}})
    assert got == Switches(think=False, keep_thinking=False, effort="xhigh")
    assert request_switches(tok36, Switches(), {"chat_template_kwargs": {"enable_thinking": False}}).think is False
    for body, param, words in [
            ({"chat_template_kwargs": {"enable_thinking": True, "foo": 1, "bar": 2}}, "chat_template_kwargs",
             "'bar', 'foo' not supported"),
            ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
            ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs", "true or false"),
            ({"reasoning_effort": "high"}, "reasoning_effort", "takes low, medium, xhigh"),
            ({"reasoning_effort": 3}, "reasoning_effort", "must be a string"),
            ({"chat_template_kwargs": {"reasoning_effort": "none"}}, "chat_template_kwargs",
             "chat_template_kwargs.reasoning_effort 'none'")]:
        with pytest.raises(SwitchError, match=words) as e:
            request_switches(tok, base, body)
        assert e.value.param == param
    with pytest.raises(SwitchError, match="has no reasoning_effort"):
        request_switches(tok36, Switches(), {"reasoning_effort": "low"})


class Recorder:
    """An engine's chat side for the server: the real tokenizer; generate records the prompt."""

    def __init__(self, engine):
        from mtpchat.chat.engine import LocalEngine
        self.inner = LocalEngine(engine)
        self.prompts = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt_ids, params, snapshot_at=()):
        self.prompts.append(list(prompt_ids))
        return self.inner.generate(prompt_ids, params, snapshot_at)


def test_serve_renders_each_request_s_switches_and_refuses_bad_ones(q38, tok):
    from starlette.testclient import TestClient
    from mtpchat.serve import build_app
    from mtpchat.serve_request import Defaults
    engine = Recorder(Engine.load(q38, device="cpu", dtype=torch.float32, max_context=512))
    params = SamplingParams(max_tokens=512, stop_token_ids=tuple(engine.stop_ids))
    app = build_app(engine, model="q38", defaults=Defaults(params, Switches(think=True, effort="medium")))
    user = [{"role": "user", "content": "Hi"}]
    with TestClient(app, base_url="http://127.0.0.1") as client:     # a keyless server answers loopback names
        def ask(**extra):
            r = client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 2, **extra})
            return r.status_code, r.json()
        cases = [({}, "medium", True), ({"reasoning_effort": "low"}, "low", True),
                 ({"chat_template_kwargs": {"reasoning_effort": "xhigh"}}, "xhigh", True),
                 ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, "low", False)]
        for extra, effort, think in cases:
            code, body = ask(**extra)
            assert code == 200, body
            assert engine.prompts[-1] == build_prompt(tok, user, think, effort=effort)[0]
        assert len(set(map(tuple, engine.prompts))) == 4       # four renderings, told apart
        for extra, param, words in [({"reasoning_effort": "high"}, "reasoning_effort", "takes low, medium, xhigh"),
                                    ({"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs",
                                     "'thinking' not supported")]:
            code, body = ask(**extra)
            assert code == 400 and body["error"]["param"] == param and words in body["error"]["message"]
            assert body["error"]["type"] == "invalid_request_error"
        assert len(engine.prompts) == 4                        # nothing refused reached the engine


# ---- run ----------------------------------------------------------------------------------------

def test_run_renders_the_effort_and_refuses_what_the_template_does_not_take(q38, gqa3, tok, capsys):
    def run(*argv):
        code = cli.main(["run", "--model", str(q38), "--device", "cpu", "--prompt", "Hi", "--max-tokens", "2",
                         "--temperature", "0", *map(str, argv)])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err
    user = [{"role": "user", "content": "Hi"}]
    for flags, think, effort in [((), True, None), (("--reasoning-effort", "low"), True, "low"),
                                 (("--reasoning-effort", "MEDIUM"), True, "medium"),
                                 (("--reasoning-effort", "xhigh", "--no-think"), False, "xhigh")]:
        code, out, err = run("--json", *flags)
        assert code == 0, err
        assert json.loads(out)["prompt_tokens"] == len(build_prompt(tok, user, think, effort=effort)[0])
    lengths = {len(build_prompt(tok, user, True, effort=e)[0]) for e in ("low", "medium", "xhigh")}
    assert len(lengths) == 3                                  # the three counts above can tell them apart
    code, _, err = run("--reasoning-effort", "high")
    assert code == 2 and err.strip() == ("mtpchat: error: --reasoning-effort 'high': this model's chat template "
                                         "takes low, medium, xhigh")
    code = cli.main(["run", "--model", str(gqa3), "--device", "cpu", "--prompt", "Hi", "--reasoning-effort", "low"])
    err = capsys.readouterr().err
    assert code == 2 and "--reasoning-effort 'low': this model's chat template has no reasoning_effort" in err
    code = cli.main(["run", "--model", str(q38), "--reasoning-effort", "x-high", "--prompt", "Hi"])
    assert code == 2 and "--reasoning-effort: must be a level" in capsys.readouterr().err


def test_the_settings_file_sets_the_effort(q38, tok, tmp_path, capsys):
    (tmp_path / "settings.toml").write_text('reasoning_effort = "low"\npreserve_thinking = false\n')
    code = cli.main(["run", "--model", str(q38), "--device", "cpu", "--prompt", "Hi", "--max-tokens", "2", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["prompt_tokens"] == len(
        build_prompt(tok, [{"role": "user", "content": "Hi"}], True, effort="low")[0])


# ---- turns: with thinking preserved the history never changes ---------------------------------

def reply_tokens(tok, messages, reasoning: str, answer: str) -> tuple[dict, list[int]]:
    """An assistant reply and the tokens a model gives for it (up to its <|im_end|>), as the template
    renders it once it is history."""
    reply = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    ids, _ = build_prompt(tok, messages, True)
    later = tok.apply_chat_template(messages + [reply], add_generation_prompt=False)
    assert later[:len(ids)] == ids                          # the reply's history begins with its prompt
    end = later.index(tok.im_end_id, len(ids))
    return reply, later[len(ids):end]


@pytest.mark.parametrize("effort", ["xhigh", "medium"])
def test_a_second_turn_reuses_every_token_of_the_first(q38, tok, effort):
    engine = Engine.load(q38, device="cpu", dtype=torch.float32, max_context=1024)
    messages = [{"role": "user", "content": "Hello there, what is a river?"}]
    reply, said = reply_tokens(tok, messages, "Water that flows.", "A river is flowing water.")
    ids, keep_at = build_prompt(engine.tokenizer, messages, True, effort=effort)
    # the model's turn: its reply's tokens fed, as after a reply that ends in <|im_end|>
    first = list(engine.generate(ids + said, SamplingParams(**{**GREEDY, "max_tokens": 1}), snapshot_at=keep_at))
    assert first[0].cached_tokens == 0
    messages += [reply, {"role": "user", "content": "And a mountain?"}]
    ids2, keep2 = build_prompt(engine.tokenizer, messages, True, effort=effort)
    assert ids2[:len(ids) + len(said)] == ids + said        # preserved thinking: the history never changes
    events = list(engine.generate(ids2, SamplingParams(**GREEDY), snapshot_at=keep2))
    assert events[0].cached_tokens == events[-1].stats.reused_tokens == len(ids) + len(said)
    fresh = Engine.load(q38, device="cpu", dtype=torch.float32, max_context=1024, snapshots=0)
    assert events[-1].token_ids == list(fresh.generate(ids2, SamplingParams(**GREEDY)))[-1].token_ids
    # with the thinking left out, the same turn resumes from the snapshot where the history ended
    dropped, keep_d = build_prompt(engine.tokenizer, messages, True, keep_thinking=False, effort=effort)
    assert dropped[:len(ids)] != ids
    events = list(engine.generate(dropped, SamplingParams(**GREEDY), snapshot_at=keep_d))
    assert events[0].cached_tokens == keep_at[0] < len(ids)
