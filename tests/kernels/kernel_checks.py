"""What the kernel tests share: one relative-error check (tests/helpers.py's rel_err over the
Frobenius norms), the tolerances, seeded random inputs (and Normed ones for the products)."""
from __future__ import annotations

import torch

from mtpchat.kernels import matvec
from helpers import rel_err
from mtpchat.kernels.plan import ProductPlan

INTERPRETED = not torch.cuda.is_available()

# float32: reduction order only. bf16 outputs: one rounding of the output on the GPU (round to
# nearest); Triton's interpreter truncates when it narrows to bf16, which doubles that error.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2 if INTERPRETED else 1e-2}


def check(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output"):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: not finite"
    err = rel_err(out, ref, ord=2)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0, seed=None, gen=None) -> torch.Tensor:
    """Standard normal numbers drawn on the CPU (the same values on every device), never zeros."""
    g = gen if gen is not None else torch.Generator().manual_seed(seed if seed is not None else 0)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def normed(T, K, dtype, device, gen, blocks=7):
    """A Normed input (kernels/matvec.py) with random rows and positive sums of squares."""
    x = randn(T, K, dtype=dtype, device=device, gen=gen)
    ss = (randn(T, blocks, device=device, gen=gen) ** 2 + 0.5) * (K / blocks)
    return matvec.Normed(x, ss, 1e-6)


def split_plan(parts: int, programs: int = 6) -> ProductPlan:
    """Split products (matvec_parts) in `parts` parts of 32-wide K tiles, 16 columns a block: small
    enough for the interpreter, where the measured rule would not split these small shapes."""
    def small_split_tiles(N, K, itemsize):
        return parts, 16, 32, 4, 2
    return ProductPlan(programs=programs, split_tiles=small_split_tiles)


def int4_weight(N: int, K: int, device, seed: int, group: int = 128, symmetric: bool = True,
                perm: bool = False, experts: int = 0, scale_dtype=torch.float16):
    """A random GroupInt4 (kernels/int4.py) of N rows (a stack of `experts` of N / experts rows,
    each with its own perm, where experts > 0): random 4-bit values, zeros, and scales whose size
    varies over rows and groups by 10^3, so a group or row read with another's scale is far off."""
    from mtpchat.kernels import int4
    assert K % group == 0, f"K = {K} is not whole groups of {group}"
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = (torch.rand(N, K // group, generator=g) + 0.5) * torch.logspace(-2, 1, N)[torch.randperm(N, generator=g), None]
    scale = scale * torch.where(torch.rand(N, K // group, generator=g) < 0.5, -1, 1) / K ** 0.5
    zero = None if symmetric else torch.randint(0, 16, (N, K // group), generator=g).to(torch.uint8)
    p = None
    if perm:
        rows = [torch.randperm(K, generator=g) for _ in range(max(experts, 1))]
        p = (torch.stack(rows) if experts else rows[0]).to(torch.int32)
    packed = int4.pack_ref(q.to(device))        # on the device: a CPU takes many seconds at the 35B's size
    w = int4.GroupInt4(packed, scale.to(scale_dtype), zero, p)
    return int4.GroupInt4(*(t.to(device) if t is not None else None for t in w))


def product_weight(form: str, N: int, K: int, dtype, device, seed: int):
    """A few-row product's weight in one of the forms the engine keeps an in_proj in: a tensor in
    the rows' dtype ("tensor"), a BlockFP8 ("fp8"), or an interleaved GroupInt4 ("int4")."""
    from mtpchat.kernels import fp8, int4
    w = randn(N, K, device=device, seed=seed, scale=K ** -0.5)
    if form == "fp8":
        return fp8.quantize_ref(w)
    if form == "int4":
        return int4.interleave_ref(int4_weight(N, K, device, seed))
    return w.to(dtype)
