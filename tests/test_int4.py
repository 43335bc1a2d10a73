"""4-bit checkpoints (GPTQ, compressed-tensors pack-quantized) and --weights int4 on load (float32,
CPU): a 4-bit model is the model of its dequantized weights, which transformers reads as the
oracle (the MTP head: our float32 engine on those weights); quantizing on load stores exactly what
an offline quantization stores; greedy MTP on equals MTP off; what cannot be read is refused in
one line."""
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpchat.engine import Engine, SamplingParams, memory
from mtpchat.engine.config import ModelConfig, UnsupportedFormat, rtn_format
from mtpchat.engine.dispatch import weight
from mtpchat.engine.weights import WeightsError
from mtpchat.kernels import int4
from mtpchat.kernels.int4 import GroupInt4, quantize_ref
from tools.int4 import ALIGNED, write_compressed_checkpoint, write_gptq_checkpoint, write_rtn_checkpoint
from tools.tiny import write_tiny_checkpoint
from helpers import assert_mtp_on_equals_off, random_ids, rel_err
from mtp_support import generate, load, profile_drafter, steps_of

transformers = pytest.importorskip("transformers")

LENGTHS = (1, 63, 130, 257)
KINDS = {   # name -> (writer, options)
    "gptq": (write_gptq_checkpoint, {}),                                     # the official releases' layout
    "gptq-desc-act": (write_gptq_checkpoint, dict(desc_act=True, dynamic={"-:.*visual.*": {}})),
    "gptq-v2-asym": (write_gptq_checkpoint, dict(symmetric=False, v2=True, dynamic={})),
    "ct-sym": (write_compressed_checkpoint, {}),
    "ct-asym-actorder": (write_compressed_checkpoint, dict(symmetric=False, desc_act=True)),
    "gptq-moe": (write_gptq_checkpoint, dict(moe=True, desc_act=True, dynamic={"-:.*visual.*": {}})),
    "ct-moe": (write_compressed_checkpoint, dict(moe=True, symmetric=False)),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            writer, options = KINDS[kind]
            made[kind] = writer(tmp_path_factory.mktemp(kind), **options)
        return made[kind]
    return get


def int4_params(engine, module=None) -> list[str]:
    """The packed 4-bit weights (int32 words, or int16 interleaved) and perms of the model or `module`."""
    return [n for n, p in (module or engine.model).named_parameters() if p.dtype in (torch.int32, torch.int16)]


def oracle(twin: Path):
    config = json.loads((twin / "config.json").read_text())
    cls = transformers.Qwen3_5MoeForCausalLM if "Moe" in config["architectures"][0] else transformers.Qwen3_5ForCausalLM
    return cls.from_pretrained(twin, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", list(KINDS))
def test_4bit_logits_equal_transformers_on_the_dequantized_weights(ckpts, kind):
    quantized, twin = ckpts(kind)
    engine = Engine.load(quantized, max_context=512, prefill_chunk=48)
    assert engine.weight_format == "int4" and engine.int4.method == KINDS[kind][0].__name__.split("_")[1].replace(
        "compressed", "compressed-tensors")
    stored = int4_params(engine)
    assert any(n.endswith("mlp.experts_gate_up" if "moe" in kind else "mlp.gate_up") for n in stored)
    if kind == "gptq":       # the official releases: the MLPs in 4 bits, attention (GDN and full) in bf16
        assert all(".mlp." in n for n in stored)
    # a column order is stored exactly where the checkpoint quantized out of order
    desc_act = KINDS[kind][1].get("desc_act", False)
    assert any(n.endswith("_perm") for n, _ in engine.model.named_parameters()) == desc_act
    ref = oracle(twin)
    for n in LENGTHS:
        ids = random_ids(n, n, engine.config.vocab_size)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert rel_err(engine.logits(ids), want) < 1e-4, n


def test_parts_of_different_column_orders_keep_their_product_in_the_model_dtype(tmp_path):
    # desc_act with each module its own order: gate and up (q|k|v, the GDN's qkv|z) cannot share one
    quantized, twin = write_gptq_checkpoint(tmp_path, desc_act=True, mixed_orders=True, dynamic={})
    engine = Engine.load(quantized, max_context=512)
    params = dict(engine.model.named_parameters())
    assert params["layers.0.mlp.gate_up"].dtype == torch.float32 and "layers.0.mlp.gate_up_perm" not in params
    assert params["layers.0.mlp.down"].dtype == torch.int32 and "layers.0.mlp.down_perm" in params
    ids = random_ids(70, 3, engine.config.vocab_size)
    with torch.no_grad():
        want = oracle(twin)(torch.tensor([ids])).logits[0]
    assert rel_err(engine.logits(ids), want) < 1e-4


def head_rows(engine, prompt, ref_tokens) -> list[torch.Tensor]:
    """The MTP head's rows that count in every call during a greedy generation with drafts of a
    chosen acceptance (the same calls on any engine that generates the same tokens): all of a
    chained draft, the rows of positions already fed of the others (the rest are scratch)."""
    rows = []

    def keep(m, args, out):
        ids, ctx = args[1], args[4]
        pos = ctx.positions + torch.arange(len(ids)) if ctx.positions.numel() == 1 else ctx.positions
        fed = engine.state.length
        rows.append(out.clone() if len(ids) == 1 and int(pos[0]) >= fed else out[pos < fed].clone())
    engine.drafter = profile_drafter(ref_tokens, 3, engine)
    hook = engine.head.register_forward_hook(keep)
    try:
        out = generate(engine, prompt, SamplingParams(max_tokens=40, stop_token_ids=()))[-1].token_ids
    finally:
        hook.remove()
        engine.drafter = None
    assert list(out) == ref_tokens
    return rows


@pytest.mark.parametrize("kind", ["ct-sym", "ct-moe", "gptq-v2-asym"])
def test_the_4bit_mtp_head_equals_the_float32_one_on_the_dequantized_weights(ckpts, kind):
    quantized, twin = ckpts(kind)
    mine, plain = load(quantized, draft_tokens=3), load(twin, draft_tokens=3)
    assert int4_params(mine, mine.head)        # the MTP layer's products in 4 bits
    # the fc too where the checkpoint holds it so (GPTQ with an empty dynamic map, with its zeros;
    # compressed-tensors here keeps it in bf16)
    fc = weight(mine.head, "fc")
    if kind == "gptq-v2-asym":
        assert isinstance(fc, GroupInt4) and fc.zero is not None
    else:
        assert isinstance(fc, torch.Tensor) and fc.is_floating_point()
    prompt = random_ids(60, 5, mine.config.vocab_size)
    ref = list(generate(plain, prompt, SamplingParams(max_tokens=40, stop_token_ids=()))[-1].token_ids)
    got, want = head_rows(mine, prompt, ref), head_rows(plain, prompt, ref)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4


@pytest.mark.parametrize("kind", ["ct-asym-actorder", "gptq-moe"])
def test_greedy_mtp_on_equals_off_in_4bits(ckpts, kind):
    engine = Engine.load(ckpts(kind)[0], max_context=512)
    prompts = [random_ids(17 + 30 * seed, seed, engine.config.vocab_size) for seed in range(2)]
    assert_mtp_on_equals_off(engine, prompts, 30, ks=(1, 3))


@pytest.mark.parametrize("kind", ["ct-sym", "gptq-moe", "ct-moe"])
def test_interleaved_weights_make_the_same_model(ckpts, kind):
    """Under the plan's int4_interleave (the default) the 4-bit weights are stored interleaved
    (int16 words: kernels/int4.py) where their layout allows: not a weight with a perm (desc_act),
    nor any of an MoE block that has one (its expert kernels read one layout); the logits and the
    MTP head's are the same bits as with the natural layout."""
    folder = ckpts(kind)[0]
    engine = Engine.load(folder, max_context=256)
    assert engine.plan.products.int4_interleave
    plain = Engine.load(folder, max_context=256, plan=engine.plan.replace(int4_interleave=False))
    assert not [n for m in (plain.model, plain.head) for n, p in m.named_parameters() if p.dtype == torch.int16]
    names = {f"{key}.{n}": p for key, m in (("model", engine.model), ("mtp", engine.head)) for n, p in m.named_parameters()}
    interleaved = [n for n, p in names.items() if p.dtype == torch.int16]
    words = [n for n, p in names.items() if p.dtype == torch.int32 and not n.endswith("_perm")]
    perms = [n for n in names if n.endswith("_perm")]
    block = lambda n: n.split(".mlp.")[0] + ".mlp." if ".mlp." in n else n
    assert all(n + "_perm" in names or any(q.startswith(block(n)) for q in perms) for n in words)
    assert bool(interleaved) == (kind != "gptq-moe")     # desc_act: every 4-bit weight has a perm
    if kind == "ct-sym":
        assert not words
    if kind == "ct-moe":        # the experts (and the shared one, 4-bit here) interleaved with the rest
        assert any("experts" in n for n in interleaved) and any("shared" in n for n in interleaved)
    ids = random_ids(40, 1, plain.config.vocab_size)
    assert torch.equal(engine.logits(ids), plain.logits(ids))
    # with MTP on (the head's drafts and their acceptance included), the same steps
    ids = random_ids(23, 2, engine.config.vocab_size)
    params = SamplingParams(max_tokens=12, stop_token_ids=())
    got, want = (steps_of(generate(e, ids, params)) for e in (engine, plain))
    assert [(s.token_ids, s.accepted) for s in got] == [(s.token_ids, s.accepted) for s in want]


def test_which_4bit_weights_interleave():
    """Groups of 64 or 128 columns without a perm (int4.interleavable: the tiles hold whole groups,
    the experts' prefill tiles 128 columns); an MoE-like block all or none."""
    from torch import nn
    from mtpchat.engine.weights import interleave_int4

    def product(group, perm=False):
        m = nn.Module()
        q = quantize_ref(torch.randn(8, 512, generator=torch.Generator().manual_seed(group)), group)
        m.w, m.w_scale = nn.Parameter(q.w, requires_grad=False), nn.Parameter(q.scale, requires_grad=False)
        if perm:
            m.w_perm = nn.Parameter(torch.arange(512, dtype=torch.int32), requires_grad=False)
        return m
    root = nn.Module()
    root.a, root.b, root.c, root.d = product(64), product(128), product(256), product(128, perm=True)
    root.block = nn.Module()
    root.block.e, root.block.f = product(128), product(256)      # f does not interleave: neither does e
    root.other = nn.Module()
    root.other.g, root.other.h = product(128), product(64)
    interleave_int4(root, together=lambda m: m is root.block or m is root.other)
    dtypes = {n: p.dtype for n, p in root.named_parameters() if n.endswith(".w")}
    assert dtypes == {"a.w": torch.int16, "b.w": torch.int16, "c.w": torch.int32, "d.w": torch.int32,
                      "block.e.w": torch.int32, "block.f.w": torch.int32, "other.g.w": torch.int16,
                      "other.h.w": torch.int16}


def stored_tensors(engine) -> dict[str, torch.Tensor]:
    return {f"{key}.{n}": p for key, m in (("model", engine.model), ("mtp", engine.head))
            for n, p in m.named_parameters()}


@pytest.mark.parametrize("source", ["float", "fp8"])
def test_weights_int4_on_load_equals_quantizing_offline(tmp_path, source):
    ckpt = write_tiny_checkpoint(tmp_path / source, fp8=source == "fp8", **ALIGNED)
    offline = write_rtn_checkpoint(ckpt, tmp_path / "offline")
    on_load, from_disk = Engine.load(ckpt, weights="int4"), Engine.load(offline)
    assert on_load.int4 == rtn_format() and on_load.weight_format == from_disk.weight_format == "int4"
    mine, theirs = stored_tensors(on_load), stored_tensors(from_disk)
    assert mine.keys() == theirs.keys()
    # the head's layer's four products and its fc ([H, 2H], a draft's largest read after the head rows)
    assert len(int4_params(on_load)) == 4 * 4 and len(int4_params(on_load, on_load.head)) == 5
    assert mine["mtp.fc"].dtype == torch.int16 and mine["mtp.fc_scale"].dtype == torch.float16
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name
    kept = dict(on_load.model.named_parameters())
    assert kept["layers.0.mixer.in_proj_ba"].dtype == kept["embed"].dtype == kept["lm_head"].dtype == torch.float32
    assert kept["layers.0.mixer.in_proj_scale"].dtype == torch.float16


def test_quantizing_a_fused_product_part_by_part_equals_quantizing_the_whole():
    # groups run along K, so the rows of each part (q|k|v, gate|up) quantize on their own as in the whole
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(rows, 384, generator=g) for rows in (256, 64, 64, 8)]
    whole = quantize_ref(torch.cat(parts))
    each = [quantize_ref(p) for p in parts]
    assert torch.equal(whole.w, torch.cat([q.w for q in each]))
    assert torch.equal(whole.scale, torch.cat([q.scale for q in each]))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantizing_a_few_rows_at_a_time_equals_the_whole(monkeypatch, symmetric):
    w = torch.randn(203, 384, generator=torch.Generator().manual_seed(1))
    whole = quantize_ref(w, 128, symmetric)
    monkeypatch.setattr(int4, "QUANTIZE_AT_ONCE", 20 * 384)      # 11 slices, the last of 3 rows
    sliced = quantize_ref(w, 128, symmetric)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced) if a is not None)
    assert (whole.zero is None) == symmetric and (sliced.zero is None) == symmetric
    # interleaving (some 20 bytes a weight at its peak: whole, 10 GB for a layer of the 35B-A3B's
    # experts) goes a few rows at a time too, to the same words
    monkeypatch.setattr(int4, "QUANTIZE_AT_ONCE", 1 << 30)
    il = int4.interleave_ref(whole)
    monkeypatch.setattr(int4, "QUANTIZE_AT_ONCE", 20 * 384)
    assert torch.equal(int4.interleave_ref(whole).w, il.w) and torch.equal(int4.values_ref(il), int4.values_ref(whole))


