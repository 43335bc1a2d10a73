"""Conv window update (silu fused) against conv_update_ref: outputs and the whole window buffer,
for decode, verify, a prefill longer than the window, and a rollback by offset."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import conv

K = 4
K_MAX = 4                      # drafts: the window keeps K-1 + K_MAX+1 columns
WIDTH = K - 1 + K_MAX + 1


def _case(C, T, dtype, device, seed, width=WIDTH):
    g = torch.Generator().manual_seed(seed)
    x = randn(T, C, dtype=dtype, device=device, gen=g)
    buf = randn(C, width, dtype=dtype, device=device, gen=g)
    w = randn(C, K, dtype=dtype, device=device, gen=g, scale=0.5)
    return x, buf, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 7, 37])     # 7: a prefill whose inputs land on the window's columns
@pytest.mark.parametrize("off", [0, 6, 2 ** 40 + 3])   # the window wrapped around the ring, a long history
@pytest.mark.parametrize("width", [WIDTH, WIDTH - 1])      # k_max 4, or 3: a window not a power of two
def test_conv_update(device, dtype, T, off, width):
    x, buf, w = _case(100, T, dtype, device, seed=T + 10 * (off % 97), width=width)
    offset = torch.tensor([off], device=device)
    buf_ref = buf.clone()
    y = conv.conv_update_triton(x, buf, offset, w)
    y_ref = conv.conv_update_ref(x, buf_ref, offset, w)
    check(y, y_ref, TOL[dtype])
    assert torch.equal(buf, buf_ref), "window buffer"


def test_conv_tokens_a_program_hold_the_window(device):
    # only the first token block reads the window: a block of fewer than K-1 tokens is refused
    x, buf, w = _case(100, 9, torch.bfloat16, device, seed=61)
    with pytest.raises(AssertionError, match="at least 3"):
        conv.conv_update_triton(x, buf, torch.tensor([5], device=device), w, tokens=2)


@pytest.mark.parametrize("tokens", [4, 64])
@pytest.mark.parametrize("T", [5, 37])
def test_conv_tokens_a_program(device, T, tokens):
    # a prefill's tiles of other sizes give every output and the window the bits of a step's 16
    x, buf, w = _case(100, T, torch.bfloat16, device, seed=60 + T)
    off = torch.tensor([3], device=device)
    buf16 = buf.clone()
    y = conv.conv_update_triton(x, buf, off, w, tokens=tokens)
    assert torch.equal(y, conv.conv_update_triton(x, buf16, off, w))
    assert torch.equal(buf, buf16), "window buffer"


@pytest.mark.parametrize("blocks", [2, 3, 8])
@pytest.mark.parametrize("T", [5, 37, 70])
def test_conv_token_blocks_a_program(device, T, blocks):
    # a program taking several token blocks in turn (KernelPlan.prefill_conv_blocks; where T ends
    # before a program's last blocks, as at T = 5, they store nothing) gives every output and the
    # window the bits of one block a program
    x, buf, w = _case(100, T, torch.bfloat16, device, seed=70 + T)
    off = torch.tensor([5], device=device)
    buf1, buf_ref = buf.clone(), buf.clone()
    y = conv.conv_update_triton(x, buf, off, w, tokens=8, blocks=blocks)
    assert torch.equal(y, conv.conv_update_triton(x, buf1, off, w, tokens=8))
    assert torch.equal(buf, buf1), "window buffer"
    check(y, conv.conv_update_ref(x, buf_ref, off, w), 1e-2)


def test_conv_strided_input(device):
    # the conv input is the first C columns of a wider projection
    wide = randn(3, 130, device=device, seed=3)
    x = wide[:, :100]
    _, buf, w = _case(100, 3, torch.float32, device, seed=4)
    off = torch.tensor([1], device=device)
    buf_ref = buf.clone()
    check(conv.conv_update_triton(x, buf, off, w), conv.conv_update_ref(x, buf_ref, off, w), TOL[torch.float32])
    assert torch.equal(buf, buf_ref)


def test_conv_rollback(device):
    # verify 4 tokens, accept 2 (offset 2), then decode 3 more: the same as feeding the 2 kept ones
    # and the 3 new ones through the reference
    x, buf, w = _case(70, 7, torch.float32, device, seed=5)
    zero = torch.tensor([0], device=device)
    buf_ref = buf.clone()
    conv.conv_update_triton(x[:4], buf, zero, w)
    y = conv.conv_update_triton(x[4:], buf, torch.tensor([2], device=device), w)
    y_ref = conv.conv_update_ref(torch.cat([x[:2], x[4:]]), buf_ref, zero, w)[2:]
    check(y, y_ref, TOL[torch.float32])


def test_conv_steps_around_the_ring(device):
    # steps of 1..5 tokens, each accepting some of them, carry the offset around the ring many times:
    # every output is the conv of the last K-1 accepted inputs and the step's own
    C = 50
    g = torch.Generator().manual_seed(9)
    w = randn(C, K, device=device, gen=g, scale=0.5)
    buf = randn(C, WIDTH, device=device, gen=g)
    history = buf[:, :K - 1].T.clone()                       # [K-1, C]: the committed window at offset 0
    off = torch.tensor([0], device=device)
    steps = [(1 + i % 5, (i * 7) % (1 + i % 5) + 1) for i in range(40)]   # (T, accepted), accepted <= T
    for T, n in steps:
        x = randn(T, C, device=device, gen=g)
        full = torch.cat([history[-(K - 1):], x])           # [K-1+T, C]
        want = torch.nn.functional.silu(sum(w[:, j] * full[j:j + T] for j in range(K)))
        check(conv.conv_update_triton(x, buf, off, w), want, TOL[torch.float32])
        history = torch.cat([history, x[:n]])
        off += n
    assert int(off) > 4 * WIDTH, "the offset went around the ring several times"
    assert torch.equal(buf.index_select(1, conv.window_columns(off, K, WIDTH)), history[-(K - 1):].T)


@pytest.mark.parametrize("live", [0, 2])
@pytest.mark.parametrize("T", [1, 4])
def test_conv_live_flag(device, T, live):
    # a step launched after its generation ended (live 0) computes its outputs but leaves the
    # window as it was; a positive value writes as without the flag
    x, buf, w = _case(90, T, torch.float32, device, seed=40 + T)
    off, flag = torch.tensor([1], device=device), torch.tensor([live], device=device)
    before, buf_ref, plain = buf.clone(), buf.clone(), buf.clone()
    y = conv.conv_update_triton(x, buf, off, w, flag)
    check(y, conv.conv_update_ref(x, buf_ref, off, w, flag), TOL[torch.float32])
    check(y, conv.conv_update_ref(x, plain, off, w), TOL[torch.float32])
    assert torch.equal(buf, buf_ref)
    assert torch.equal(buf, plain if live else before)
    assert live == 0 or not torch.equal(buf, before)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 8192])
def test_conv_27b_shapes(T):
    x, buf, w = _case(10240, T, torch.bfloat16, "cuda", seed=6)
    off = torch.tensor([3], device="cuda")
    buf_ref = buf.clone()
    check(conv.conv_update(x, buf, off, w), conv.conv_update_ref(x, buf_ref, off, w), 1e-2)
    assert torch.equal(buf, buf_ref)
