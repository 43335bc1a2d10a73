"""4-bit weights where the command line meets them: the GPTQ releases' aliases, `--weights int4`,
the hints where a model does not fit, and bench's labels and floor. Planned from the models'
shapes (nothing downloaded, nothing of a large model loaded)."""
import dataclasses
import json
import types

import pytest

from mtpchat import cli, loader, models
from mtpchat.engine import memory
from mtpchat.engine.units import fmt_bytes
from mtpchat.settings import CHECKS
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)

GiB = 2 ** 30


def dry_run(capsys, monkeypatch, free, *argv, command="run", capable=True):
    """`mtpchat run --dry-run` on a GPU with `free` bytes free (FP8 running there where `capable`)."""
    monkeypatch.setattr(loader, "pick_device", lambda requested, said=None: ("cuda", False))
    monkeypatch.setattr(loader, "device_memory", lambda device: (free, 80 * GiB))
    monkeypatch.setattr(loader, "fp8_capable", lambda device: capable)
    code = cli.main([command, *map(str, argv), "--dry-run"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def needed(name, weights=None, context=8192):
    """What `run` plans for an alias on a GPU (no turn snapshots: it answers once; the trimmed draft
    head's rows in 4 bits, the kernel plan's draft_head_int4)."""
    return memory.plan_memory(models.alias_config(models.lookup_alias(name)), context, memory.K_MAX,
                              snapshots=0, weights=weights, draft_int4=True).needed


def test_the_gptq_releases_have_aliases_with_their_format(capsys):
    for name, repo, dense in (("Qwen3.5-27B-GPTQ-Int4", "Qwen/Qwen3.5-27B-GPTQ-Int4", "Qwen3.5-27B"),
                              ("Qwen3.5-35B-A3B-GPTQ-Int4", "Qwen/Qwen3.5-35B-A3B-GPTQ-Int4", "Qwen3.5-35B-A3B")):
        alias = models.lookup_alias(name.lower())
        assert models.classify(name) == ("repo", repo, alias) and alias.format == "gptq-int4"
        config = models.alias_config(alias)
        # the release's quantization_config: group 128, symmetric; attention, shared experts, MTP in bf16
        assert config.quantization == "int4" and config.int4.group == 128 and config.int4.symmetric
        layer = "model.language_model.layers.3"
        assert config.int4.quantizes(f"{layer}.mlp.gate_proj") and config.int4.quantizes(f"{layer}.mlp.experts.9.up_proj")
        for kept in ("self_attn.q_proj", "linear_attn.in_proj_qkv", "mlp.shared_expert.down_proj"):
            assert not config.int4.quantizes(f"{layer}.{kept}")
        assert not config.int4.quantizes("mtp.layers.0.mlp.gate_proj")
        # the bf16 model's shape
        assert dataclasses.replace(config, quantization=None, int4=None) == models.alias_config(models.lookup_alias(dense))
        assert models.release(dense, "gptq-int4") is alias and models.release(name, "bf16").name == dense
    assert cli.main(["models"]) == 0
    rows = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  Qwen3")}
    assert rows["Qwen3.5-27B-GPTQ-Int4"] == "GPTQ-Int4" and rows["Qwen3.5-27B-FP8"] == "FP8"
    assert rows["Qwen3.5-27B"] == "bf16"
    assert "Qwen3.5-27B-GPTQ-Int4" not in [a.name for a in models.smaller_aliases(10 ** 12)]


def test_a_gptq_alias_is_planned_in_4_bits(capsys, monkeypatch):
    code, out, _ = dry_run(capsys, monkeypatch, 31 * GiB, "--model", "Qwen3.5-27B-GPTQ-Int4")
    assert code == 0 and "bfloat16, int4 weights" in out and "weights (int4)" in out and "fits" in out
    # the release keeps attention and the GDN in bf16: its weights a little over half the bf16 model's
    weights = lambda name: memory.plan_memory(models.alias_config(models.lookup_alias(name)), 8192).weights
    assert weights("Qwen3.5-27B-GPTQ-Int4") < weights("Qwen3.5-27B") / 1.8
    assert needed("Qwen3.5-27B-GPTQ-Int4") < needed("Qwen3.5-27B") / 1.7


def test_weights_int4_plans_every_product_in_4_bits(capsys, monkeypatch):
    code, out, _ = dry_run(capsys, monkeypatch, 23 * GiB, "--model", "Qwen3.6-27B", "--weights", "int4")
    assert code == 0 and "int4 weights" in out and "fits" in out
    plan = memory.plan_memory(models.alias_config(models.lookup_alias("Qwen3.6-27B")), 8192, memory.K_MAX,
                              snapshots=0, weights="int4", draft_int4=True)          # on a GPU
    assert f"weights (int4)    {fmt_bytes(plan.weights):>10}" in out


@pytest.mark.parametrize("model, free, hint", [
    ("Qwen3.5-27B", 40 * GiB, "--model Qwen3.5-27B-FP8"),                # FP8 fits: the larger format first
    ("Qwen3.5-27B", "between", "--model Qwen3.5-27B-GPTQ-Int4"),         # then the GPTQ release
    ("Qwen3.5-27B", 23 * GiB, "--weights int4"),                         # then every product in 4 bits
    ("Qwen3.6-27B", 23 * GiB, "--weights int4"),                         # no GPTQ release
    ("Qwen3.5-27B-FP8", 23 * GiB, "--model Qwen3.5-27B --weights int4"),  # from the bf16 release
    ("Qwen3.5-27B-GPTQ-Int4", 23 * GiB, "--model Qwen3.5-27B --weights int4"),
    ("Qwen3.5-35B-A3B", 26 * GiB, "--model Qwen3.5-35B-A3B-GPTQ-Int4"),
    ("Qwen3.6-35B-A3B-FP8", 23 * GiB, "--model Qwen3.6-35B-A3B --weights int4"),
])
def test_what_fits_names_the_4bit_release_or_weights_int4(capsys, monkeypatch, model, free, hint):
    if free == "between":   # the GPTQ release fits, FP8 does not
        free = (needed("Qwen3.5-27B-GPTQ-Int4") + needed("Qwen3.5-27B", "fp8")) // 2
    code, out, _ = dry_run(capsys, monkeypatch, free, "--model", model)
    assert code == 1 and f"what fits: {hint}" in out.replace(", or --model Qwen3.5-9B", "")


def test_what_fits_on_a_gpu_without_fp8_is_4_bits(capsys, monkeypatch):
    # an Ampere GPU: FP8 would fit in 40 GiB but does not run there
    code, out, _ = dry_run(capsys, monkeypatch, 40 * GiB, "--model", "Qwen3.5-27B", capable=False)
    assert code == 1 and "what fits: --model Qwen3.5-27B-GPTQ-Int4, or --model Qwen3.5-9B" in out
    code, _, err = dry_run(capsys, monkeypatch, 40 * GiB, "--model", "Qwen3.5-27B", "--weights", "fp8",
                           capable=False)
    assert code == 2 and "--weights fp8: FP8 weights run on Ada or Hopper GPUs" in err and "--weights int4" in err


def test_the_refusal_names_the_4bit_weights(capsys, monkeypatch):
    code, out, _ = dry_run(capsys, monkeypatch, 23 * GiB, "--model", "Qwen3.5-27B-GPTQ-Int4")
    weights = memory.plan_memory(models.alias_config(models.lookup_alias("Qwen3.5-27B-GPTQ-Int4")), 8192,
                                 memory.K_MAX, snapshots=0, draft_int4=True).weights  # on a GPU
    assert code == 1 and f"(weights in int4 {fmt_bytes(weights)}, KV" in out


def test_weights_int4_runs_on_the_cpu(capsys, tiny):
    code = cli.main(["run", "--model", str(tiny), "--device", "cpu", "--weights", "int4", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0 and "device: cpu, float32, int4 weights" in out and "weights (int4)" in out
    assert "Traceback" not in err


def test_the_flag_and_the_settings_file_take_int4(capsys, tmp_path, monkeypatch):
    assert CHECKS["weights"]("INT4") == "int4"
    args = cli.build_parser(["run"]).parse_args(["run", "--weights", "int4"])
    assert cli.options_from(args).weights == "int4"
    (tmp_path / "settings.toml").write_text('weights = "int4"\n')
    assert cli.options_from(cli.build_parser(["run"]).parse_args(["run"])).weights == "int4"
    with pytest.raises(SystemExit):
        cli.build_parser(["run"]).parse_args(["run", "--weights", "int8"])
    assert "auto, bf16, fp8, int4" in capsys.readouterr().err
    for command in ("run", "serve", "bench"):
        assert "{auto,bf16,fp8,int4}" in cli.build_parser([command]).format_help()


# ---- bench ----------------------------------------------------------------------------------------

def test_bench_plans_the_4bit_releases_from_their_shape(capsys, monkeypatch):
    code, out, _ = dry_run(capsys, monkeypatch, 60 * GiB, "--random-weights", "Qwen3.5-35B-A3B-GPTQ-Int4",
                           command="bench")
    assert code == 0 and "model: Qwen3.5-35B-A3B-GPTQ-Int4" in out and "weights (int4)" in out


def test_bench_labels_its_figures_with_the_weight_format(capsys, monkeypatch):
    import mtpchat.engine as engine_package
    from mtpchat.engine import bench
    made = {}

    class Engine:      # as much of one as `mtpchat bench` reads around bench.run
        def __init__(self, model, **kwargs):
            made.update(kwargs, config=model)
            self.weight_format, self.tokenizer, self.config, self.dtype = "int4", None, model, "float32"
            self.decoder = types.SimpleNamespace(prefill_chunk=64)
            self.plan = types.SimpleNamespace(describe=lambda: {"products": {}})
    monkeypatch.setattr(engine_package, "Engine", Engine, raising=False)
    monkeypatch.setattr(bench, "run", lambda engine, **kwargs: {"step_bytes": bench.step_bytes(engine)})
    assert cli.main(["bench", "--random-weights", "qwen3.5-0.8b", "--weights", "int4", "--device", "cpu",
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert made["weights"] == "int4"
    assert result["model"] == "random qwen3.5-0.8b, int4 weights" and result["weights"] == "int4"
    # the floor's bytes: what the memory plan stores of a decode step's weights, in 4 bits
    assert result["step_bytes"] == memory.step_read_bytes(made["config"], "float32", "int4")


@pytest.mark.parametrize("moe", [False, True])
def test_the_bytes_a_step_reads_agree_with_the_engine(tmp_path, moe):
    from mtpchat.engine import Engine, bench
    from tools.tiny import write_tiny_checkpoint
    engine = Engine.load(write_tiny_checkpoint(tmp_path / "tiny", moe=moe), max_context=64)
    assert bench.step_bytes(engine) == memory.step_read_bytes(engine.config, engine.dtype)
    draft = engine.decoder.draft_rows
    w = draft.w if draft is not None else engine.model.head      # the lm_head rows a draft step reads
    rows = w.numel() * w.element_size()
    assert bench.draft_bytes(engine) == memory.head_read_bytes(engine.config, engine.dtype) + rows
    # in 4 bits, what the plan counts (the engine's own tensors need not be its parameters)
    int4 = types.SimpleNamespace(**{k: getattr(engine, k) for k in ("config", "dtype", "head", "decoder", "model")},
                                 weight_format="int4")
    assert bench.step_bytes(int4) == memory.step_read_bytes(engine.config, engine.dtype, "int4") < bench.step_bytes(engine)
    assert bench.draft_bytes(int4) - rows == memory.head_read_bytes(engine.config, engine.dtype, "int4")


@pytest.mark.parametrize("quantizing, label", [("fp8", ", quantizing to FP8"),
                                               ("int4", ", quantizing to int4"), ("", "")])
def test_the_load_bar_names_what_the_weights_are_quantized_to(quantizing, label):
    from mtpchat.engine.events import LoadProgress
    from mtpchat.progress import stage_label
    assert stage_label(LoadProgress("weights", 1, 2, 1, 2, quantizing)) == "loading weights" + label


def test_run_json_says_how_the_weights_are_held(capsys, tiny):
    assert cli.main(["run", "--model", str(tiny), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                     "--no-think", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "float32"