def test_quantizing_on_load_needs_little_memory_beyond_the_weight(monkeypatch):
    # its float32 work is some 24 bytes a weight: one layer's stack of the 35B-A3B's experts whole
    # (537M weights) would need 13 GB on the GPU beside the model; a few rows at a time, a few
    status = Path("/proc/self/status")
    if not status.exists() or not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's peak resident size")
    peak = lambda: int(re.search(r"VmHWM:\s+(\d+)", status.read_text())[1]) * 1024
    resident = lambda: int(re.search(r"VmRSS:\s+(\d+)", status.read_text())[1]) * 1024
    monkeypatch.setattr(int4, "QUANTIZE_AT_ONCE", 1 << 20)
    w = torch.randn(8192, 2048, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = resident()
    Path("/proc/self/clear_refs").write_text("5")                  # the peak starts from here
    q = quantize_ref(w)
    assert q.shape == w.shape and peak() - before < 10 * w.numel()     # 24 bytes a weight whole


def test_random_weights_in_4bits():
    c = ModelConfig.from_dict(json.loads(json.dumps(  # the tiny aligned shapes, as a bare config
        {"model_type": "qwen3_5_text", "vocab_size": 256, "num_hidden_layers": 4, "mtp_num_hidden_layers": 1,
         **ALIGNED, "layer_types": ["linear_attention"] * 3 + ["full_attention"]})))
    engine = Engine(c, weights="int4", max_context=256)
    assert engine.weight_format == "int4" and len(int4_params(engine)) == 4 * 4
    assert Engine(c, max_context=256).weight_format == "float32"
    logits = engine.logits(random_ids(20, 0, 256))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_random_weights_of_a_4bit_release_hold_its_4bit_parts():
    """`--random-weights qwen3.5-27b-gptq-int4`: the release's format with no checkpoint behind it
    stores in 4 bits what the release holds in 4 bits (its MLPs; attention, GDN and MTP in the
    model dtype), not every product in bf16."""
    c = ModelConfig.from_dict(json.loads(json.dumps(
        {"model_type": "qwen3_5_text", "vocab_size": 256, "num_hidden_layers": 4, "mtp_num_hidden_layers": 1,
         **ALIGNED, "layer_types": ["linear_attention"] * 3 + ["full_attention"]})))
    gptq = dataclasses.replace(rtn_format(), method="gptq", skip=(".*attn.*", ".*shared_expert.*", ".*mtp.*"))
    engine = Engine(dataclasses.replace(c, quantization="int4", int4=gptq), max_context=256)
    assert engine.weight_format == "int4"
    assert sorted(int4_params(engine)) == sorted(f"layers.{i}.mlp.{p}" for i in range(4) for p in ("gate_up", "down"))
    assert engine.memory()["weights"] == memory.weight_bytes(engine.config, "float32", int4=gptq, draft_vocab=None)
    logits = engine.logits(random_ids(20, 0, 256))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_weights_bf16_dequantizes_a_4bit_checkpoint(ckpts):
    quantized, twin = ckpts("ct-sym")
    plain = Engine.load(quantized, weights="bf16")
    assert plain.int4 is None and not int4_params(plain) and plain.weight_format == "float32"
    ids = random_ids(40, 1, plain.config.vocab_size)
    assert rel_err(plain.logits(ids), Engine.load(twin).logits(ids)) < 1e-6
    with pytest.raises(UnsupportedFormat, match="this checkpoint is in 4 bits"):
        Engine.load(quantized, weights="fp8")


def test_the_plan_follows_the_format_the_products_are_kept_in(ckpts, monkeypatch):
    # KernelPlan.choose hears whether the products are kept in 4 bits: a 4-bit checkpoint as it is,
    # or dequantized by weights "bf16" (whose plan is then a bf16 model's: its chunks, its pieces)
    from mtpchat.engine.plan import KernelPlan
    choose, heard = KernelPlan.choose.__func__, []
    monkeypatch.setattr(KernelPlan, "choose", classmethod(
        lambda cls, *args, **kw: heard.append(kw.get("four_bit")) or choose(cls, *args, **kw)))
    quantized, twin = ckpts("ct-sym")
    for weights, four_bit in ((None, True), ("int4", True), ("bf16", False)):
        Engine.load(quantized, weights=weights)
        assert heard[-1] is four_bit, weights
    Engine.load(twin, weights="int4")
    assert heard[-1] is True


# --- what cannot be read ----------------------------------------------------------------------------
def with_config(src: Path, dst: Path, **quant) -> Path:
    folder = Path(shutil.copytree(src, dst))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = config["quantization_config"] | quant
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "GPTQ bits 8 is not supported (only 4-bit GPTQ is read)"),
    ({"group_size": -1}, "GPTQ group_size -1 is not supported"),
    ({"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ({"dynamic": {"+:.*down_proj.*": {"bits": 8}}}, "GPTQ dynamic rule '+:.*down_proj.*' changing {'bits': 8}"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVIDIA ModelOpt quantization NVFP4 is not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
     "compressed-tensors format 'nvfp4-pack-quantized' (config group 'group_0') is not supported"),
    ({"quant_method": "gguf"}, "GGUF quantization is not supported"),
])
def test_unsupported_4bit_forms_are_refused_in_one_line(ckpts, tmp_path, change, message):
    folder = with_config(ckpts("gptq")[0], tmp_path / "bad", **change)
    with pytest.raises(UnsupportedFormat) as e:
        Engine.load(folder)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_gguf_folder_is_refused(tmp_path):
    (tmp_path / "Qwen3.5-27B-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(UnsupportedFormat, match="a GGUF checkpoint .Qwen3.5-27B-Q4_K_M.gguf. is not supported"):
        Engine.load(tmp_path)


def damage(src: Path, dst: Path, name: str, value) -> Path:
    """A copy of checkpoint src with tensor `name` replaced by value (None: removed)."""
    folder = Path(shutil.copytree(src, dst))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][name]
    held = load_file(str(folder / shard))
    if value is None:
        del held[name], index["weight_map"][name]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        held[name] = value
    save_file(held, str(folder / shard), metadata={"format": "pt"})
    return folder


