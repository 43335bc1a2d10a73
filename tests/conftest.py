"""Shared by the tests: one CPU thread (tiny models are all per-op overhead), tiny random checkpoints."""
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreted or compiled mode at import: set it before anything imports the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tools.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # the tiny model is all per-op overhead: one thread is several times faster on a shared CPU
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gqa3(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gqa3"), seed=0)    # Hv/Hk = 6/2 = 3, untied


@pytest.fixture(scope="session")
def tied(tmp_path_factory):   # Hv/Hk = 2, tied head, two full-attention layers
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tied"), tie=True, linear_num_value_heads=4,
                                 num_hidden_layers=8, seed=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny checkpoint for the command-line tests (a module's own)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def copy(tiny, tmp_path):
    """A throwaway copy of the tiny checkpoint, to damage."""
    return Path(shutil.copytree(tiny, tmp_path / "copy"))
