"""The MTP draft head against a from-scratch float64 implementation of its formula, read straight
from the safetensors files, over every call the engine makes during a generation."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from mtpchat.engine import SamplingParams
from helpers import random_ids, rel_err
from mtp_support import generate, load, profile_drafter


# --- 4. the draft head against a from-scratch implementation of its formula ----------------------
class ReferenceHead:
    """qwen35-model.md §6 written out in float64 from the checkpoint's own tensors: row p takes
    token x_{p+1} and the target's post-norm hidden h_p, at rotary position p."""

    def __init__(self, path):
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        self.w = {}
        for name, shard in index.items():
            if name.startswith(("mtp.", "lm_head.", "model.language_model.embed_tokens.")):
                with safe_open(str(path / shard), framework="pt") as f:
                    self.w[name] = f.get_tensor(name).double()
        self.embed = self.w["model.language_model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)
        t = json.loads((path / "config.json").read_text())["text_config"]
        self.heads, self.kv_heads, self.D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        self.rot = int(self.D * t["rope_parameters"]["partial_rotary_factor"])
        self.theta, self.eps = t["rope_parameters"]["rope_theta"], t["rms_norm_eps"]

    def norm(self, x, name):   # Qwen3.5 RMSNorm: the weight is stored zero-centred
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * (1 + self.w[name])

    def rope(self, x, pos):    # NeoX rotation of the first `rot` dims of every head
        freq = self.theta ** (-torch.arange(0, self.rot, 2, dtype=torch.float64) / self.rot)
        ang = pos.double()[:, None, None] * torch.cat([freq, freq])
        r, rest = x[..., :self.rot], x[..., self.rot:]
        half = self.rot // 2
        turned = torch.cat([-r[..., half:], r[..., :half]], -1)
        return torch.cat([r * ang.cos() + turned * ang.sin(), rest], -1)

    def __call__(self, tokens, hidden, pos, past=None):
        """Rows at positions `pos` attending to `past` (K, V of earlier rows) and causally to each
        other -> (out [T, H], logits [T, V], (K, V) including these rows)."""
        w, T, D, L = self.w, len(tokens), self.D, "mtp.layers.0."
        e = self.norm(self.embed[tokens], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden.double(), "mtp.pre_fc_norm_hidden.weight")
        x = torch.cat([e, h], -1) @ w["mtp.fc.weight"].T                 # order: [embedding, hidden]
        a = self.norm(x, L + "input_layernorm.weight")
        qg = (a @ w[L + "self_attn.q_proj.weight"].T).view(T, self.heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)               # per head: [query | gate]
        q = self.rope(self.norm(q, L + "self_attn.q_norm.weight"), pos)
        k = self.rope(self.norm((a @ w[L + "self_attn.k_proj.weight"].T).view(T, self.kv_heads, D),
                                L + "self_attn.k_norm.weight"), pos)
        v = (a @ w[L + "self_attn.v_proj.weight"].T).view(T, self.kv_heads, D)
        if past is not None:
            k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
        n = k.shape[0]
        group = self.heads // self.kv_heads
        scores = torch.einsum("thd,nhd->htn", q, k.repeat_interleave(group, 1)) / D ** 0.5
        causal = torch.arange(n)[None, :] <= torch.arange(n - T, n)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("htn,nhd->thd", probs, v.repeat_interleave(group, 1)).reshape(T, -1)
        x = x + (o * gate.sigmoid()) @ w[L + "self_attn.o_proj.weight"].T
        m = self.norm(x, L + "post_attention_layernorm.weight")
        mlp = F.silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[L + "mlp.down_proj.weight"].T
        out = self.norm(x, "mtp.norm.weight")
        return out, out @ self.lm_head.T, (k, v)


def target_hiddens(e, ids):
    """The target's post-final-norm hidden of every position, from a fresh full forward."""
    hidden = []
    hook = e.model.register_forward_hook(lambda m, args, out: hidden.append(out.clone()))
    try:
        e.logits(ids)
    finally:
        hook.remove()
    return torch.cat(hidden)


@pytest.mark.parametrize("ckpt", ["gqa3", "tied"])
def test_head_matches_the_formula_through_a_generation(request, ckpt):
    """Every row the head computes during a generation with rejections, MTP switched off and on
    and k changing (prefill rows, catch-up rows and chained drafts) matches the reference over the
    true sequence: the head's KV is complete and right after every rollback."""
    path = request.getfixturevalue(ckpt)
    e = load(path, mtp=False)
    prompt = random_ids(60, 5, e.config.vocab_size)
    ref = list(generate(e, prompt, SamplingParams(max_tokens=50, stop_token_ids=()))[-1].token_ids)
    e = load(path, draft_tokens=3)
    e.drafter = profile_drafter(ref, 3, e)
    calls = []

    def positions(ids, ctx):          # a step passes the first of its consecutive positions alone
        pos = ctx.positions
        return pos + torch.arange(len(ids), device=pos.device) if pos.numel() == 1 else pos.clone()

    e.head.register_forward_hook(lambda m, args, out: calls.append(
        (args[1].clone(), args[2].clone(), positions(args[1], args[4]), e.state.length, out.clone())))
    plan = iter([(True, 3)] * 3 + [(False, 3)] * 8 + [(True, 4), (True, 1), (True, 2), (False, 2), (True, 4)] * 9)

    def switch(steps):
        e.mtp, e.draft_tokens = next(plan)

    out = generate(e, prompt, SamplingParams(max_tokens=50, stop_token_ids=()), after_step=switch)[-1].token_ids
    assert list(out) == ref
    seq = prompt + ref                                   # x_0..x_L; the last one was never fed
    L = len(seq) - 1
    head, hiddens = ReferenceHead(path), target_hiddens(e, seq[:L])
    true_out, true_logits, (K, V) = head(torch.tensor(seq[1:]), hiddens, torch.arange(L))
    checked, chained = set(), 0
    chain = None      # (reference output of the previous row, K/V up to it) for the next chained draft
    for ids, hidden, pos, fed, got in calls:
        logits = e.decoder.logits(got, rowwise=False)
        if len(ids) == 1 and int(pos[0]) >= fed:         # a chained draft: the head's own output as hidden
            ref_out, ref_logits, kv = head(ids, chain[0], pos, chain[1])
            assert rel_err(logits, ref_logits) < 1e-4
            chain, chained = (ref_out, kv), chained + 1
            continue
        valid = pos < fed                                # draft catch-up rows past the last fed token are scratch
        assert valid.any()
        assert torch.equal(ids[valid], torch.tensor(seq)[pos[valid] + 1])     # row p pairs x_{p+1} with h_p
        assert rel_err(hidden[valid], hiddens[pos[valid]].double()) < 1e-4
        assert rel_err(logits[valid], true_logits[pos[valid]]) < 1e-4
        checked |= set(pos[valid].tolist())
        last = int(pos[valid][-1])
        chain = (true_out[last:last + 1], (K[:last + 1], V[:last + 1]))
    assert checked == set(range(len(checked))) and len(checked) > L - 8 and chained > 10