DOWN = "model.language_model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("kind, tensor, value, message", [
    ("gptq", "qweight", torch.zeros(3, 3, dtype=torch.int32),
     rf"{DOWN}.qweight has shape \[3, 3\], expected \[48, 256\]"),
    ("gptq", "qzeros", None, rf"the 4-bit module {DOWN} has no {DOWN}.qzeros"),
    ("gptq", "scales", torch.ones(3, 256, dtype=torch.int32), rf"{DOWN}.scales is stored as I32, expected F16 or BF16"),
    ("gptq", "g_idx", torch.zeros(384, dtype=torch.int32), rf"{DOWN}.g_idx: g_idx does not put exactly 128"),
    ("ct-asym-actorder", "weight_zero_point", None, rf"the 4-bit module {DOWN} has no {DOWN}.weight_zero_point"),
    ("ct-sym", "weight_shape", torch.tensor([256, 385]), rf"{DOWN}.weight_shape says \[256, 385\], expected \[256, 384\]"),
])
def test_damaged_4bit_tensors_are_named(ckpts, tmp_path, kind, tensor, value, message):
    folder = damage(ckpts(kind)[0], tmp_path / "bad", f"{DOWN}.{tensor}", value)
    with pytest.raises(WeightsError, match=message):
        Engine.load(folder)


