"""The command line as a new user first types it: `bench` with no flags and with --dry-run, its
figures on the CPU, bad flag values, an empty prompt, the settings file named in its errors, and
no warning from torch when numpy is missing."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtpchat import cli
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _no_nan(name):
    raise AssertionError(f"{name} is not JSON")


# ---- bench -------------------------------------------------------------------------------------------

QUICK = ("--device", "cpu", "--tokens", "4", "--policy-tokens", "4", "--policy-repeats", "1", "--context", "16",
         "--profiles-only")


def test_bench_with_no_model_runs_the_demo_model_and_writes_valid_json(capsys):
    code, out, err = run(capsys, "bench", *QUICK, "--json")
    assert code == 0, err
    result = json.loads(out, parse_constant=_no_nan)
    assert result["model"].endswith("demo") and result["device"] == "cpu"
    # no bandwidth floor on the CPU: null, not NaN; and no CUDA graphs there
    assert result["floor_ms"] is None and result["copy_bandwidth_tb_s"] is None and result["cuda_graphs"] is False


def test_bench_table_on_the_cpu_has_no_nan_and_no_graphs(capsys):
    code, out, err = run(capsys, "bench", *QUICK)
    assert code == 0, err
    assert "nan" not in out.lower() and "CUDA graphs" not in out and "x floor" not in out
    assert "no bandwidth floor on the CPU" in out and "decode, MTP off (per token)" in out


@pytest.mark.parametrize("extra", [(), ("--random-weights", "qwen3.5-0.8b")])
def test_bench_dry_run_prints_the_plan_and_runs_nothing(capsys, monkeypatch, extra):
    from mtpchat.engine import engine
    monkeypatch.setattr(engine.Engine, "__init__", lambda *a, **k: pytest.fail("a dry run built an engine"))
    code, out, err = run(capsys, "bench", *extra, "--dry-run")
    assert code == 0, err
    assert out.startswith("model: ") and "memory plan:" in out and "fits" in out
    assert ("Qwen3.5-0.8B" in out) == bool(extra)
    assert "context 8,320 tokens" in out          # the context the bench allocates, not the app's


# ---- usage errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (("--max-context", "-5"), "argument --max-context: must be at least 16, got -5"),
    (("run", "--draft-tokens", "99"), "argument --draft-tokens: must be between 1 and 8, got 99"),
    (("run", "--temperature", "-1"), "argument --temperature: must be at least 0.0, got -1.0"),
    (("run", "--max-tokens", "0"), "argument --max-tokens: must be at least 1, got 0"),
    (("bench", "--max-context", "-5"), "argument --max-context: must be at least 16, got -5"),
])
def test_a_bad_flag_value_is_two_lines_without_the_usage_block(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2 and "usage:" not in err
    assert message in lines[0] and "--help" in lines[1]


@pytest.mark.parametrize("how", ["flag", "spaces", "stdin"])
def test_an_empty_prompt_is_a_usage_error(capsys, monkeypatch, how):
    import io
    monkeypatch.setattr(cli.loader, "load_engine", lambda prep: pytest.fail("an empty prompt loaded the model"))
    if how == "stdin":
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        argv = ("run",)
    else:
        argv = ("run", "--prompt", "" if how == "flag" else "  \n")
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and "the prompt is empty" in err


def test_an_empty_prompt_on_a_server_is_refused_before_connecting(capsys):
    code, out, err = run(capsys, "run", "--server", "http://127.0.0.1:9", "--prompt", "")
    assert code == 2 and "the prompt is empty" in err


# ---- the settings file -------------------------------------------------------------------------------

def test_settings_in_a_missing_folder_is_an_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "nonexistent" / "s.toml"))
    code, _, err = run(capsys, "run", "--prompt", "hi")
    assert code == 1 and "MTPCHAT_SETTINGS" in err and str(tmp_path / "nonexistent") in err


def test_a_bad_model_in_the_settings_file_names_the_file(capsys, monkeypatch, tmp_path):
    path = tmp_path / "elsewhere.toml"
    path.write_text('model = "/nonexistent"\n')
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(path))
    code, _, err = run(capsys, "run", "--prompt", "hi")
    assert code == 1 and str(path) in err and "no such folder: /nonexistent" in err
    # the same model as a flag is the flag's error, not the file's
    code, _, err = run(capsys, "run", "--prompt", "hi", "--model", "/nonexistent2")
    assert code == 1 and str(path) not in err and "no such folder: /nonexistent2" in err


def mtpchat_process(tmp_path, settings: Path, *argv):
    """`python -m mtpchat ...` in a process of its own, with MTPCHAT_SETTINGS at `settings`."""
    env = {"MTPCHAT_SETTINGS": str(settings), "HF_HUB_CACHE": str(tmp_path / "hub"), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "mtpchat", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_a_settings_file_that_is_not_there_is_said_in_one_line(tmp_path):
    missing = tmp_path / "s.toml"
    done = mtpchat_process(tmp_path, missing, "run", "--prompt", "hi", "--device", "cpu", "--dry-run")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "MTPCHAT_SETTINGS" in line]
    assert said == [f"mtpchat: MTPCHAT_SETTINGS is {missing}, which does not exist: using the defaults"]


def test_a_bad_value_in_the_settings_file_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "s.toml"
    for text, said in [('model = "/nonexistent"\n', f"model = '/nonexistent' in {path}: no such folder: /nonexistent"),
                       ("max_context = 99999999\n", f"max_context = 99999999 in {path} is longer than"),
                       ('weights = "fp8"\n', f"weights = 'fp8' in {path}: FP8 weights run on"),
                       ("top_p = 5\n", f"top_p = 5 in {path}: must be in (0.0, 1.0]")]:
        path.write_text(text)
        done = mtpchat_process(tmp_path, path, "run", "--prompt", "hi", "--device", "cpu")
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert done.stderr.startswith(f"mtpchat: error: {said}"), done.stderr
    # the same value as a flag is the flag's
    path.write_text("max_context = 8192\n")
    done = mtpchat_process(tmp_path, path, "run", "--prompt", "hi", "--device", "cpu", "--max-context", "99999999")
    assert done.stderr.startswith("mtpchat: error: --max-context 99999999 is longer than"), done.stderr


# ---- without numpy -----------------------------------------------------------------------------------

HIDE_NUMPY = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Hide())
from mtpchat.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_no_numpy_warning_without_numpy(tmp_path):
    env = {"MTPCHAT_SETTINGS": str(tmp_path / "settings.toml"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", HIDE_NUMPY, "run", "--prompt", "hi", "--max-tokens", "2",
                           "--device", "cpu"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr and "Warning" not in done.stderr


# ---- a damaged checkpoint ----------------------------------------------------------------------------

def test_a_shard_a_few_bytes_short_says_how_many(capsys, copy):
    from mtpchat.engine.units import fmt_bytes
    shard = sorted(copy.glob("*.safetensors"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "hi")
    assert code == 1 and f"{shard.name} (truncated: 10 B short of {fmt_bytes(size)})" in err


@pytest.mark.parametrize("text, says", [("{}", "it is empty"), ('{"architectures": []}', "it has no model_type")])
def test_an_empty_config_says_so(capsys, copy, text, says):
    (copy / "config.json").write_text(text)
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "hi")
    assert code == 1 and says in err and "config.json" in err and "None" not in err
