"""The Qwen3.5 / Qwen3.6 hybrid decoder: Gated DeltaNet and gated full-attention layers, each with a
SwiGLU MLP, then a final RMSNorm and the lm_head. Facts and formulas: qwen35-model.md.

Every forward works on one sequence of T new tokens over preallocated state (engine/state.py):
- prefill (`ctx.step` False): GDN in chunked form, attention through SDPA;
- decode / verify (`ctx.step` True, T = 1..k_max+1): the GDN recurrence (the last step's accepted
  tokens folded into the state first: one state written a step, whatever T), attention row by row,
  and every product row by row, so a row's result does not depend on T (greedy MTP on == MTP off).
Projections are stored fused (weights.py fills them): GDN [qkv | z | b | a], attention
[q+gate | k | v], MLP [gate | up]. The MoE models' MLP is a SparseMoE (kernels/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtpchat.engine.config import ModelConfig
from mtpchat.kernels import attention, conv, fp8_gemm, gdn, gdn_chunk, moe, moe_router, norm
from mtpchat.kernels._triton import use_triton
from mtpchat.kernels.fp8 import BlockFP8, dequantize_ref, values_of
from mtpchat.kernels.matvec import Normed, matvec, matvec_swiglu, silu_mul
from mtpchat.kernels.matvec_parts import matvec_parts, matvec_parts_triton
from mtpchat.kernels.rope import qkv_norm_rope


PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Ctx:
    """What a forward needs besides the tokens and the per-layer caches."""
    positions: torch.Tensor   # [T] long: the tokens' positions, or [1]: the first of T consecutive ones
    start: int | torch.Tensor # positions[0]: tokens already in the KV cache (a [1] tensor in steps)
    step: bool                # decode/verify (the recurrence, one state written a step) rather than prefill
    conv_off: torch.Tensor    # [1] long: committed conv window offset
    fold: torch.Tensor        # [1] long: the last step's accepted tokens, to fold into the GDN states
    parity: torch.Tensor      # [1] long: which half of the GDN pend buffers holds them
    live: torch.Tensor | None = None   # [1] long, steps: 0 once the generation has ended (write no state)
    rows: torch.Tensor | None = None   # [1] long: the rows that count (the MTP head's catch-up); the
                                       # rest are stale, and an MoE routes them as the last that counts


def weight(m: nn.Module, name: str):
    """A product's weight: the parameter, or with its block scales (`<name>_scale`, an FP8 model:
    engine/weights.py) a BlockFP8."""
    scale = getattr(m, name + "_scale", None)
    return getattr(m, name) if scale is None else BlockFP8(getattr(m, name), scale)


def linear(x: torch.Tensor, w, rowwise: bool) -> torch.Tensor:
    """x [T, K] @ w[N, K]ᵀ, w a tensor or a BlockFP8. With `rowwise` (decode, verify, draft) each
    row's result is that of a 1-row call: the batch-invariant matvec kernel on the GPU (which also
    takes a Normed x, see add_norm, and FP8 weights, scaled in registers), one product per row on
    the CPU. A prefill over FP8 weights on the GPU runs on the FP8 tensor cores (fp8_gemm.py); on
    the CPU it is the product of the dequantized weight."""
    if isinstance(x, Normed) or (rowwise and x.is_cuda):
        return matvec(x, w)
    if isinstance(w, BlockFP8):
        if not rowwise and use_triton(x, w.w):
            return fp8_gemm.gemm(x, w)
        w = dequantize_ref(w, x.dtype)
    if not rowwise:
        return F.linear(x, w)
    return torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])]) if x.shape[0] > 1 else F.linear(x, w)


class Product(NamedTuple):
    """A block's last product (o_proj, out_proj, MLP down) not yet run: in a step on the GPU the
    residual add and the norm after the block run it (add_norm)."""
    x: torch.Tensor
    w: torch.Tensor


SPLIT_NORM = True      # off: add_norm gives whole normalised rows (tests/kernels/ab_step.py --plans split)
SHARED_AS_EXPERT = True   # off: an MoE's shared expert runs as its own two products
# On: a step's router product and routing in one kernel on the GPU (kernels/moe_router.py), in place
# of a 5-program product and the routing kernel. Off until measured (tests/kernels/ab_step.py --plans router).
ROUTER_FUSED = False


def out_linear(x: torch.Tensor, w: torch.Tensor, rowwise: bool):
    """A block's last product, which only the residual add and the norm after it read: left for
    add_norm in a step on the GPU, `linear` otherwise."""
    if rowwise and use_triton(x, values_of(w)):
        return Product(x, w)
    return linear(x, w, rowwise)


def add_norm(x, residual: torch.Tensor | None, norm_: "RMSNorm", whole: bool = False, out: torch.Tensor | None = None):
    """(norm_(x + residual), x + residual) after a block whose output x is a tensor or a Product
    (a Product may come with no residual: the MTP head's fc, the first thing its layer reads).
    A Product runs split over K (its 5120 columns in 80 blocks would leave SMs idle): each column
    block's last program adds the parts and the residual, and the normalised rows come as a Normed
    for the next product to finish (kernels/matvec_parts.py); with `whole` (the final norm, whose
    rows the lm_head and the MTP head both read) or SPLIT_NORM off, as whole rows from the norm
    kernel, which adds the parts. `out` (whole rows only) receives the normalised rows."""
    if isinstance(x, Product):
        if SPLIT_NORM and not whole:
            assert out is None, "add_norm: the split norm gives a Normed, never whole rows into `out`"
            return matvec_parts_triton(x.x, x.w, norm=(residual, norm_.weight, norm_.eps))
        if residual is None:          # nothing to add (the MTP head's fc): the product, then the norm
            assert out is None, "add_norm: no `out` without a residual"
            x = linear(x.x, x.w, True)
            return norm.rmsnorm(x, norm_.weight, norm_.eps), x
        x = matvec_parts(x.x, x.w)
    return norm.add_rmsnorm(x, residual, norm_.weight, norm_.eps, out=out)


def prefill_attention(q, keys, values, first: bool, scale: float) -> torch.Tensor:
    """Causal attention of T new queries q [1, Hq, T, D], the last T of the n rows in keys and values
    [1, Hkv, n, D] (GQA: Hq a multiple of Hkv). `first`: the keys are these T tokens alone."""
    if first:
        # flash or memory-efficient only: cuDNN would build a new plan for every key length
        with sdpa_kernel(PREFILL_SDPA):
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # flash attention aligns its causal mask to the bottom right, as later chunks need (query t sees
        # keys up to n - T + t), and takes the kv heads as they are
        return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True, False, scale=scale)[0]
    n, T = keys.shape[2], q.shape[2]
    mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - T, n, device=q.device)[:, None]
    group = q.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                                          attn_mask=mask, scale=scale)


def empty(*shape) -> nn.Parameter:
    # Built on the meta device; weights.py assigns the real tensors in place.
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = empty(dim), eps

    def forward(self, x):
        return norm.rmsnorm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or c.intermediate_size
        self.gate_up = empty(2 * width, c.hidden_size)
        self.down = empty(c.hidden_size, width)

    def forward(self, x, ctx: Ctx, whole: bool = False):
        """The MLP's output, or in a step on the GPU a Product for add_norm to finish (`whole`: a tensor)."""
        if ctx.step and x.is_cuda:
            h = matvec_swiglu(x, weight(self, "gate_up"))     # the product and the gating in one kernel
        else:
            h = silu_mul(linear(x, weight(self, "gate_up"), ctx.step))
        return (linear if whole else out_linear)(h, weight(self, "down"), ctx.step)


class SparseMoE(nn.Module):
    """The MoE models' MLP: a router picks k of E experts per token (softmax, top k, renormalised),
    their SwiGLU outputs are summed with those weights, plus a shared expert scaled by
    sigmoid(its gate). The router's weight carries the shared gate as row E, so one product gives
    both. Kernels: kernels/moe.py; `reads` (an int64 [1] the engine gives) counts the distinct
    experts each step's layers read."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        E, Fm, Fs, H = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size, c.hidden_size
        self.router = empty(E + (1 if Fs else 0), H)
        self.experts_gate_up = empty(E * 2 * Fm, H)       # per expert: gate rows, then up rows
        self.experts_down = empty(E * H, Fm)
        self.shared = MLP(c, Fs) if Fs else None
        self.reads: torch.Tensor | None = None

    def forward(self, x, ctx: Ctx):
        E, k = self.c.num_experts, self.c.num_experts_per_tok
        gate_up, down = weight(self, "experts_gate_up"), weight(self, "experts_down")
        fused = ROUTER_FUSED and ctx.step and use_triton(x, self.router)
        logits = None if fused else linear(x, self.router, ctx.step)
        route = lambda shared: (moe_router.route_fused(x, self.router, k, E, shared, rows=ctx.rows) if fused
                                else moe.route(logits, k, E, ctx.step, shared=shared, rows=ctx.rows))
        reads = self.reads if ctx.step else None
        if self._shared_as_expert(gate_up):
            # the shared expert as every row's last choice, expert E: two launches fewer a layer
            sgu, sd = weight(self.shared, "gate_up"), weight(self.shared, "down")
            _, weights, _, layout = route(True)
            h = moe.expert_swiglu(x, gate_up, layout, k + 1, E, ctx.step, reads, shared=sgu)
            return moe.combine(moe.expert_down(h, down, layout, E, ctx.step, shared=sd), weights, dtype=x.dtype)
        _, weights, gate, layout = route(False)
        h = moe.expert_swiglu(x, gate_up, layout, k, E, ctx.step, reads)
        y = moe.expert_down(h, down, layout, E, ctx.step)
        shared = self.shared(x, ctx, whole=True) if self.shared is not None else None
        return moe.combine(y, weights, shared, gate, x.dtype)

    def _shared_as_expert(self, gate_up) -> bool:
        """Whether the expert kernels take the shared expert too: as wide as a routed one and
        stored alike (both FP8 or neither)."""
        s = self.shared
        return (s is not None and SHARED_AS_EXPERT and s.down.shape[1] == self.c.moe_intermediate_size
                and isinstance(weight(s, "gate_up"), BlockFP8) == isinstance(gate_up, BlockFP8))


class GatedAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.qkv = empty(2 * c.q_dim + 2 * c.kv_dim, c.hidden_size)   # [q|gate per head] | k | v
        self.o_proj = empty(c.hidden_size, c.q_dim)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)
        self._freqs: torch.Tensor | None = None

    def inv_freq(self, device) -> torch.Tensor:
        """RoPE's [rotary_dim/2] float32 frequencies theta^(-2i/R), made once on the model's device."""
        if self._freqs is None or self._freqs.device != device:
            R = self.c.rotary_dim
            self._freqs = self.c.rope_theta ** (-torch.arange(0, R, 2, dtype=torch.float32, device=device) / R)
        return self._freqs

    def forward(self, x, cache: tuple[torch.Tensor, torch.Tensor], ctx: Ctx):
        c, T = self.c, x.shape[0]
        qg, k, v = linear(x, weight(self, "qkv"), ctx.step).split([2 * c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        qg = qg.view(T, c.num_attention_heads, 2 * c.head_dim)           # per head: [query | gate]
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:]
        k_cache, v_cache = cache
        # q normalised and rotated; k likewise and v as it is, straight into the cache rows
        q = qkv_norm_rope(q, k.view(T, -1, c.head_dim), v.view(T, -1, c.head_dim), self.q_norm.weight,
                          self.k_norm.weight, ctx.positions, self.inv_freq(x.device), c.rms_norm_eps, k_cache, v_cache)
        scale = c.head_dim ** -0.5
        if ctx.step:
            o = attention.decode_attention(q, k_cache, v_cache, ctx.start, scale, gate)   # the gate fused in
        else:
            n = ctx.start + T
            # [1, H, T, D]: the fused SDPA kernels take 4-D inputs only (3-D falls back to the math path)
            q4, keys, values = (t.transpose(0, 1)[None] for t in (q, k_cache[:n], v_cache[:n]))
            o = prefill_attention(q4, keys, values, ctx.start == 0, scale)[0].transpose(0, 1)
            o = o * torch.sigmoid(gate)
        return out_linear(o.reshape(T, c.q_dim), weight(self, "o_proj"), ctx.step)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: ModelConfig, split_ba: bool = False):
        super().__init__()
        self.c = c
        hv = c.linear_num_value_heads
        # qkv | z | b | a; an FP8 model keeps the bf16 [b | a] apart (engine/weights.py)
        self.in_proj = empty(c.conv_dim + c.value_dim + (0 if split_ba else 2 * hv), c.hidden_size)
        self.in_proj_ba = empty(2 * hv, c.hidden_size) if split_ba else None
        self.conv_weight = empty(c.conv_dim, c.linear_conv_kernel_dim)
        self.A_log, self.dt_bias = empty(hv), empty(hv)
        self.norm_weight = empty(c.linear_value_head_dim)
        self.out_proj = empty(c.hidden_size, c.value_dim)

    def forward(self, x, cache: tuple[torch.Tensor, torch.Tensor], ctx: Ctx):
        c, T = self.c, x.shape[0]
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        conv_buf, state, pend = cache
        if self.in_proj_ba is None:
            mixed, z, b, a = linear(x, self.in_proj, ctx.step).split([c.conv_dim, c.value_dim, hv, hv], dim=-1)
        else:
            mixed, z = linear(x, weight(self, "in_proj"), ctx.step).split([c.conv_dim, c.value_dim], dim=-1)
            b, a = linear(x, self.in_proj_ba, ctx.step).split([hv, hv], dim=-1)
        mixed = conv.conv_update(mixed, conv_buf, ctx.conv_off, self.conv_weight, ctx.live)   # pre-conv in, silu out
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q, k, v = q.view(T, -1, dk), k.view(T, -1, dk), v.view(T, hv, dv)
        if ctx.step:
            o = gdn.recurrent(q, k, v, a, b, self.A_log, self.dt_bias, state, pend, ctx.fold, ctx.parity, ctx.live)
        else:
            # the last step's accepted tokens first (the decoder zeroes ctx.fold after the first
            # chunk; decode state, no gradient); the chunked form starts from a copy, which a
            # training forward may still need
            with torch.no_grad():
                gdn.fold_pending(state, pend, ctx.fold, ctx.parity, self.A_log, self.dt_bias)
            o, end_state = gdn_chunk.chunk(q, k, v, a, b, self.A_log, self.dt_bias, state.clone())
            state.copy_(end_state)
        o = norm.gated_rmsnorm(o.to(x.dtype), z.view(T, hv, dv), self.norm_weight, c.rms_norm_eps)
        return out_linear(o.reshape(T, c.value_dim), weight(self, "out_proj"), ctx.step)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, split_ba: bool = False):
        super().__init__()
        self.kind, self.kind_moe = kind, c.is_moe
        self.mixer = GatedAttention(c) if kind == "full_attention" else GatedDeltaNet(c, split_ba)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c) if c.is_moe else MLP(c)

    def forward(self, x, residual, cache, ctx: Ctx):
        """Pre-norm block, with each residual add fused into the norm after it: takes the previous
        block's (output, residual stream) unsummed (residual None for the first block) and returns
        its own. The block's value is output + residual (in a step on the GPU the output comes as a
        Product still to run, and the normalised rows as a Normed: see add_norm)."""
        if residual is None and not isinstance(x, Product):
            normed, h = self.input_norm(x), x
        else:          # (a Product without a residual: the MTP head's fc, still to run)
            normed, h = add_norm(x, residual, self.input_norm)
        # the MoE's router and experts read whole rows, never a Normed
        normed, h = add_norm(self.mixer(normed, cache, ctx), h, self.post_norm, whole=self.kind_moe)
        return self.mlp(normed, ctx), h


class Model(nn.Module):
    """The target model. `forward` returns the post-final-norm hidden states (what lm_head and the
    MTP head read); `logits` applies the head."""

    def __init__(self, c: ModelConfig, fp8: bool = False):
        super().__init__()
        self.c = c
        self.embed = empty(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, kind, split_ba=fp8) for kind in c.layer_types)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = empty(c.vocab_size, c.hidden_size)

    @property
    def head(self) -> torch.Tensor:
        return self.embed if self.c.tie_word_embeddings else self.lm_head

    def forward(self, ids: torch.Tensor, caches: list, ctx: Ctx, out: torch.Tensor | None = None) -> torch.Tensor:
        """The post-final-norm hidden states [T, H], written into `out` when given."""
        x, residual = F.embedding(ids, self.embed), None                  # [T, H]
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, cache, ctx)
        return add_norm(x, residual, self.norm, whole=True, out=out)[0]

    def logits(self, hidden: torch.Tensor, rowwise: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, vocab] float32, written into `out` when given (a step's buffer: on CUDA the product
        writes it, with no cast and no copy after it)."""
        if out is not None and rowwise and hidden.is_cuda:
            return matvec(hidden, self.head, out=out)
        y = linear(hidden, self.head, rowwise).float()
        return y if out is None else out.copy_(y)
