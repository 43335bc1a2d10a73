"""Which implementation the public kernel functions take."""
from types import SimpleNamespace

import torch

from mtpchat.kernels._triton import use_triton


def fake(cuda: bool, grad: bool):
    return SimpleNamespace(is_cuda=cuda, requires_grad=grad)


def test_cuda_tensors_take_the_kernels_outside_autograd():
    assert use_triton(fake(True, False), fake(True, False))
    with torch.no_grad():
        assert use_triton(fake(True, True))
    with torch.inference_mode():
        assert use_triton(fake(True, True))


def test_a_forward_recording_gradients_takes_the_reference():
    # the kernels have no backward: training through the modules must take the references
    assert not use_triton(fake(True, False), fake(True, True))
    assert not use_triton(fake(True, True))


def test_cpu_tensors_take_the_reference():
    assert not use_triton(fake(False, False))
