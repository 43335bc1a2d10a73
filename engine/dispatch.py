"""Between the architecture (engine/model.py, engine/mtp.py) and the kernels: the forward context
and the few calls through which every product and norm of a layer runs.

- `Ctx`: what a forward needs besides the tokens and the caches, the kernel plan (engine/plan.py)
  included; the model's code asks it for products (`ctx.linear`) and never picks a kernel itself.
- `linear`: a product, row by row in decode/verify/draft (each row's result that of a 1-row call:
  greedy MTP on == MTP off), batched in prefill; a weight is a tensor, a BlockFP8 or a GroupInt4
  (kernels/int4.py), put together from its stored parts by `weight`.
- `Product`, `out_linear`, `add_norm`: a block's last product left for the residual add and the norm
  after it, which in a step on the GPU run it split over K and hand the next product its input as
  a `Normed` (kernels/matvec.py) rather than whole rows. `Experts` is an MoE layer's down product
  and combine left for them alike (the plan's moe_fold and combine_normed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mtpchat.engine.plan import KernelPlan
from mtpchat.kernels import fp8_gemm, int4_gemm, moe, norm
from mtpchat.kernels._triton import use_triton
from mtpchat.kernels.conv import ConvStep, conv_step_ref
from mtpchat.kernels.forms import dense_ref, values_of
from mtpchat.kernels.fp8 import BlockFP8
from mtpchat.kernels.fp8_gemm import QuantizedRows
from mtpchat.kernels.int4 import GroupInt4
from mtpchat.kernels.matvec import Normed, matvec, matvec_prefill, matvec_rider, prefill_fits, rides
from mtpchat.kernels.matvec_parts import matvec_parts, matvec_parts_triton
from mtpchat.kernels.plan import ProductPlan

__all__ = ["Ctx", "Experts", "Normed", "Product", "add_norm", "linear", "weight"]


@dataclass
class Ctx:
    """What a forward needs besides the tokens and the per-layer caches."""
    positions: torch.Tensor   # [T] long: the tokens' positions, or [1]: the first of T consecutive ones
    start: int | torch.Tensor # positions[0]: tokens already in the KV cache (a [1] tensor in steps)
    step: bool                # decode/verify (the recurrence, one state written a step) rather than prefill
    conv_off: torch.Tensor    # [1] long: committed conv window offset
    fold: torch.Tensor        # [1] long: the last step's accepted tokens, to fold into the GDN states
    parity: torch.Tensor      # [1] long: which half of the GDN pend buffers holds them
    plan: KernelPlan          # the forms the products, the routing and the draft take
    live: torch.Tensor | None = None   # [1] long, steps: 0 once the generation has ended (write no state)
    rows: torch.Tensor | None = None   # [1] long: the rows that count (the MTP head's catch-up); the
                                       # rest are stale, and an MoE routes them as the last that counts
    attention_workspace: torch.Tensor | None = None   # float32: a prefill chunk's attention partials
                                                      # with its start on the device (engine/decoder.py)
    attention_rows: int | None = None  # such a chunk's attention reads the caches' first rows alone
                                       # (an early chunk's: KernelPlan.prefill_early)

    @property
    def products(self) -> ProductPlan:
        return self.plan.products

    def linear(self, x, w, conv: ConvStep | None = None) -> torch.Tensor:
        return linear(x, w, self.step, self.plan.products, conv)

    def linears(self, x, w, rider, conv: ConvStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return linears(x, w, rider, self.step, self.plan.products, conv)

    def quantized_rows_for(self, w, x: torch.Tensor) -> bool:
        """Whether the rows that x stands for (their count, device and dtype) go to the product over
        w as FP8 rows made by their producer: a prefill under the plan's prefill_quant, where that
        product would quantize them anyway (takes_quantized_rows)."""
        return not self.step and self.plan.prefill_quant and takes_quantized_rows(x, w, self.plan.products)

    def out_linear(self, x: torch.Tensor, w):
        """A block's last product, which only the residual add and the norm after it read: left
        for add_norm in a step on the GPU, `linear` otherwise."""
        if self.step and use_triton(x, values_of(w)):
            return Product(x, w)
        return self.linear(x, w)

    def add_norm(self, x, residual: torch.Tensor | None, norm_: nn.Module, whole: bool = False,
                 out: torch.Tensor | None = None, quantize_for=None):
        """add_norm under this context's plan; `quantize_for`: the weight of the one product that
        reads the normalised rows, which then come as FP8 rows where it takes them so
        (quantized_rows_for)."""
        quantize = (quantize_for is not None and residual is not None and isinstance(x, torch.Tensor)
                    and self.quantized_rows_for(quantize_for, residual))
        return add_norm(x, residual, norm_, self.plan, whole, out, quantize)


def weight(m: nn.Module, name: str):
    """A product's weight as engine/weights.py stores it: the parameter; with its block scales
    (`<name>_scale`) an FP8 one, a BlockFP8; packed in int32 (or int16, interleaved) with its group scales (and
    `<name>_zero`, `<name>_perm` where it has them) a 4-bit one, a GroupInt4."""
    w, scale = getattr(m, name), getattr(m, name + "_scale", None)
    if scale is None:
        return w
    if w.dtype in (torch.int32, torch.int16):            # int16: interleaved (kernels/int4.py)
        return GroupInt4(w, scale, getattr(m, name + "_zero", None), getattr(m, name + "_perm", None))
    return BlockFP8(w, scale)


def _few_rows(x, rowwise: bool) -> bool:
    """Whether a product over x runs as the few-row matvec kernel: a step's rows on the GPU, or a
    Normed (which only that kernel reads)."""
    return isinstance(x, Normed) or (rowwise and x.is_cuda)


def linear(x, w, rowwise: bool, products: ProductPlan, conv: ConvStep | None = None) -> torch.Tensor:
    """x [T, K] @ w[N, K]ᵀ, w a tensor, a BlockFP8 or a GroupInt4. With `rowwise` (decode, verify,
    draft) each row's result is that of a 1-row call: the batch-invariant matvec kernel on the GPU,
    in the plan's form (it also takes a Normed x, see add_norm, and FP8 or 4-bit weights, scaled in
    registers), one product per row on the CPU. A prefill over FP8 weights on the GPU runs on the
    FP8 tensor cores (fp8_gemm.py), over 4-bit ones in int4_gemm.py (the plan's int4_prefill: a
    dequantized slab and torch's matmul, or the tiles widened in registers), or for at most the
    plan's int4_prefill_rows rows in the few-row kernel (matvec.matvec_prefill); on the CPU it is
    the product of the dequantized weight. `conv` (a step's, kernels/conv.py ConvStep): the first
    conv.channels columns come out through the GDN's causal conv, in the matvec kernel on the GPU."""
    if conv is not None and not _few_rows(x, rowwise):
        return conv_step_ref(linear(x, w, rowwise, products), conv)
    if isinstance(x, QuantizedRows):
        return fp8_gemm.gemm(x, w, products) if isinstance(w, BlockFP8) else int4_gemm.gemm(x, w, plan=products)
    if _few_rows(x, rowwise):
        return matvec(x, w, plan=products, conv=conv)
    if (not rowwise and isinstance(w, GroupInt4) and x.shape[0] <= products.int4_prefill_rows and use_triton(x, w.w)
            and prefill_fits(x.shape[0], w, x.element_size(), products)):
        return matvec_prefill(x, w, products)        # a short prefill chunk's: the weight streamed once
    if not rowwise and use_triton(x, values_of(w)):
        if isinstance(w, BlockFP8):
            return fp8_gemm.gemm(x, w, products)
        if isinstance(w, GroupInt4):
            return int4_gemm.gemm(x, w, plan=products)
    w = dense_ref(w, x.dtype)
    if not rowwise:
        return F.linear(x, w)
    return torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])]) if x.shape[0] > 1 else F.linear(x, w)


