"""The Qwen3.5/3.6 MoE models (float32, CPU) against transformers' Qwen3_5MoeForCausalLM: checkpoints
with their experts stacked, per expert, and as transformers' save_pretrained writes them, re-saved in
the other layout; a wrong renormalisation or shared-expert gate fails the comparison; greedy MTP on == off; FP8 experts; the
memory plan; the experts-read telemetry."""
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpchat.engine import Engine, SamplingParams, memory
from mtpchat.engine.config import ConfigError, ModelConfig
from tools.tiny import write_dequantized_twin, write_tiny_checkpoint
from mtpchat.engine.weights import PER_EXPERT, STACKED, expert_layout, text_prefix
from mtpchat.kernels import moe_routing
from mtpchat.kernels.fp8 import quantize_ref
from helpers import assert_mtp_on_equals_off, random_ids, rel_err

transformers = pytest.importorskip("transformers")

LENGTHS = [1, 5, 64, 65, 130]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {STACKED: write_tiny_checkpoint(root / "stacked", moe=True, experts=STACKED, seed=1),
            PER_EXPERT: write_tiny_checkpoint(root / "per_expert", moe=True, experts=PER_EXPERT, seed=2),
            # a shared expert wider than the routed ones: its own products, not expert E
            "wide shared": write_tiny_checkpoint(root / "wide", moe=True, seed=3, shared_expert_intermediate_size=56)}


@pytest.fixture(scope="module")
def saved_by_transformers(ckpts, tmp_path_factory):
    """A model transformers builds from the config and initialises itself, as its save_pretrained
    writes it (no MTP head: transformers has none), with the tokenizer beside it."""
    src = ckpts[STACKED]
    config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(5)
    model = transformers.Qwen3_5MoeForCausalLM(config.text_config).eval()
    with torch.no_grad():       # transformers starts the router at zero: every expert tied
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("moe_saved")
    model.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out)
    return out


def max_error(folder, engine=None) -> float:
    engine = engine or Engine.load(folder, max_context=512, prefill_chunk=48)
    ref = transformers.Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    worst = 0.0
    for n in LENGTHS:
        ids = random_ids(n, n, engine.config.vocab_size)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        worst = max(worst, rel_err(engine.logits(ids), want))
    return worst


@pytest.mark.parametrize("layout", [STACKED, PER_EXPERT])
def test_logits_equal_transformers(ckpts, layout):
    assert expert_layout(ckpts[layout]) == layout
    assert max_error(ckpts[layout]) < 1e-4


def test_a_wide_shared_expert_runs_apart_and_equals_transformers(ckpts):
    engine = Engine.load(ckpts["wide shared"], max_context=512, prefill_chunk=48)
    assert not engine.plan.shared_as_expert                     # the plan sees it is wider than a routed one
    assert max_error(ckpts["wide shared"], engine) < 1e-4
    stacked = Engine.load(ckpts[STACKED], max_context=512, prefill_chunk=48)
    assert stacked.plan.shared_as_expert
    apart = Engine.load(ckpts[STACKED], max_context=512, prefill_chunk=48,
                        plan=stacked.plan.replace(shared_as_expert=False))   # the same model, the shared expert apart
    assert max_error(ckpts[STACKED], apart) < 1e-4


