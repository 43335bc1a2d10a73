"""The demo trainer's batched forward: the engine's own modules and parameters, with the batch
folded into the GDN heads and conv channels so that one call of each float32 reference kernel serves
the whole batch (the engine's forward takes one sequence). `engine_forward` is the same contract
through the engine's Model / MTPHead and a DecodeState; train_demo.py checks the two agree,
outputs and gradients, before training.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpchat.engine.dispatch import Ctx
from mtpchat.engine.model import GatedAttention, GatedDeltaNet, Model
from mtpchat.engine.mtp import MTPHead
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.state import DecodeState
from mtpchat.kernels import conv, gdn_chunk, norm
from mtpchat.kernels.rope import norm_rope_ref


def _rms(x, mod):
    return norm.rmsnorm_ref(x, mod.weight, mod.eps)


def _attention(m: GatedAttention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    c, (B, T, _) = m.c, x.shape
    qg, k, v = F.linear(x, m.qkv).split([2 * c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    qg = qg.view(B, T, c.num_attention_heads, 2 * c.head_dim)              # per head: [query | gate]
    q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(B, T, c.q_dim)
    freqs, eps = m.inv_freq(x.device), c.rms_norm_eps                     # positions [T] broadcast over B
    q = norm_rope_ref(q, m.q_norm.weight, positions, freqs, eps)           # [B, T, Hq, D]
    k = norm_rope_ref(k.view(B, T, -1, c.head_dim), m.k_norm.weight, positions, freqs, eps)
    v = v.view(B, T, -1, c.head_dim)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=c.head_dim ** -0.5, enable_gqa=True)
    o = o.transpose(1, 2).reshape(B, T, c.q_dim) * torch.sigmoid(gate)
    return F.linear(o, m.o_proj)


def _gdn(m: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    # The batch is folded into the conv channels and the GDN heads: sequence b's head h becomes head
    # b*H + h, so value head b*Hv + j still reads key head (b*Hv + j) // (Hv/Hk) = b*Hk + j // (Hv/Hk).
    c, (B, T, _) = m.c, x.shape
    hv, dk, dv, K = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    mixed, z, b, a = F.linear(x, m.in_proj).split([c.conv_dim, c.value_dim, hv, hv], dim=-1)
    window = x.new_zeros(B * c.conv_dim, K - 1)
    off = torch.zeros(1, dtype=torch.long, device=x.device)
    mixed = conv.conv_update_ref(mixed.transpose(0, 1).reshape(T, B * c.conv_dim), window, off,
                                 m.conv_weight.repeat(B, 1))                # [T, B*conv_dim]
    q, k, v = mixed.view(T, B, c.conv_dim).split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
    fold = lambda t, d: t.reshape(T, -1, d)                                 # [T, B*heads, d]
    heads = lambda t: t.transpose(0, 1).reshape(T, B * hv)                  # [B, T, hv] -> [T, B*hv]
    state = x.new_zeros(B * hv, dk, dv, dtype=torch.float32)
    o, _ = gdn_chunk.chunk_ref(fold(q, dk), fold(k, dk), fold(v, dv), heads(a), heads(b),
                         m.A_log.repeat(B), m.dt_bias.repeat(B), state)     # [T, B*hv, dv]
    o = o.view(T, B, hv, dv).transpose(0, 1)
    o = norm.gated_rmsnorm_ref(o.to(x.dtype), z.view(B, T, hv, dv), m.norm_weight, c.rms_norm_eps)
    return F.linear(o.reshape(B, T, c.value_dim), m.out_proj)


def _layer(layer, x, positions):
    mixer = layer.mixer
    y = _rms(x, layer.input_norm)
    h = x + (_attention(mixer, y, positions) if layer.kind == "full_attention" else _gdn(mixer, y))
    gate, up = F.linear(_rms(h, layer.post_norm), layer.mlp.gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, layer.mlp.down)


def _head(head: MTPHead, embed, ids, hidden):
    positions = torch.arange(ids.shape[1], device=ids.device)
    e = _rms(F.embedding(ids, embed), head.pre_fc_norm_embedding)
    u = F.linear(torch.cat([e, _rms(hidden, head.pre_fc_norm_hidden)], dim=-1), head.fc)
    return _rms(_layer(head.layer, u, positions), head.norm)


def batched(model: Model, head: MTPHead, ids: torch.Tensor):
    """ids [B, T+2] -> (h [B, T, H], out1 [B, T, H], out2 [B, T-1, H]), all post-norm:
    h_p from x_0..x_p; out1_p from (x_{p+1}, h_p), predicting x_{p+2}; out2 the chained pass,
    row p from (x_{p+2}, out1_p), predicting x_{p+3}."""
    T = ids.shape[1] - 2
    x = F.embedding(ids[:, :T], model.embed)
    positions = torch.arange(T, device=ids.device)
    for layer in model.layers:
        x = _layer(layer, x, positions)
    h = _rms(x, model.norm)
    out1 = _head(head, model.embed, ids[:, 1:T + 1], h)
    out2 = _head(head, model.embed, ids[:, 2:T + 1], out1[:, :-1])
    return h, out1, out2


def engine_forward(model: Model, head: MTPHead, ids: torch.Tensor):
    """`batched`'s contract for one sequence [T+2], through the engine's own forward and caches."""
    c, T = model.c, ids.shape[0] - 2
    state = DecodeState(c, T, 1, ids.device, torch.float32, mtp=True)
    plan = KernelPlan.choose(ids.device, c, fp8=False)
    ctx = lambda n: Ctx(torch.arange(n, device=ids.device), 0, False, state.conv_off, state.fold, state.parity, plan)
    h = model(ids[:T], state.layers, ctx(T))
    out1 = head(model.embed, ids[1:T + 1], h, state.mtp, ctx(T))
    # the chained pass, with a KV cache of its own; attention is relative, so positions from 0 do
    chained_kv = tuple(torch.zeros_like(t) for t in state.mtp)
    out2 = head(model.embed, ids[2:T + 1], out1[:-1], chained_kv, ctx(T - 1))
    return h, out1, out2