def linears(x, w, rider, rowwise: bool, products: ProductPlan,
            conv: ConvStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ wᵀ, x @ riderᵀ), each as `linear` gives it (`conv` w's): where a step's products run as
    the matvec kernel and the plan's `rides` is on, the rider (a tensor, e.g. the GDN's bf16 b|a)
    takes the first programs of w's launch (matvec_rider); otherwise two products."""
    if products.rides and _few_rows(x, rowwise) and rides(x, w, rider):
        return matvec_rider(x, w, rider, plan=products, conv=conv)
    return linear(x, w, rowwise, products, conv), linear(x, rider, rowwise, products)


def takes_quantized_rows(x: torch.Tensor, w, products: ProductPlan) -> bool:
    """Whether a prefill's product over w quantizes rows like x (their count, device, dtype) to FP8
    by rows and 128 columns (fp8_gemm.quantize_rows), and so takes them quantized
    (fp8_gemm.QuantizedRows): FP8 weights on the GPU; 4-bit ones in the fp8 form where it serves,
    with no perm (a producer's rows do not come through one)."""
    if not use_triton(x, values_of(w)) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if isinstance(w, BlockFP8):
        return True
    return (isinstance(w, GroupInt4) and products.int4_prefill == "fp8" and w.perm is None
            and int4_gemm.fp8_serves(x, w))


