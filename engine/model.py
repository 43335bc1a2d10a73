"""The Qwen3.5 / Qwen3.6 hybrid decoder: Gated DeltaNet and gated full-attention layers, each with a
SwiGLU MLP, then a final RMSNorm and the lm_head. Facts and formulas: qwen35-model.md.

Every forward works on one sequence of T new tokens over preallocated state (engine/state.py), and
asks its context (engine/dispatch.py: Ctx) for every product, which runs in the form the engine's
kernel plan chose (engine/plan.py):
- prefill (`ctx.step` False): GDN in chunked form, attention through SDPA;
- decode / verify (`ctx.step` True, T = 1..k_max+1): the GDN recurrence (the last step's accepted
  tokens folded into the state first: one state written a step, whatever T), attention row by row,
  and every product row by row, so a row's result does not depend on T (greedy MTP on == MTP off).
Projections are stored fused (weights.py fills them): GDN [qkv | z | b | a], attention
[q+gate | k | v], MLP [gate | up]. The MoE models' MLP is a SparseMoE (kernels/moe.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.dispatch import Ctx, Experts, Product, linear, weight
from mtpchat.kernels import attention, attention_chunk, conv, fp8_gemm, gdn, gdn_chunk, moe, moe_routing, norm
from mtpchat.kernels._triton import use_triton
from mtpchat.kernels.forms import values_of
from mtpchat.kernels.fp8 import BLOCK, BlockFP8
from mtpchat.kernels.int4 import GroupInt4
from mtpchat.kernels.matvec import matvec, matvec_swiglu, silu_mul
from mtpchat.kernels.plan import ProductPlan
from mtpchat.kernels.rope import qkv_norm_rope


PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    # a [T, n] mask (bool here, float32 inside SDPA: 1 GiB at T 2,048 and n 131,072; the CPU's chunks
    # are 512 rows)
    n, T = keys.shape[2], q.shape[2]
    mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - T, n, device=q.device)[:, None]
    if not q.is_cuda:
        # the CPU's flash kernel takes the kv heads as they are: no copy of K and V per query head
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    # float32 on a GPU: K and V copied per query head, as before (not measured with enable_gqa there,
    # where a kernel that takes no GQA would send SDPA to the math path and its [Hq, T, n] scores)
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
        down = weight(self, "down")
        if ctx.step and x.is_cuda:
            h = matvec_swiglu(x, weight(self, "gate_up"), ctx.products)   # the product and the gating in one kernel
        else:
            gate_up = ctx.linear(x, weight(self, "gate_up"))
            # prefill: the gated rows straight to FP8 where the down product takes them so
            h = fp8_gemm.quantized_swiglu(gate_up) if ctx.quantized_rows_for(down, gate_up) else silu_mul(gate_up)
        return (ctx.linear if whole else ctx.out_linear)(h, down)


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
        logits = ctx.linear(x, self.router)
        reads = self.reads if ctx.step else None
        four_bit = isinstance(gate_up, GroupInt4) or isinstance(down, GroupInt4)     # a prefill's blocks follow it
        if self._shared_as_expert(gate_up, x, ctx):
            # the shared expert as every row's last choice, expert E: two launches fewer a layer
            sgu, sd = weight(self.shared, "gate_up"), weight(self.shared, "down")
            _, weights, _, layout = moe_routing.route(logits, k, E, ctx.step, shared=True, rows=ctx.rows,
                                                      plan=ctx.products, four_bit=four_bit)
            h = moe.expert_swiglu(x, gate_up, layout, k + 1, E, ctx.step, reads, shared=sgu, plan=ctx.products)
            return self._finish(Experts(h, down, layout, E, sd, weights, None, None), x, ctx)
        _, weights, gate, layout = moe_routing.route(logits, k, E, ctx.step, rows=ctx.rows, plan=ctx.products,
                                                     four_bit=four_bit)
        h = moe.expert_swiglu(x, gate_up, layout, k, E, ctx.step, reads, plan=ctx.products)
        shared = self.shared(x, ctx, whole=True) if self.shared is not None else None
        return self._finish(Experts(h, down, layout, E, None, weights, shared, gate), x, ctx)

    def _finish(self, experts: Experts, x, ctx: Ctx):
        """The layer's output [T, H], or in a step on the GPU under the plan's moe_fold or
        combine_normed the Experts for the norm after the layer to finish (add_norm): its down
        kernel or its combine does."""
        if (ctx.step and (ctx.plan.moe_fold or ctx.plan.combine_normed)
                and use_triton(experts.h, values_of(experts.down))):
            return experts
        return experts.run(ctx.step, ctx.products, x.dtype)

    def _shared_as_expert(self, gate_up, x, ctx: Ctx) -> bool:
        """Whether the expert kernels take the shared expert too: the plan's choice (made where the
        shapes allow), and stored as the routed experts are (both FP8, both 4-bit in one form, or
        neither: the 4-bit releases keep the shared expert in bf16)."""
        s = self.shared
        return s is not None and ctx.plan.shared_as_expert and _form(weight(s, "gate_up")) == _form(gate_up)


def _form(w) -> tuple:
    """How a product's weight is stored, as far as a kernel that takes two at once cares."""
    if isinstance(w, GroupInt4):
        return ("int4", w.group, w.zero is None, w.perm is None, w.interleaved, w.scale.dtype)
    return ("fp8",) if isinstance(w, BlockFP8) else ("tensor",)


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
        qg, k, v = ctx.linear(x, weight(self, "qkv")).split([2 * c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        qg = qg.view(T, c.num_attention_heads, 2 * c.head_dim)           # per head: [query | gate]
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:]
        k_cache, v_cache = cache
        # q normalised and rotated; k likewise and v as it is, straight into the cache rows
        q = qkv_norm_rope(q, k.view(T, -1, c.head_dim), v.view(T, -1, c.head_dim), self.q_norm.weight,
                          self.k_norm.weight, ctx.positions, self.inv_freq(x.device), c.rms_norm_eps, k_cache, v_cache,
                          rows=1 if ctx.step else ctx.plan.prefill_rows)
        scale = c.head_dim ** -0.5
        if ctx.step:
            o = attention.decode_attention(q, k_cache, v_cache, ctx.start, scale, gate)   # the gate fused in
        else:
            if isinstance(ctx.start, torch.Tensor):
                # a prefill chunk replayed as a graph (engine/decoder.py): its start on the device,
                # read there by the steps' kernel, which splits the keys over the SMs (an early
                # chunk's over the first rows alone: fewer spans, fewer partials)
                rows = ctx.attention_rows or k_cache.shape[0]
                o = attention.decode_attention(q, k_cache[:rows], v_cache[:rows], ctx.start, scale,
                                               workspace=ctx.attention_workspace)
            else:
                o = self._prefill_attention(q, k_cache, v_cache, scale, ctx)
            if ctx.plan.prefill_gate and c.head_dim & (c.head_dim - 1) == 0:
                # the gate and the rows in one kernel; straight to FP8 where o_proj takes them so
                o_proj = weight(self, "o_proj")
                quantize = c.head_dim % BLOCK == 0 and ctx.quantized_rows_for(o_proj, o)
                return ctx.out_linear(attention.gate_rows(o, gate, quantize), o_proj)
            o = o * torch.sigmoid(gate)
        return ctx.out_linear(o.reshape(T, c.q_dim), weight(self, "o_proj"))

    def _prefill_attention(self, q, k_cache, v_cache, scale: float, ctx: Ctx) -> torch.Tensor:
        """A prefill chunk's T queries over the cache's first start + T rows (the start on the host)."""
        T, n = q.shape[0], ctx.start + q.shape[0]
        # the plan's own kernel where its programs fill the GPU (attention_chunk.prefill_attention_fills);
        # a short chunk's attention stays with flash, which splits the keys over more
        if (ctx.plan.prefill_attention == "triton" and use_triton(q) and q.dtype != torch.float32 and
                attention_chunk.prefill_attention_fills(T, n, q.shape[1], k_cache.shape[1], self.c.head_dim,
                                                        q.element_size(), ctx.plan.products)):
            return attention_chunk.prefill_attention_triton(q, k_cache[:n], v_cache[:n], scale, plan=ctx.plan.products)
        # [1, H, T, D]: the fused SDPA kernels take 4-D inputs only (3-D falls back to the math path)
        q4, keys, values = (t.transpose(0, 1)[None] for t in (q, k_cache[:n], v_cache[:n]))
        return prefill_attention(q4, keys, values, ctx.start == 0, scale)[0].transpose(0, 1)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: ModelConfig, split_ba: bool = False):
        super().__init__()
        self.c = c
        hv = c.linear_num_value_heads
        # qkv | z | b | a; an FP8 or 4-bit model keeps the bf16 [b | a] apart (engine/weights.py)
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
        # a step's conv in the in_proj's own kernel (the plan's conv_in_product: its conv columns then
        # come post-conv), or in the recurrence kernel (conv_in_recurrence), else in a kernel of its own
        in_proj, in_product = weight(self, "in_proj"), None
        if ctx.step and T <= ctx.plan.conv_in_product and T <= ctx.products.rows_of(in_proj):
            in_product = conv.ConvStep(conv_buf, ctx.conv_off, self.conv_weight, ctx.live, c.conv_dim)
        in_recurrence = in_product is None and ctx.step and T <= ctx.plan.conv_in_recurrence
        if self.in_proj_ba is None:
            mixed, z, b, a = ctx.linear(x, in_proj, in_product).split([c.conv_dim, c.value_dim, hv, hv], dim=-1)
        else:
            mz, ba = ctx.linears(x, in_proj, self.in_proj_ba, in_product)
            mixed, z = mz.split([c.conv_dim, c.value_dim], dim=-1)
            b, a = ba.split([hv, hv], dim=-1)
        if in_product is not None:
            o = self._recurrence(*self._heads(mixed), a, b, cache, ctx)
        elif in_recurrence:
            # the recurrence kernel computes the conv of the channels each of its programs reads
            o = gdn.conv_recurrent(mixed, conv_buf, ctx.conv_off, self.conv_weight, a, b, self.A_log, self.dt_bias,
                                   state, pend, ctx.fold, ctx.parity, ctx.live, c.linear_num_key_heads,
                                   ctx.plan.any_stride)
        else:
            o = self._conv_then_recurrence(mixed, a, b, cache, ctx)
        out_proj = weight(self, "out_proj")
        o = o.to(x.dtype)
        # prefill: the normed rows straight to FP8 (a head one group of 128) where out_proj takes them so
        quantize = dv == BLOCK and ctx.quantized_rows_for(out_proj, o)
        o = norm.gated_rmsnorm(o, z.view(T, hv, dv), self.norm_weight, c.rms_norm_eps,
                               rows=1 if ctx.step else ctx.plan.prefill_rows, quantize=quantize)
        return ctx.out_linear(o if quantize else o.reshape(T, c.value_dim), out_proj)

    def _heads(self, mixed):
        """Post-conv q | k | v [T, conv_dim] -> q, k [T, Hk, dk] and v [T, Hv, dv] (views)."""
        c, T = self.c, mixed.shape[0]
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        return q.view(T, -1, c.linear_key_head_dim), k.view(T, -1, c.linear_key_head_dim), \
            v.view(T, c.linear_num_value_heads, c.linear_value_head_dim)

    def _recurrence(self, q, k, v, a, b, cache, ctx: Ctx):
        """A step's recurrence over post-conv heads (the state and kept tokens in `cache`)."""
        _, state, pend = cache
        return gdn.recurrent(q, k, v, a, b, self.A_log, self.dt_bias, state, pend, ctx.fold, ctx.parity, ctx.live,
                             ctx.plan.any_stride)

    def _conv_then_recurrence(self, mixed, a, b, cache, ctx: Ctx):
        """The conv kernel, then the recurrence (a step) or the chunked form (a prefill)."""
        conv_buf, state, pend = cache
        mixed = conv.conv_update(mixed, conv_buf, ctx.conv_off, self.conv_weight, ctx.live,   # pre-conv in, silu out
                                 tokens=16 if ctx.step else ctx.plan.prefill_conv_tokens,
                                 blocks=1 if ctx.step else ctx.plan.prefill_conv_blocks)
        q, k, v = self._heads(mixed)
        if ctx.step:
            return self._recurrence(q, k, v, a, b, cache, ctx)
        # the last step's accepted tokens first (the decoder zeroes ctx.fold after the first chunk;
        # decode state, no gradient); the kernels write the end state over the start state, the
        # reference returns it (from a copy of the start state, which a training forward's
        # gradients may still need)
        with torch.no_grad():
            gdn.fold_pending(state, pend, ctx.fold, ctx.parity, self.A_log, self.dt_bias, ctx.plan.any_stride)
        o, end_state = gdn_chunk.chunk(q, k, v, a, b, self.A_log, self.dt_bias, state, out=state,
                                       fused_out=ctx.plan.chunk_fused_out, solved=ctx.plan.chunk_solved,
                                       terms=ctx.plan.chunk_terms, products=ctx.plan.chunk_products,
                                       normed=ctx.plan.chunk_normed, prep_products=ctx.plan.chunk_prep_products)
        if end_state is not state:
            state.copy_(end_state)
        return o


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
        Product, or an MoE layer's as Experts, still to run, and the normalised rows as a Normed:
        see add_norm)."""
        if residual is None and not isinstance(x, Product):
            normed, h = self.input_norm(x), x
        else:          # (a Product without a residual: the MTP head's fc, still to run)
            # attention's q|k|v product alone reads the normed rows (a GDN's b|a product too, in bf16)
            qkv = weight(self.mixer, "qkv") if self.kind == "full_attention" and not ctx.step else None
            normed, h = ctx.add_norm(x, residual, self.input_norm, quantize_for=qkv)
        # the MoE's router and experts read whole rows, or under the plan's moe_normed a Normed; a
        # dense MLP's gate|up alone reads them
        gate_up = None if self.kind_moe or ctx.step else weight(self.mlp, "gate_up")
        normed, h = ctx.add_norm(self.mixer(normed, cache, ctx), h, self.post_norm,
                                 whole=self.kind_moe and not ctx.plan.moe_normed, quantize_for=gate_up)
        return self.mlp(normed, ctx), h


class Model(nn.Module):
    """The target model. `forward` returns the post-final-norm hidden states (what lm_head and the
    MTP head read); `logits` applies the head."""

    def __init__(self, c: ModelConfig, split_ba: bool = False):
        super().__init__()
        self.c = c
        self.embed = empty(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, kind, split_ba) for kind in c.layer_types)
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
        return ctx.add_norm(x, residual, self.norm, whole=True, out=out)[0]

    def logits(self, hidden: torch.Tensor, products: ProductPlan, rowwise: bool = True,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, vocab] float32, written into `out` when given (a step's buffer: on CUDA the product
        writes it, with no cast and no copy after it)."""
        if out is not None and rowwise and hidden.is_cuda:
            return matvec(hidden, self.head, out=out, plan=products)
        y = linear(hidden, self.head, rowwise, products).float()
        return y if out is None else out.copy_(y)
