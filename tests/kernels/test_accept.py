"""The fused greedy accept (argmax partials + one commit program) against its torch reference: every
buffer it writes, bit for bit (integers and copies), over windows accepted in full, in part or not
at all, stop ids at, before and after the window's end, room 0 / short / wide, ties in the logits,
repeated tokens, with and without the MTP head's pending rows."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import randn

from mtpchat.kernels import accept

PEND_ROWS = 12


def window(V: int, H: int, k: int, *, seed: int, accepted: str = "some", stop: str = "none", room: int = 100,
           ties: bool = True, repeats: bool = True, head: bool = True, dtype=torch.float32, device="cpu"):
    """Logits [k+1, V] (their argmaxes drawn from three tokens with `repeats`, else distinct), drafts
    that the target keeps `accepted` ("all", "none", "some": half of them), a stop id placed by
    `stop` ("first", "before" / "end" of the accepted window, "after" it: on the rejected drafts)
    and a decoder state of random values. Returns (logits, drafts, buffers, a, tokens), the
    expected a and tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = randn(k + 1, V, gen=g)
    pool = torch.randperm(V - 2, generator=g)[:max(3, k + 1)] + 1        # 1..V-2: room for a tie each side
    target = pool[torch.randint(0, 3, (k + 1,), generator=g)] if repeats else pool[:k + 1]
    logits[torch.arange(k + 1), target] = logits.max() + 1 + torch.rand(k + 1, generator=g)
    if ties:
        # the row's max also at a later index (the target stays first) and at an earlier one
        # (which becomes the target); both a function of the token, so repeated tokens stay repeated
        top = logits.max(-1).values
        later, earlier = target + (V - target) // 2, target // 2
        logits[torch.arange(k + 1), later] = top
        logits[torch.arange(k + 1), earlier] = top
        target = earlier
    assert torch.equal(logits.argmax(-1), target)
    a = {"all": k, "none": 0, "some": k // 2}[accepted]
    drafts = target[:k].clone()
    if a < k:
        drafts[a] = (target[a] + 1) % V                                     # the first rejected draft
    tokens = torch.cat([target[:a], target[a:a + 1].expand(k + 1 - a)])     # d_1..d_a, bonus, filler
    is_stop = torch.rand(V, generator=g) < 0.01
    is_stop[torch.cat([target, drafts])] = False
    at = {"first": 0, "before": a - 1 if a else None, "end": a}.get(stop)
    if at is not None:
        is_stop[tokens[at]] = True
    if stop == "after" and a < k:
        is_stop[drafts[a:]] = True                                          # never emitted
    one = lambda lo, hi: torch.randint(lo, hi, (1,), generator=g)
    b = accept.AcceptBuffers(
        is_stop=is_stop, room=torch.tensor([room]), pos=one(5, 50), gen=one(1, 40), next_tok=one(0, V),
        fold=one(0, 4), parity=one(0, 2), conv_off=one(0, 4),
        seen=torch.randint(0, 3, (V,), generator=g, dtype=torch.int32), v_hidden=randn(k + 2, H, gen=g, dtype=dtype),
        pend_hidden=randn(PEND_ROWS, H, gen=g, dtype=dtype) if head else None,
        pend_tokens=torch.randint(0, V, (PEND_ROWS,), generator=g) if head else None, pend_n=one(1, 4),
        result=torch.randint(0, V, (k + 4,), generator=g))
    b = accept.AcceptBuffers(*[t.to(device) if t is not None else None for t in b])
    return logits.to(device), drafts.to(device), b, a, tokens.tolist()


def clone(b: accept.AcceptBuffers) -> accept.AcceptBuffers:
    return accept.AcceptBuffers(*[t.clone() if t is not None else None for t in b])


def run_both(logits, drafts, b):
    """The kernels and the reference from the same buffers; asserts every buffer equal; returns the
    reference's."""
    ref, out = clone(b), clone(b)
    accept.accept_greedy_ref(logits, drafts, ref)
    accept.accept_greedy_triton(logits, drafts, out)
    for name, r, o in zip(accept.AcceptBuffers._fields, ref, out):
        if r is not None:
            assert torch.equal(o, r), f"{name}: kernel {o.tolist()[:12]} != reference {r.tolist()[:12]}"
    return ref


def expect(b, ref, k, a, tokens, room) -> tuple[int, int]:
    """What the step should emit, counted on the host: checks the reference's result, length and
    room; returns (n, the first stop id's row or k+1)."""
    stop_at = next((i for i in range(a + 1) if b.is_stop[tokens[i]]), k + 1)
    n = min(min(a, stop_at) + 1, room)
    assert ref.result[:k + 3].tolist() == [n, a, *tokens]
    assert ref.pos.item() == b.pos.item() + n and ref.gen.item() == b.gen.item() + n
    assert ref.room.item() == (0 if stop_at < n else room - n)
    return n, stop_at


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("k", range(5))
@pytest.mark.parametrize("V", [1000, 4099, 70001])
def test_sizes(device, V, k, head):
    logits, drafts, b, a, tokens = window(V, 37, k, seed=V + k, head=head, device=device)
    ref = run_both(logits, drafts, b)
    expect(b, ref, k, a, tokens, 100)


@pytest.mark.parametrize("room", [0, 1, 100])
@pytest.mark.parametrize("stop", ["none", "first", "before", "end", "after"])
@pytest.mark.parametrize("accepted", ["all", "none", "some"])
def test_windows(device, accepted, stop, room):
    k = 4
    logits, drafts, b, a, tokens = window(4099, 67, k, seed=7, accepted=accepted, stop=stop, room=room,
                                          repeats=False, device=device)
    ref = run_both(logits, drafts, b)
    n, stop_at = expect(b, ref, k, a, tokens, room)
    assert stop_at == {"first": 0, "before": a - 1 if a else k + 1, "end": a}.get(stop, k + 1)


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("k", range(5))
def test_ended_generation(device, k, head):
    # room 0: n = 0, and only result changes (and the pending rows past pend_n, which nothing reads)
    logits, drafts, b, a, tokens = window(4099, 37, k, seed=13, stop="end", room=0, head=head, device=device)
    ref = run_both(logits, drafts, b)
    assert expect(b, ref, k, a, tokens, 0)[0] == 0
    for name in ("room", "pos", "gen", "next_tok", "fold", "parity", "conv_off", "seen", "pend_n"):
        assert torch.equal(getattr(ref, name), getattr(b, name)), name
    if head:
        keep = b.pend_n.item()
        assert torch.equal(ref.pend_hidden[:keep], b.pend_hidden[:keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 3])
def test_pending_rows_copied(device, k, dtype):
    # a decode appends its row at pend_n, a speculative step restarts the rows at 0
    logits, drafts, b, a, tokens = window(1000, 301, k, seed=3, accepted="all", dtype=dtype, device=device)
    ref = run_both(logits, drafts, b)
    base = b.pend_n.item() if k == 0 else 0
    assert torch.equal(ref.pend_hidden[base:base + k + 1], b.v_hidden[:k + 1])
    assert ref.pend_tokens[base:base + k + 1].tolist() == tokens
    assert ref.pend_n.item() == base + k + 1


@pytest.mark.parametrize("k", range(5))
def test_ties_take_the_first_index(device, k):
    # each row's max three times, in different chunks of the partial argmax: the first one wins
    V = 70001
    logits, _, b, *_ = window(V, 37, k, seed=11, ties=False, device=device)
    first = torch.tensor([5, accept.BV - 1, accept.BV, 2 * accept.BV + 3, V - 2][:k + 1], device=device)
    at = torch.stack([first, first + (V - first) // 2, torch.full_like(first, V - 1)], 1)
    logits.scatter_(1, at, torch.full_like(at, 0, dtype=logits.dtype) + logits.max() + 1)
    drafts = first[:k].clone()
    ref = run_both(logits, drafts, b)
    assert ref.result[1].item() == k and ref.result[2:k + 3].tolist() == first.tolist()


def test_repeated_tokens_count_each(device):
    k = 4
    logits, drafts, b, a, tokens = window(1000, 37, k, seed=5, accepted="all", ties=False, device=device)
    logits[:, 77] = logits.max() + 1
    drafts.fill_(77)
    ref = run_both(logits, drafts, b)
    assert ref.seen[77].item() == b.seen[77].item() + k + 1


def test_dispatch_cpu_takes_the_reference():
    logits, drafts, b, *_ = window(1000, 8, 2, seed=1)
    ref, out = clone(b), clone(b)
    accept.accept_greedy_ref(logits, drafts, ref)
    accept.accept_greedy(logits, drafts, out)
    assert all(r is None or torch.equal(r, o) for r, o in zip(ref, out))


@pytest.mark.gpu
@pytest.mark.parametrize("head", [True, False])
def test_real_size_in_a_graph(head):
    # Qwen3.5's vocabulary and the 27B's hidden size, bf16 hiddens, each k captured as the runner does
    V, H = 248320, 5120
    for k in range(5):
        logits, drafts, b, a, tokens = window(V, H, k, seed=k, head=head, dtype=torch.bfloat16, device="cuda")
        run_both(logits, drafts, b)                          # also compiles the kernels
        partials = accept.argmax_partials_buffers(k + 1, V, "cuda")
        ref, out = clone(b), clone(b)
        accept.accept_greedy_ref(logits, drafts, ref)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            accept.accept_greedy_triton(logits, drafts, out, partials)
        for t, src in zip(out, b):                                          # capture ran nothing: restore
            if t is not None:
                t.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for name, r, o in zip(accept.AcceptBuffers._fields, ref, out):
            if r is not None:
                assert torch.equal(o, r), name


def test_nan_logits_pick_the_first_nan(device):
    # torch.argmax takes a NaN for the largest value, so the first NaN of a row wins, in whichever
    # chunk it falls; a row of NaNs gives token 0, never an index past the vocabulary
    logits, drafts, b, *_ = window(9000, 16, 2, seed=21, device=device)
    logits[0, :] = float("nan")
    logits[1, 5000], logits[1, 7000] = float("nan"), float("nan")
    logits[2, 100] = float("nan")
    drafts = torch.tensor([0, 5000], device=device)     # both kept: the bonus is row 2's first NaN
    b.is_stop[[0, 5000, 100]] = False
    ref = run_both(logits, drafts, b)
    assert ref.result[:5].tolist() == [3, 2, 0, 5000, 100]


@pytest.mark.parametrize("V,R", [(300, 1), (4097, 3), (9000, 2), (34816 + 5, 1)])
@pytest.mark.parametrize("mapped", [False, True])
def test_pick_argmax(device, V, R, mapped):
    # the draft's argmax and its map to token ids, against torch's: bf16-like ties planted in
    # different chunks (the first wins), a row of -inf, odd sizes
    g = torch.Generator().manual_seed(V + R)
    logits = randn(R, V, gen=g).to(device)
    top = logits.max() + 1
    logits[0, V - 7], logits[0, 11] = top, top            # a tie across chunks: index 11 wins
    if R > 1:
        logits[1] = float("-inf")
    ids = torch.randperm(248320, generator=g)[:V].to(device) if mapped else None
    into = torch.full((R,), -1, dtype=torch.long, device=device)
    accept.pick_argmax_triton(logits, ids, into, accept.argmax_partials_buffers(R + 1, V, device))
    want = torch.empty_like(into)
    accept.pick_argmax_ref(logits, ids, want)
    assert torch.equal(into, want)
    assert int(want[0]) == (int(ids[11]) if mapped else 11)


@pytest.mark.gpu
def test_pick_argmax_bf16_in_a_graph():
    # bf16 logits of the 27B's trimmed head (32,768 + 2,048 rows), many ties, captured and replayed
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(1, 34816, device="cuda", generator=g) * 3).round().to(torch.bfloat16)
    ids = torch.randperm(248320, device="cuda", generator=g)[:34816]
    into, want = torch.empty(1, dtype=torch.long, device="cuda"), torch.empty(1, dtype=torch.long, device="cuda")
    parts = accept.argmax_partials_buffers(5, 248320, "cuda")
    accept.pick_argmax(logits, ids, into, parts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        accept.pick_argmax(logits, ids, into, parts)
    for _ in range(3):
        logits.copy_((torch.randn(1, 34816, device="cuda", generator=g) * 3).round().to(torch.bfloat16))
        graph.replay()
        accept.pick_argmax_ref(logits, ids, want)
        assert torch.equal(into, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,H,n,C", [(5, 300, 3, 2), (5, 300, 5, 3), (4, 1000, 1, 0), (1, 64, 1, 1)])
def test_chain_start(device, dtype, R, H, n, C):
    """The catch-up's hand-off to the chained drafts in one kernel: the row pend_n - 1 of the head's
    rows (strided), copied bit for bit, and the positions pos + 0 .. C - 1, against the reference."""
    g = torch.Generator().manual_seed(R * H + n)
    out = (torch.randn(R, H + 5, generator=g) * 3).to(device=device, dtype=dtype)[:, 2:2 + H]
    pend_n = torch.tensor([n], device=device)
    pos = torch.tensor([1234 + n], device=device)
    steps = torch.arange(C, device=device)
    row, chain = accept.chain_start_triton(out, pend_n, pos, steps)
    want_row, want_chain = accept.chain_start_ref(out, pend_n, pos, steps)
    assert row.shape == (1, H) and row.dtype == dtype and torch.equal(row, want_row)
    assert chain.dtype == torch.long and torch.equal(chain, want_chain)


def test_chain_start_clamps_a_count_outside_the_rows(device):
    """A pend_n outside 1 .. R (never in the decoder) reads the nearest row, not memory past `out`."""
    out = randn(3, 40, device=device, seed=5)
    steps = torch.arange(2, device=device)
    for n, want in ((0, 0), (3, 2), (9, 2)):
        row, _ = accept.chain_start_triton(out, torch.tensor([n], device=device), torch.tensor([7], device=device), steps)
        assert torch.equal(row[0], out[want]), n