class Product(NamedTuple):
    """A block's last product (o_proj, out_proj, MLP down) not yet run: in a step on the GPU the
    residual add and the norm after the block run it (add_norm)."""
    x: torch.Tensor
    w: torch.Tensor


class Experts(NamedTuple):
    """An MoE layer in a step past its experts' SwiGLU h [T * k, F] (k counting the shared expert
    where it is expert E), its down product (the experts' stack `down`, the shared expert's
    `shared_down` where it is expert E) and its combine (the routing's `weights`, the shared
    expert's output and `gate` where it is not) not yet run: with the plan's moe_fold, the
    residual add and the norm after the layer run them in the down kernel, with combine_normed in
    the combine (add_norm)."""
    h: torch.Tensor
    down: torch.Tensor
    layout: object
    n_experts: int
    shared_down: torch.Tensor | None
    weights: torch.Tensor
    shared: torch.Tensor | None
    gate: torch.Tensor | None

    def run(self, rowwise: bool, products: ProductPlan, dtype: torch.dtype, fold: moe.Fold | None = None,
            in_down: bool = True):
        """The layer's output [T, H] in dtype; with `fold`, (Normed, h), made by the down kernel
        (moe.expert_down) or, not `in_down`, by the combine (moe.combine)."""
        down_fold = fold if in_down else None
        y = moe.expert_down(self.h, self.down, self.layout, self.n_experts, rowwise, shared=self.shared_down,
                            plan=products, fold=down_fold)
        return y if down_fold is not None else moe.combine(y, self.weights, self.shared, self.gate, dtype, fold)


def add_norm(x, residual: torch.Tensor | None, norm_: nn.Module, plan: KernelPlan, whole: bool = False,
             out: torch.Tensor | None = None, quantize: bool = False):
    """(norm_(x + residual), x + residual) after a block whose output x is a tensor or a Product
    (a Product may come with no residual: the MTP head's fc, the first thing its layer reads).
    With the plan's split_norm a Product runs split over K (its 5120 columns in 80 blocks would
    leave SMs idle): each column block's last program adds the parts and the residual, and the
    normalised rows come as a Normed for the next product to finish (kernels/matvec_parts.py);
    with `whole` (the final norm, whose rows the lm_head and the MTP head both read) or split_norm
    off, as whole rows from the norm kernel, which adds the parts. `out` (whole rows only) receives
    the normalised rows. `norm_` is an RMSNorm (its weight and eps). `quantize` (a prefill's rows on
    the GPU): the normalised rows come quantized for an FP8 product (fp8_gemm.QuantizedRows). An Experts x
    (a step's MoE layer still to finish, SparseMoE) runs in its down kernel with the norm's two
    pieces (the plan's moe_fold, whatever split_norm says; not `whole`), or its down then its
    combine with them (combine_normed), else its down and combine first."""
    if isinstance(x, Experts):
        if (plan.moe_fold or plan.combine_normed) and not whole and residual is not None:
            assert out is None, "add_norm: a folded MoE layer gives a Normed, never whole rows into `out`"
            return x.run(True, plan.products, residual.dtype,
                         moe.Fold(x.weights, x.shared, x.gate, residual, norm_.weight, norm_.eps),
                         in_down=plan.moe_fold)
        x = x.run(True, plan.products, x.h.dtype)
    if isinstance(x, Product):
        if plan.split_norm and not whole:
            assert out is None, "add_norm: the split norm gives a Normed, never whole rows into `out`"
            return matvec_parts_triton(x.x, x.w, norm=(residual, norm_.weight, norm_.eps), plan=plan.products)
        if residual is None:          # nothing to add (the MTP head's fc): the product, then the norm
            assert out is None, "add_norm: no `out` without a residual"
            x = linear(x.x, x.w, True, plan.products)
            return norm.rmsnorm(x, norm_.weight, norm_.eps), x
        x = matvec_parts(x.x, x.w, plan=plan.products)
    return norm.add_rmsnorm(x, residual, norm_.weight, norm_.eps, out=out, quantize=quantize)