def test_a_4bit_config_over_float_weights_is_refused(ckpts, tmp_path):
    quantized, twin = ckpts("gptq")
    folder = Path(shutil.copytree(twin, tmp_path / "mislabelled"))
    shutil.copy(quantized / "config.json", folder / "config.json")
    with pytest.raises(UnsupportedFormat, match="no module is stored so; the config does not belong"):
        Engine.load(folder)


def test_the_packing_is_gptqs_nibble_order():
    # weight k of a word in bits 4 (k % 8): written out here, not through the packer under test
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [15, 0, 0, 0, 0, 0, 0, 9]])
    words = int4.pack_ref(q)
    assert words.dtype == torch.int32 and words[0, 0].item() == 0x87654321 - 2 ** 32     # nibble 7 = 8: sign bit
    assert words[1, 0].item() == 0x9000000F - 2 ** 32
    assert torch.equal(int4.unpack_ref(words), q.to(torch.int32))
    # a symmetric group dequantizes as (q - 8) * scale, its column order put back by perm
    g = int4.GroupInt4(words, torch.tensor([[0.5], [2.0]], dtype=torch.float16), None,
                       torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.int32))
    want = torch.tensor([[-3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0],
                         [14.0, -16.0, -16.0, -16.0, -16.0, -16.0, -16.0, 2.0]]).flip(1)
    assert torch.equal(int4.dequantize_ref(g), want)
