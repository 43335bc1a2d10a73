"""The GDN recurrence kernel's compiled form for a step of any length. Triton compiles a launch's
integer arguments into the kernel where they are multiples of 16, and a one-token step's q | k | v
views have another row stride than a longer step's where they are views of a wider row: the
in_proj's [T, N] output under KernelPlan.conv_in_product (torch gives the size-1 row the heads'
width, 128 on the tiny MoE model, where longer steps keep N = 776). The two forms summed q's and
k's squares in other orders at dk = 64, so a decode's token took other bits than the same token in
a verify (greedy MTP on != off). The kernel's any_stride form (KernelPlan.any_stride) must take one
form for every T; the default form must where its q | k | v are the conv kernel's own contiguous
rows. Asks Triton's launcher for the specialisation, compiling nothing, in a child process
without the interpreter (compile_checks.run_children)."""
from __future__ import annotations

import pytest
from compile_checks import run_children

PROBE = r"""
import sys
import torch
try:
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature
except ImportError as e:                 # the launcher's binder is Triton's own, not an API
    print("NO BINDER", e)
    sys.exit(0)
from mtpchat.kernels import gdn


def specialization(kernel, T, N, C, Hk, Hv, dk, dv, product):
    # the launch's arguments as Triton specialises them: q | k | v (and b, a) views as the engine
    # takes them, of the in_proj's rows (product) or of the conv kernel's [T, C] output
    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend)
    seen = {}

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "launch_pdl")}
                seen.update(zip([p.name for p in kernel.params], binder(*args, **kwargs)[1]))
            return launch
    key, value = Hk * dk, Hv * dv
    y = torch.zeros(T, N, dtype=torch.bfloat16)
    mixed = y[:, :C] if product else torch.zeros(T, C, dtype=torch.bfloat16)
    b, a = y[:, C + value:C + value + Hv], y[:, C + value + Hv:C + value + 2 * Hv]
    q, k, v = mixed.split([key, key, value], dim=-1)             # as GatedDeltaNet._heads takes them
    q, k, v = q.view(T, -1, dk), k.view(T, -1, dk), v.view(T, Hv, dv)
    one = torch.zeros(1, dtype=torch.long)
    real = gdn._recurrent_kernel, gdn._recurrent_kernel_any_stride
    gdn._recurrent_kernel = gdn._recurrent_kernel_any_stride = Spy()
    try:
        gdn._step(q, k, v, a, b, torch.zeros(Hv), torch.zeros(Hv), torch.zeros(Hv, dk, dv),
                  torch.zeros(2, 9, Hv, dk + dv + 2), one, one, one, {}, kernel is real[1])
    finally:
        gdn._recurrent_kernel, gdn._recurrent_kernel_any_stride = real
    return seen


# (N, C, Hk, Hv, dk, dv): the GPU tests' tiny MoE and dense models, the 27B
SHAPES = ((776, 512, 2, 4, 64, 64), (524, 320, 2, 6, 32, 32), (16480, 10240, 16, 48, 128, 128))
for name, kernel, product in (("any stride, product", gdn._recurrent_kernel_any_stride, True),
                              ("any stride, conv kernel", gdn._recurrent_kernel_any_stride, False),
                              ("default, conv kernel", gdn._recurrent_kernel, False),
                              ("default, product", gdn._recurrent_kernel, True)):
    for shape in SHAPES:
        first = specialization(kernel, 1, *shape, product)
        for T in (2, 3, 5):
            got = specialization(kernel, T, *shape, product)
            diff = {n: (first[n], got[n]) for n in first if first[n] != got[n]}
            print(f"{name} {shape} T={T}: " + ("one form" if not diff else f"two forms {diff}"))
"""


def test_a_step_of_any_length_takes_one_form():
    out = run_children(PROBE)
    if out.startswith("NO BINDER"):
        pytest.skip(f"this Triton binds a launch's arguments otherwise: {out.strip()}")
    lines = out.strip().splitlines()
    assert len(lines) == 4 * 3 * 3, out
    assert all(line.endswith("one form") for line in lines if not line.startswith("default, product")), out
    # the probe sees what it is for: the default form over the product's views takes two forms on
    # the tiny models (whose rows are no multiple of 16), one on the 27B
    product = [line for line in lines if line.startswith("default, product")]
    assert all("two forms" in line for line in product if "(776," in line or "(524," in line), out
    assert all(line.endswith("one form") for line in product if "(16480," in line), out
