"""Engine.load's progress callback: bytes and tensors of the weights as they load, quantizing on load
said as such, random weights counted too, and the last report complete. The CLI draws the reports
with tqdm (mtpchat/progress.py)."""
import io
import json
import math

import pytest
from safetensors import safe_open

from mtpchat.engine import Engine
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.events import LoadProgress
from mtpchat.engine.units import fmt_bytes
from mtpchat.engine.weights import DTYPE_SIZE
from tools.tiny import write_dequantized_twin, write_tiny_checkpoint

# every fused product's parts on whole 128-row blocks, so each is stored in FP8 (as in test_fp8)
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("progress"), num_hidden_layers=2, seed=5)


def stored_bytes(folder, skip=("model.visual.",)) -> tuple[int, int]:
    """(bytes, tensors) of the text and MTP tensors the checkpoint stores, read from its headers."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    total = count = 0
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(folder / shard), "pt") as f:
            for name in f.keys():
                if name.startswith(skip):
                    continue
                info = f.get_slice(name)
                total += math.prod(info.get_shape()) * DTYPE_SIZE[info.get_dtype()]
                count += 1
    return total, count


def test_weights_report_bytes_and_tensors_up_to_the_whole(ckpt):
    seen: list[LoadProgress] = []
    Engine.load(ckpt, max_context=64, progress=seen.append)
    assert len(seen) > 10 and {p.stage for p in seen} == {"weights"}
    done = [p.done for p in seen]
    assert done == sorted(done) and done[0] > 0
    total, count = stored_bytes(ckpt)
    last = seen[-1]
    assert (last.done, last.total) == (total, total)
    assert (last.tensors, last.tensors_total) == (count, count) == (len(seen), len(seen))
    assert not any(p.quantizing for p in seen) and last.unit == "B"


def test_quantizing_on_load_is_reported_as_such(tmp_path):
    fp8 = write_tiny_checkpoint(tmp_path / "fp8", fp8=True, num_hidden_layers=2, **ALIGNED)
    bf16 = write_dequantized_twin(fp8, tmp_path / "bf16")
    on_load, as_stored = [], []
    Engine.load(bf16, max_context=64, weights="fp8", progress=on_load.append)
    Engine.load(fp8, max_context=64, weights="fp8", progress=as_stored.append)
    to_int4 = []
    Engine.load(fp8, max_context=64, weights="int4", progress=to_int4.append)
    assert to_int4 and all(p.quantizing == "int4" for p in to_int4)  # FP8 to 4 bits as it is read
    assert on_load and all(p.quantizing == "fp8" for p in on_load)  # bf16 quantized as it is read
    assert as_stored and not any(p.quantizing for p in as_stored)  # FP8 read as it is
    assert on_load[-1].done == on_load[-1].total == stored_bytes(bf16)[0]


def test_random_weights_report_progress(ckpt):
    seen = []
    engine = Engine.load(ModelConfig.load(ckpt), max_context=64, progress=seen.append)
    params = list(engine.model.parameters()) + list(engine.head.parameters())
    assert seen[-1].tensors == seen[-1].tensors_total == len(params)
    assert seen[-1].done == seen[-1].total == sum(p.numel() for p in params) * 4   # float32 on the CPU


def test_without_a_callback_nothing_is_reported(ckpt):
    Engine.load(ckpt, max_context=64)      # the default: no callback, no error


def test_the_cli_bar_shows_bytes_and_stage(ckpt):
    from mtpchat.progress import LoadBar
    out = io.StringIO()
    bar = LoadBar(file=out, min_interval=0)
    Engine.load(ckpt, max_context=64, progress=bar)
    bar.close()
    text = out.getvalue()
    total, count = stored_bytes(ckpt)
    final = text.rstrip("\n").split("\r")[-1]
    assert final.startswith("loading weights: 100%")
    assert f"{fmt_bytes(total)} / {fmt_bytes(total)}, {count}/{count} tensors" in final


@pytest.mark.gpu
def test_graph_capture_reports_its_steps(ckpt):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen = []
    Engine.load(ckpt, device="cuda", max_context=64, k_max=2, draft_tokens=2, progress=seen.append)
    capture = [p for p in seen if p.stage == "capture"]
    # phases: verify and accept for k = 0..2, draft for k = 1..2; each warmed up, then captured
    assert [p.done for p in capture] == list(range(1, 2 * 8 + 1))
    assert capture[-1].total == 16 and seen[-1] is capture[-1]
