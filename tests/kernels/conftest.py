"""Kernel tests: each Triton kernel against its float32 torch reference.

With CUDA the small-shape tests run on the GPU and nothing here changes the environment. Without
it they run on CPU tensors under Triton's interpreter, which Triton only uses when TRITON_INTERPRET
is set before it is first imported (it decides per kernel at import, and its own library functions
too), so this conftest sets it at collection. It then stays set for the session: that only matters
to Triton, which cannot run anything on a CPU otherwise. Tests marked `gpu` (real model shapes,
bit-exact batch invariance, which numpy's matmul in the interpreter cannot give) need CUDA.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
_LATE = None
if not CUDA:
    on = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")   # as Triton reads it
    if "triton" in sys.modules and not on:
        _LATE = ("Triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1: "
                 "set it in the environment (or in tests/conftest.py) to run the kernel tests on a CPU")
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> str:
    if _LATE:
        pytest.fail(_LATE)
    return "cuda" if CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if not CUDA and "gpu" in item.keywords and here in Path(item.path).parents:
            item.add_marker(skip)
