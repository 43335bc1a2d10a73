"""The `mtpchat` command: `run` on a tiny real checkpoint, and every error a user can meet.

Each error is checked end to end through `main([...])`: its exit status and its message on stderr,
and that no traceback reaches the user.
"""
import errno
import io
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import huggingface_hub
import pytest
import torch

from mtpchat import cli, loader
from mtpchat.engine import memory
from tools.tiny import write_tiny_checkpoint
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)

CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "configs"
GiB = 2 ** 30
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@pytest.fixture(scope="module")
def tiny_no_mtp(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-no-mtp", mtp=False)


@pytest.fixture
def big(tiny, tmp_path):
    """A folder with the real 27B config and a stand-in shard: enough to plan, never to load."""
    folder = tmp_path / "big"
    folder.mkdir()
    shutil.copy(CONFIGS / "qwen3.6-27b.json", folder / "config.json")
    shutil.copy(tiny / "tokenizer.json", folder / "tokenizer.json")
    shard = sorted(tiny.glob("*.safetensors"))[0]
    shutil.copy(shard, folder / shard.name)
    index = {"weight_map": {"model.language_model.norm.weight": shard.name, "mtp.fc.weight": shard.name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, "run", *argv, "--json")
    assert code == 0, err
    return json.loads(out), err


# ---- mtpchat run on a real tiny checkpoint ----------------------------------------------------------

def test_run_json(capsys, tiny):
    from mtpchat.engine import Engine
    result, _ = run_json(capsys, "--model", tiny, "--prompt", "Hello there", "--temperature", "0",
                         "--max-tokens", "12")
    assert {"text", "token_ids", "prompt_tokens", "finish_reason", "stats"} <= set(result)
    assert 1 <= len(result["token_ids"]) <= 12 and result["finish_reason"] in ("stop", "length")
    stats = result["stats"]
    for key in ("tokens_per_s", "ttft_ms", "mean_acceptance_length", "draft_acceptance_rate",
                "per_position_acceptance", "drafted", "accepted"):
        assert key in stats
    assert stats["new_tokens"] == len(result["token_ids"]) and result["mtp"] is True
    # the draft count of every step, as the adaptive policy chose it (at most --draft-tokens)
    assert result["adaptive_k"] is True and sum(stats["k_histogram"].values()) == stats["steps"]
    assert all(0 <= int(k) <= result["draft_tokens"] for k in stats["k_histogram"])
    engine = Engine.load(tiny, device="cpu")
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert result["prompt_tokens"] == len(prompt)
    shown = engine.tokenizer.decode([t for t in result["token_ids"] if t not in engine.stop_ids])
    # the prompt opens <think>: what comes before </think> is the reasoning, the rest the answer
    thinking, closed, answer = shown.partition("</think>")
    assert (result["reasoning"], result["text"]) == (thinking, answer.lstrip("\n") if closed else "")


def test_greedy_output_is_the_same_with_and_without_mtp(capsys, tiny):
    args = ("--model", tiny, "--prompt", "The weather today", "--temperature", "0", "--max-tokens", "16")
    # a fixed k: the adaptive policy may turn drafting off on a busy CPU (a random model accepts little)
    on, _ = run_json(capsys, *args, "--mtp", "--draft-tokens", "3", "--no-adaptive-k")
    off, _ = run_json(capsys, *args, "--no-mtp")
    assert on["token_ids"] == off["token_ids"]
    assert off["stats"]["drafted"] == 0 and off["mtp"] is False
    if len(on["token_ids"]) > 2:
        assert on["stats"]["drafted"] > 0


def test_run_streams_text_to_stdout(capsys, tiny):
    result, _ = run_json(capsys, "--model", tiny, "--prompt", "Hi", "--temperature", "0", "--max-tokens", "8")
    code, out, err = run(capsys, "run", "--model", tiny, "--prompt", "Hi", "--temperature", "0",
                         "--max-tokens", "8")
    assert code == 0 and out == result["text"] + "\n"
    assert f"[{len(result['token_ids'])} tokens" in err and "tok/s" in err


DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
DEMO_RUN = ("run", "--model", str(DEMO), "--device", "cpu", "--prompt", "What is MTP?", "--temperature", "0",
            "--max-tokens", "120")


def run_demo(*argv) -> tuple[str, str]:
    """`mtpchat run` on the demo model in a process of its own: (stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "mtpchat", *DEMO_RUN, *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout, proc.stderr


def test_run_in_4_bits_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "mtpchat", "run", "--model", str(DEMO), "--device", "cpu",
                           "--weights", "int4", "--prompt", "def add(a, b):", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "[16 tokens" in proc.stderr.splitlines()[-1]     # the demo model thinks past 16 tokens


def test_run_and_bench_say_4_bits(capsys):
    result, _ = run_json(capsys, "--model", str(DEMO), "--device", "cpu", "--weights", "int4", "--prompt",
                         "def add(a, b):", "--max-tokens", "16", "--temperature", "0")
    assert result["weights"] == "int4" and len(result["token_ids"]) == 16 and result["stats"]["accepted"] > 0
    quick = ("bench", "--model", str(DEMO), "--device", "cpu", "--weights", "int4", "--tokens", "8", "--context",
             "16", "--policy-tokens", "8", "--policy-repeats", "1", "--profiles-only")
    code, out, err = run(capsys, *quick)
    assert code == 0 and out.startswith(f"{DEMO}, int4 weights on cpu"), err
    assert "OUTPUT DIFFERS" not in out and "decode, MTP off (per token)" in out


@pytest.fixture(scope="module")
def demo_json():
    out, _ = run_demo("--json")
    result = json.loads(out)
    # the demo model thinks, then answers, within the token budget: both parts are there to check
    assert result["reasoning"].strip() and result["text"].strip()
    return result


def test_run_json_has_the_answer_as_text_and_the_thinking_as_reasoning(demo_json):
    from mtpchat.engine.tokenizer import Tokenizer
    tok = Tokenizer.load(DEMO)
    shown = tok.decode([t for t in demo_json["token_ids"] if t not in tok.eos_token_ids])
    thinking, closed, answer = shown.partition("</think>")
    assert closed and demo_json["reasoning"] == thinking and demo_json["text"] == answer.lstrip("\n")
    assert "<think>" not in demo_json["text"] and "</think>" not in demo_json["text"] + demo_json["reasoning"]


def test_run_prints_only_the_answer_and_the_thinking_on_stderr(demo_json):
    out, err = run_demo()
    assert out == demo_json["text"] + "\n"
    assert err.startswith(demo_json["reasoning"]) and "</think>" not in err
    assert f"[{demo_json['stats']['new_tokens']} tokens" in err.splitlines()[-1]


def test_run_show_thinking_prints_it_before_the_answer(demo_json):
    out, err = run_demo("--show-thinking")
    assert out == f"<think>\n{demo_json['reasoning']}\n</think>\n\n{demo_json['text']}\n"
    assert demo_json["reasoning"] not in err and err.startswith("[")


def test_system_prompt_and_no_think_change_the_prompt(capsys, tiny):
    base = ("--model", tiny, "--prompt", "Hi", "--max-tokens", "1")
    plain, _ = run_json(capsys, *base)
    system, _ = run_json(capsys, *base, "--system", "You are terse.")
    no_think, _ = run_json(capsys, *base, "--no-think")
    assert system["prompt_tokens"] > plain["prompt_tokens"]
    assert no_think["prompt_tokens"] > plain["prompt_tokens"]   # the empty <think></think> block


def test_prompt_from_stdin(capsys, tiny, monkeypatch):
    piped, _ = run_json(capsys, "--model", tiny, "--prompt", "from a pipe", "--max-tokens", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO("from a pipe"))
    result, _ = run_json(capsys, "--model", tiny, "--max-tokens", "1")
    assert result["prompt_tokens"] == piped["prompt_tokens"]


def test_missing_prompt_on_a_terminal(capsys, tiny, monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    code, _, err = run(capsys, "run", "--model", tiny)
    assert code == 2 and "give the prompt with --prompt TEXT" in err


def test_settings_file_then_flags(capsys, tiny, tmp_path):
    args = ("--model", tiny, "--prompt", "Count", "--temperature", "0")
    two, _ = run_json(capsys, *args, "--max-tokens", "2")
    six, _ = run_json(capsys, *args, "--max-tokens", "6")
    (tmp_path / "settings.toml").write_text("max_tokens = 2\n")
    from_file, _ = run_json(capsys, *args)
    flag_wins, _ = run_json(capsys, *args, "--max-tokens", "6")
    assert from_file["token_ids"] == two["token_ids"]
    assert flag_wins["token_ids"] == six["token_ids"]


def test_no_mtp_weights_is_a_notice(capsys, tiny_no_mtp):
    result, err = run_json(capsys, "--model", tiny_no_mtp, "--prompt", "Hi", "--max-tokens", "3")
    assert "has no mtp.* weights: running with MTP off" in err
    assert result["mtp"] is False and result["stats"]["drafted"] == 0


def test_dry_run_reads_no_weights(capsys, tiny, monkeypatch):
    def forbidden(*a, **kw):
        raise AssertionError("a dry run must not load the model")
    monkeypatch.setattr(loader, "load_engine", forbidden)
    code, out, _ = run(capsys, "run", "--model", tiny, "--dry-run", "--max-context", "4096")
    assert code == 0 and "memory plan: float32, context 4,096 tokens" in out and "fits" in out
    # the kernels' forms the engine would take, as KernelPlan.choose makes them for the CPU
    assert "kernel plan: split_norm=True" in out and "fc_split=True draft_pick=True" in out
    assert "programs=6" in out and "widen_bits=False" in out


@no_cuda
def test_dry_run_of_an_alias_needs_no_download(capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: pytest.fail("downloaded"))
    code, out, err = run(capsys, "run", "--model", "Qwen3.6-27B-MTP", "--dry-run")
    assert code == 0
    # planned for a GPU: the trimmed draft head's rows in 4 bits (the kernel plan's draft_head_int4)
    assert "26,895,998,464 text + 424,699,392 MTP" in out and "weights             51.0 GiB" in out
    assert "planned from its known shape" in err and "no CUDA GPU here" in err
    assert "kernel plan: chosen on the GPU at load" in out


# ---- errors ------------------------------------------------------------------------------------------

def test_unknown_alias(capsys):
    code, _, err = run(capsys, "run", "--model", "Qwen3.6-72B-MTP", "--prompt", "x")
    assert code == 1 and "unknown model 'Qwen3.6-72B-MTP'; did you mean 'Qwen3.6-27B-MTP'?" in err
    assert err.startswith("mtpchat: error: ") and len(err.strip().splitlines()) == 2


def test_repo_not_found(capsys, monkeypatch):
    from huggingface_hub import errors
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/nobody/nothing"))

    def missing(*a, **kw):
        raise errors.RepositoryNotFoundError("404", response=response)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    code, _, err = run(capsys, "run", "--model", "nobody/nothing", "--prompt", "x")
    assert code == 1 and "repository nobody/nothing was not found on Hugging Face" in err


def test_offline_with_nothing_cached(capsys):
    code, _, err = run(capsys, "run", "--model", "Qwen3.5-2B", "--offline", "--prompt", "x")
    assert code == 1 and "Qwen3.5-2B is not in the local cache" in err and "--offline is set" in err


def test_incomplete_download(capsys, copy):
    (copy / "model-00002-of-00003.safetensors").unlink()
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 1 and "is incomplete: missing model-00002-of-00003.safetensors" in err


def test_disk_full(capsys, monkeypatch):
    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    code, _, err = run(capsys, "run", "--model", "Qwen3.5-0.8B", "--prompt", "x")
    assert code == 1 and "is full while downloading Qwen/Qwen3.5-0.8B" in err


def test_unsupported_architecture(capsys, copy):
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "llama"
    config["text_config"]["model_type"] = "llama"
    (copy / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 1 and "unsupported checkpoint:" in err and "model_type 'llama'" in err


def test_weights_error(capsys, copy):
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    name, shard = next((n, f) for n, f in index["weight_map"].items() if n.startswith("model.language_model."))
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values()) if f != shard)
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 1 and "cannot load the weights:" in err and name in err


def test_tokenizer_error(capsys, copy):
    (copy / "tokenizer.json").write_text("{ not json")
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 1 and "cannot load the tokenizer:" in err


def test_large_model_on_the_cpu(capsys, big):
    code, _, err = run(capsys, "run", "--model", big, "--device", "cpu", "--prompt", "x")
    assert code == 1 and "(26.9B parameters) is too large for the CPU" in err and "--model Qwen3.5-2B" in err


@no_cuda
def test_large_model_without_a_gpu(capsys, big):
    code, _, err = run(capsys, "run", "--model", big, "--prompt", "x")
    assert code == 1 and err.startswith("mtpchat: error: no CUDA GPU was found, and ")


@no_cuda
def test_cuda_unavailable(capsys, tiny):
    code, _, err = run(capsys, "run", "--model", tiny, "--device", "cuda", "--prompt", "x")
    assert code == 1 and "--device cuda: CUDA is not available" in err and "--device cpu" in err


def test_cuda_too_old(capsys, tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla V100")
    code, _, err = run(capsys, "run", "--model", tiny, "--device", "cuda", "--prompt", "x")
    assert code == 1 and "Tesla V100 has compute capability 7.0; mtpchat needs 8.0 or newer" in err


def _gpu_with(monkeypatch, free):
    monkeypatch.setattr(loader, "pick_device", lambda requested, said=None: ("cuda", False))
    monkeypatch.setattr(loader, "device_memory", lambda device: (free, 80 * GiB))


def test_not_enough_memory_suggests_a_smaller_model(capsys, big, monkeypatch):
    _gpu_with(monkeypatch, 40 * GiB)
    code, _, err = run(capsys, "run", "--model", big, "--prompt", "x")
    assert code == 1
    assert "does not fit: it needs 54." in err and "but 40.0 GiB is free on the GPU" in err
    assert "what fits: --weights fp8, or --model Qwen3.5-9B" in err     # the 27B in FP8 fits 40 GiB


def test_not_enough_memory_suggests_a_shorter_context(capsys, big, monkeypatch):
    _gpu_with(monkeypatch, 56 * GiB)
    code, _, err = run(capsys, "run", "--model", big, "--max-context", "262144", "--prompt", "x")
    from mtpchat.engine.config import ModelConfig
    # `run` answers once: no turn snapshots in its plan
    # on a GPU, whose plan keeps the trimmed draft head's rows in 4 bits
    fits = memory.max_context_that_fits(ModelConfig.load(big), 56 * GiB, memory.K_MAX, "bfloat16", snapshots=0,
                                        draft_int4=True)
    assert fits > memory.max_context_that_fits(ModelConfig.load(big), 56 * GiB, memory.K_MAX, "bfloat16", snapshots=0)
    assert code == 1 and 0 < fits < 262144
    assert f"what fits: --max-context {fits}, or --weights fp8, or --model Qwen3.5-9B" in err


def test_dry_run_that_does_not_fit(capsys, big, monkeypatch):
    _gpu_with(monkeypatch, 40 * GiB)
    code, out, _ = run(capsys, "run", "--model", big, "--dry-run")
    assert code == 1 and "memory plan: bfloat16" in out and "what fits: --weights fp8, or --model Qwen3.5-9B" in out


def test_ctrl_c_exits_cleanly(capsys, tiny, monkeypatch):
    def interrupted(prep, progress=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(loader, "load_engine", interrupted)
    code, _, err = run(capsys, "run", "--model", tiny, "--prompt", "x")
    assert code == 130 and "interrupted" in err


def test_bad_settings_file(capsys, tmp_path):
    (tmp_path / "settings.toml").write_text("temprature = 0.5\n")
    code, _, err = run(capsys, "run", "--model", "x", "--prompt", "x")
    assert code == 1 and "unknown setting 'temprature'; did you mean 'temperature'?" in err


def test_bad_flag_value(capsys):
    code, _, err = run(capsys, "run", "--draft-tokens", "0")
    assert code == 2 and "argument --draft-tokens: must be between 1 and 8, got 0" in err


# ---- the other commands ------------------------------------------------------------------------------

def test_models_command(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "  Qwen3.6-27B-MTP  " in out and " Qwen/Qwen3.6-27B  " in out and "nothing yet" in out


def test_bench_not_available(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_has_module", lambda name: False)
    code, _, err = run(capsys, "bench")
    assert code == 2 and "`mtpchat bench` is not available yet" in err


def test_bench_gets_the_common_flags_and_its_own(capsys, monkeypatch):
    seen = {}
    bench = types.ModuleType("mtpchat.bench")
    bench.add_arguments = lambda p: p.add_argument("--runs", type=int, default=1)
    bench.main = lambda args: seen.setdefault("args", args) and 7
    monkeypatch.setitem(sys.modules, "mtpchat.bench", bench)
    code, _, _ = run(capsys, "bench", "--model", "Qwen3.5-9B", "--runs", "3", "--no-mtp")
    assert code == 7
    args = seen["args"]
    assert args.runs == 3 and args.options.model == "Qwen3.5-9B" and args.options.mtp is False


def test_app_not_available(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_has_module", lambda name: name != "mtpchat.app.main")
    code, _, err = run(capsys, "--model", "Qwen3.5-9B")
    assert code == 2 and "the chat app is not part of this build" in err


def test_app_gets_the_prepared_model(capsys, tiny, monkeypatch):
    seen = {}
    app = types.ModuleType("mtpchat.app.main")
    app.run_app = lambda args: seen.setdefault("args", args) and 0
    monkeypatch.setitem(sys.modules, "mtpchat.app.main", app)
    code, _, _ = run(capsys, "--model", tiny, "--max-context", "1024", "--no-think")
    assert code == 0
    args = seen["args"]
    assert args.prepared.path == tiny and args.prepared.max_context == 1024
    assert args.options.think is False and args.prepared.device == "cpu"


def test_help_is_instant_and_imports_nothing_heavy():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mtpchat", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "mtpchat run" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    for heavy in ("torch", "textual", "huggingface_hub", "mtpchat.engine", "numpy"):
        assert heavy not in imported, heavy


def test_version(capsys):
    from importlib.metadata import version
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"mtpchat {version('mtpchat')}"


def test_prompt_longer_than_the_context(capsys, tiny):
    code, _, err = run(capsys, "run", "--model", tiny, "--max-context", "16", "--prompt", "word " * 40)
    assert code == 1 and "tokens but --max-context is 16; raise --max-context" in err


def test_context_longer_than_the_model_supports(capsys, tiny):
    code, _, err = run(capsys, "run", "--model", tiny, "--max-context", "300000", "--prompt", "x")
    assert code == 1 and "--max-context 300000 is longer than" in err and "(262,144 tokens)" in err