def resave(src: Path, out: Path, experts: str) -> Path:
    """The checkpoint at `src` with its experts re-saved STACKED (`experts.gate_up_proj` [E, 2F, H],
    `experts.down_proj` [E, H, F]) or PER_EXPERT (`experts.{e}.gate_proj.weight` ...): the same weights."""
    w = {}
    for f in src.glob("*.safetensors"):
        w |= load_file(f)
    for name in [n for n in w if n.endswith(".mlp.experts.gate_up_proj")]:          # stacked -> per expert
        base = name.removesuffix("gate_up_proj")
        gate_up, down = w.pop(name), w.pop(base + "down_proj")
        for e in range(gate_up.shape[0]):
            g, u = gate_up[e].chunk(2)
            w |= {f"{base}{e}.gate_proj.weight": g, f"{base}{e}.up_proj.weight": u, f"{base}{e}.down_proj.weight": down[e]}
    if experts == STACKED:
        for name in [n for n in w if n.endswith(".mlp.experts.0.gate_proj.weight")]:
            base = name.removesuffix("0.gate_proj.weight")
            E = sum(n.startswith(base) and n.endswith(".gate_proj.weight") for n in w)
            part = lambda e, p: w.pop(f"{base}{e}.{p}_proj.weight")
            w[base + "gate_up_proj"] = torch.stack([torch.cat([part(e, "gate"), part(e, "up")]) for e in range(E)])
            w[base + "down_proj"] = torch.stack([part(e, "down") for e in range(E)])
    out.mkdir()
    save_file({n: t.contiguous() for n, t in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out)
    return out


@pytest.mark.parametrize("experts", [STACKED, PER_EXPERT])
def test_logits_equal_transformers_on_its_own_save(saved_by_transformers, tmp_path, experts):
    """transformers' save as it writes it (per expert in 5.x), and re-saved in the other layout, both
    against the model transformers loads from its own save."""
    own = expert_layout(saved_by_transformers, text_prefix(saved_by_transformers))
    folder = saved_by_transformers if own == experts else resave(saved_by_transformers, tmp_path / experts, experts)
    assert expert_layout(folder, text_prefix(folder)) == experts
    engine = Engine.load(folder, max_context=512, prefill_chunk=48)
    assert engine.config.is_moe and engine.head is None
    assert max_error(saved_by_transformers, engine) < 1e-4


@pytest.mark.parametrize("mistake", ["no renormalisation", "shared gate not squashed", "no shared gate"])
def test_a_wrong_router_fails_the_comparison(ckpts, monkeypatch, mistake):
    right = moe_routing.route_ref

    def wrong(logits, top_k, n_experts, shared=False):
        ids, weights, gate = right(logits, top_k, n_experts, shared)
        probs = torch.softmax(logits[:, :n_experts].float(), -1)
        gates = weights[:, top_k:] if shared else gate        # the shared expert's gate, either form
        if mistake == "no renormalisation":
            weights[:, :top_k] = torch.gather(probs, 1, ids[:, :top_k].long())
        elif mistake == "shared gate not squashed":
            gates.copy_(logits[:, n_experts:n_experts + 1].float().view_as(gates))
        else:
            gates.fill_(1.0)
        return ids, weights, gate
    monkeypatch.setattr(moe_routing, "route_ref", wrong)
    for name in (STACKED, "wide shared"):
        assert max_error(ckpts[name]) > 1e-3, name


@pytest.mark.parametrize("layout", [STACKED, PER_EXPERT])
def test_greedy_mtp_on_equals_off(ckpts, layout):
    engine = Engine.load(ckpts[layout], max_context=600)
    prompts = [random_ids(20 + 31 * p, 40 + p, engine.config.vocab_size) for p in range(2)]
    runs = assert_mtp_on_equals_off(engine, prompts, 48, ks=(1, 2, 3, 4))
    assert all(done.stats.verify_steps > 0 for done in runs)


@pytest.mark.parametrize("four_bit", [True, False])
def test_a_prefill_routes_for_its_experts_format(ckpts, tmp_path, monkeypatch, four_bit):
    """The MoE layer tells the routing whether its experts are 4-bit (their prefill blocks follow
    other thresholds: ProductPlan.int4_moe_prefill_blocks); a step's routing is told too and ignores it."""
    from tools.int4 import write_compressed_checkpoint
    seen = []
    real = moe_routing.route
    monkeypatch.setattr(moe_routing, "route", lambda *a, **kw: seen.append((a[3], kw["four_bit"])) or real(*a, **kw))
    folder = write_compressed_checkpoint(tmp_path, moe=True, group=32)[0] if four_bit else ckpts[STACKED]
    engine = Engine.load(folder, max_context=300)
    engine.logits(random_ids(13, 30, engine.config.vocab_size))
    prefills = {four for step, four in seen if not step}
    assert prefills == {four_bit}, seen


def test_experts_read_per_step(ckpts):
    engine = Engine.load(ckpts[STACKED], max_context=300)
    c = engine.config
    ids = random_ids(12, 3, c.vocab_size)
    engine.logits(ids)          # a forward apart from the conversation leaves the step's counters bound
    engine.mtp = False
    off = [e for e in engine.generate(ids, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=()))]
    assert all(e.experts_read == c.num_hidden_layers * c.num_experts_per_tok for e in off[2:-1])   # one row: k each
    assert off[-1].stats.experts_per_layer["decode"] == c.num_experts_per_tok
    engine.mtp, engine.draft_tokens = True, 3
    done = [e for e in engine.generate(ids, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=()))][-1]
    per = done.stats.experts_per_layer
    assert c.num_experts_per_tok < per["verify"] <= c.num_experts        # 4 rows share some experts
    assert c.num_experts_per_tok <= per["draft"]
    assert done.stats.as_dict()["experts_per_layer"] == per


