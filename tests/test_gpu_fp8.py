"""The engine on the GPU with FP8 weights (bf16 activations): CUDA graphs, greedy MTP on equal to MTP
off, and the FP8 model close to the CPU's exact product of its dequantized weights (the GPU's prefill
quantizes activations per token and 128 columns, as the FP8 recipe does)."""
import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.plan import KernelPlan
from tools.tiny import write_tiny_checkpoint
from helpers import FLOAT32_CHUNK, assert_mtp_on_equals_off, gpu_prompts, random_ids, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# every fused product's parts on whole 128-row blocks (each stored in FP8), K over several blocks
SHAPE = dict(hidden_size=384, intermediate_size=640, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
             linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu-fp8"), fp8=True, **SHAPE)


@pytest.mark.parametrize("graphs", [True, False])
def test_fp8_greedy_mtp_on_equals_off(ckpt, graphs):
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs, max_context=1024)
    assert engine.fp8 and engine.model.layers[0].mlp.gate_up.dtype == torch.float8_e4m3fn
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, 4), 96, profile_ks=(1, 2, 3, 4), ks=(3,))


@pytest.mark.parametrize("rides", [False, True])
def test_fp8_b_a_riding_or_apart_keeps_mtp_on_equal_to_off(ckpt, rides):
    # the GDN's bf16 b|a rows in the FP8 in_proj's launch (ProductPlan.rides) or a launch of their own
    engine = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, cuda_graphs=True, max_context=1024)
    engine.plan = engine.decoder.plan = engine.plan.replace(rides=rides)
    assert engine.model.layers[0].mixer.in_proj_ba is not None
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, 3), 64, profile_ks=(2, 3), ks=(3,))


def test_fp8_prefill_on_the_gpu_is_close_to_the_cpu(ckpt):
    # the prefill quantizes its activations to e4m3 (3 bits of mantissa, about 3% a value), which a
    # random 8-layer model amplifies: a loose bound
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512, cuda_graphs=False)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = gpu_prompts(cpu, 6)[5]
    assert rel_err(gpu.logits(ids), cpu.logits(ids), ord=2) < 0.3


def step_error(engine, cpu, ids) -> float:
    """The steps' logits, fed the prompt one token at a time after a 1-token prefill, against the
    CPU's full forward."""
    want = cpu.logits(ids)
    dec = engine.decoder
    engine.mtp = False
    with torch.inference_mode():
        dec.reset()
        dec.begin(ids[:1])
        dec.limit(len(ids), set())
        steps = []
        for tok in ids[1:]:
            dec.next_tok.fill_(tok)                 # the prompt's token in place of the sampled one
            dec.last = tok
            dec.step(0, SamplingParams(), None)
            steps.append(dec.v_logits[0].float().cpu())
    return rel_err(torch.stack(steps)[:-1], want[1:-1], ord=2)


def test_fp8_steps_follow_the_cpu_as_bf16_does(ckpt, tmp_path, monkeypatch):
    # the steps (bf16 activations over FP8 weights, scaled in registers) against the CPU's exact
    # product of the dequantized weights, as close as the same model in bf16 on the GPU is; the
    # 1-token prefill takes the exact product too, so that only the steps are measured
    from tools.tiny import write_dequantized_twin
    from mtpchat.kernels import fp8_gemm
    from mtpchat.kernels.fp8 import dequantize_ref
    monkeypatch.setattr(fp8_gemm, "gemm", lambda x, q, plan=None: (x.float() @ dequantize_ref(q).T).to(x.dtype))
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = gpu_prompts(cpu, 3)[2][:40]
    plan = KernelPlan.choose("cuda", cpu.config, fp8=True).replace(prefill_quant=False)   # bf16 rows for it
    fp8 = step_error(Engine.load(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512, plan=plan), cpu, ids)
    twin = write_dequantized_twin(ckpt, tmp_path / "bf16")
    bf16 = step_error(Engine.load(twin, device="cuda", dtype=torch.bfloat16, max_context=512), cpu, ids)
    assert fp8 < 1.5 * bf16 + 1e-3, (fp8, bf16)


# value heads of 128, so that the GDN output norm's heads are the FP8 groups of out_proj
WIDE_HEADS = {**SHAPE, "linear_value_head_dim": 128}


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu-fp8-128"), fp8=True, **WIDE_HEADS)


def test_prefill_kernel_candidates(wide_heads):
    """Prefill's forms (KernelPlan.prefill_quant, prefill_rows, prefill_conv_tokens and _blocks,
    prefill_gate, chunk_fused_out, chunk_normed), each against all of them off: the
    fused quantization hands the products the codes they would have made, the conv's larger tiles
    and blocks make the same sums (the same logits, bit for bit); larger tiles of the norms, the
    one-kernel output gate, the chunked GDN's fused output and unit rows written once sum in
    another order at most; greedy MTP on == off.
    The chunked GDN's precision (chunk_solved, chunk_terms, chunk_products, chunk_prep_products:
    tests/helpers.FLOAT32_CHUNK) stays float32 and tf32
    in every row here: its bf16 forms are checked against the reference in
    tests/kernels/test_gdn_chunk.py and against a float32 model in tests/test_gpu_engine.py; on this
    random model, whose activations are quantized to FP8 (a code flip moves a value by 6-12 %),
    they moved the logits by some 0.15 (an H100, 2026-11-26)."""
    engine = Engine.load(wide_heads, device="cuda", dtype=torch.bfloat16, max_context=1024, cuda_graphs=False)
    ids = random_ids(300, 5, engine.config.vocab_size - 64)   # enough rows for cuBLAS's products
    default = engine.plan
    off = dict(prefill_rows=1, prefill_conv_tokens=16, prefill_conv_blocks=1, prefill_quant=False,
               prefill_gate=False, chunk_fused_out=False, chunk_normed=False)
    base = default.replace(**off, **FLOAT32_CHUNK)
    engine.plan = engine.decoder.plan = base
    want = engine.logits(ids)
    # (changes to all off, the largest relative difference allowed: 0 is bit for bit)
    forms = [(dict(prefill_quant=True), 0), (dict(prefill_conv_tokens=64), 0), (dict(prefill_conv_blocks=8), 0),
             (dict(prefill_rows=8), 1e-2),
             (dict(chunk_fused_out=True), 1e-2), (dict(chunk_normed=True), 1e-2),
             (dict(prefill_gate=True), 1e-2),
             (dict(prefill_gate=True, prefill_quant=True), 1e-2), ({k: getattr(default, k) for k in off}, 1e-2),
             (dict(prefill_rows=16, prefill_conv_tokens=64, prefill_quant=True, chunk_fused_out=True,
                   prefill_gate=True), 1e-2)]
    errors = []
    for changes, bound in forms:
        engine.plan = engine.decoder.plan = base.replace(**changes)
        got = engine.logits(ids)
        err = 0.0 if torch.equal(got, want) else rel_err(got, want, ord=2)
        errors.append((changes, err, bound))
    assert all(err <= bound for _, err, bound in errors), \
        "\n".join(f"{changes}: {err:.3g} (bound {bound:g})" for changes, err, bound in errors)
    engine.plan = engine.decoder.plan = default
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, 2), 48, ks=(3,))