def stale_rows_apart_and_routed_as_the_last(ckpt, monkeypatch, profile, tokens: int, seed: int) -> dict:
    """Greedy generations with MTP on (4 drafts) whose drafts come from a ProfileDrafter of `profile`
    that records what the head drafted: {apart: (stats, the head's drafts)}, the head's stale rows
    routed apart (stale_rows undone) or as the last live row; each output checked against MTP off."""
    from mtpchat.engine.spec import ProfileDrafter
    from mtpchat.kernels import moe

    class Recorder(ProfileDrafter):
        def __call__(self, position, drafts):
            heads.append(drafts.clone())
            return super().__call__(position, drafts)
    engine = Engine.load(ckpt, max_context=300)
    ids = random_ids(12, seed, engine.config.vocab_size)
    engine.mtp = False
    greedy = SamplingParams(temperature=0, max_tokens=tokens, stop_token_ids=())
    ref = list(list(engine.generate(ids, greedy))[-1].token_ids)
    out = {}
    for apart in (True, False):
        if apart:
            monkeypatch.setattr(moe_routing, "stale_rows", lambda logits, rows: logits)
        else:
            monkeypatch.undo()
        heads = []
        engine.reset()
        engine.mtp, engine.draft_tokens = True, 4
        engine.drafter = Recorder(ref, profile, seed=1, vocab=engine.config.vocab_size)
        done = list(engine.generate(ids, greedy))[-1]
        engine.drafter = None
        assert list(done.token_ids) == ref, apart
        out[apart] = done.stats, torch.cat(heads)
    return out


def test_the_heads_stale_rows_read_no_experts(ckpts, monkeypatch):
    # a drafter that is always wrong leaves one live row of the head's 5-row catch-up: the other 4
    # route as it does, so a step's head reads the experts of 1 + 3 chained rows, not of up to
    # 5 + 3 (the tiny MoE: 6 experts, top 3); routed experts only (the shared one is read every step)
    runs = stale_rows_apart_and_routed_as_the_last(ckpts[STACKED], monkeypatch, (0.0,) * 4, 24, seed=5)
    apart, last = (runs[a][0].experts_per_layer["draft"] for a in (True, False))
    k = Engine.load(ckpts[STACKED], max_context=64).config.num_experts_per_tok
    assert last <= 4 * k and last < apart, (last, apart)


def test_the_heads_drafts_are_the_same_with_its_stale_rows_routed_as_the_last_live_one(ckpts, monkeypatch):
    # what the head drafts does not change, under acceptance that leaves 1 to 5 rows live
    runs = stale_rows_apart_and_routed_as_the_last(ckpts[STACKED], monkeypatch, (0.9, 0.75, 0.6, 0.45), 40, seed=6)
    assert runs[True][1].numel() > 20 and torch.equal(runs[True][1], runs[False][1])


def test_fp8_experts_equal_transformers_on_the_dequantized_weights(tmp_path):
    aligned = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                   moe_intermediate_size=128, shared_expert_intermediate_size=128)
    fp8 = write_tiny_checkpoint(tmp_path / "fp8", moe=True, experts=PER_EXPERT, fp8=True, **aligned)
    twin = write_dequantized_twin(fp8, tmp_path / "twin")
    engine = Engine.load(fp8, max_context=512, prefill_chunk=48, weights="fp8")
    stored = {n for n, p in engine.model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert "layers.0.mlp.experts_gate_up" in stored and "layers.0.mlp.shared.down" in stored
    assert "layers.0.mlp.router" not in stored
    assert engine.memory()["weights"] == memory.weight_bytes(engine.config, "float32", fp8=True)
    assert max_error(twin, engine) < 1e-4
    # experts quantized on load, one tensor at a time: as quantizing the whole stacked weight offline
    on_load = dict(Engine.load(twin, max_context=64, weights="fp8").model.named_parameters())
    plain = dict(Engine.load(twin, max_context=64).model.named_parameters())
    for name in ("layers.1.mlp.experts_gate_up", "layers.1.mlp.experts_down"):
        offline = quantize_ref(plain[name])
        assert torch.equal(on_load[name].view(torch.uint8), offline.w.view(torch.uint8)), name
        assert torch.equal(on_load[name + "_scale"], offline.scale), name


@pytest.mark.parametrize("layout", [STACKED, PER_EXPERT])
def test_memory_plan_is_byte_exact(ckpts, layout):
    engine = Engine.load(ckpts[layout], max_context=128)
    assert engine.memory()["weights"] == memory.weight_bytes(engine.config, "float32")
    assert memory.text_params(engine.config) + memory.mtp_params(engine.config) == sum(
        p.numel() for m in (engine.model, engine.head) for p in m.parameters())


def test_35b_a3b_config_and_plan():
    from mtpchat.engine import bench
    from pathlib import Path
    c = ModelConfig.load(Path(bench.__file__).parent / "configs" / "qwen3.5-35b-a3b.json")
    assert c.is_moe and (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 512)
    total = memory.text_params(c)
    assert 34e9 < total + memory.mtp_params(c) < 36.5e9               # "35B"
    active = total - c.num_hidden_layers * (memory.mlp_params(c) - memory.active_mlp_params(c))
    assert 2.5e9 < active - c.vocab_size * c.hidden_size < 3.5e9     # "A3B": active, less the embedding


def test_moe_config_errors():
    raw = {"model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
           "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert ModelConfig.from_dict(raw).is_moe
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict(raw | {"num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        ModelConfig.from_dict(raw | {"moe_intermediate_size": 0})
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_experts"} | {"model_type": "qwen3_5_text"})
