"""Where the layout the routing writes (ProductPlan.routed_layout) parts from the derived one:
runs greedy MTP on, eagerly, on a random-weight model of real shapes with the routed layout, and
checks every step's MoE pieces as they run: the written layout against layout_ref of the step's
ids, and the expert products over it against the same products over the derived layout, bit for
bit. Prints, per piece and row count, how many calls agreed and the first that did not.

    python3 probe_layout.py --model qwen3.5-35b-a3b --weights int4
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import greedy_tokens  # noqa: E402
from mtpchat.engine import Engine, bench  # noqa: E402
from mtpchat.engine.config import ModelConfig  # noqa: E402
from mtpchat.engine.plan import KernelPlan  # noqa: E402
from mtpchat.kernels import moe, moe_layout, moe_routing  # noqa: E402

seen = collections.Counter()
first_bad: dict = {}


def note(piece: str, T: int, ok: bool, detail):
    seen[piece, T, ok] += 1
    if not ok and (piece, T) not in first_bad:
        first_bad[piece, T] = detail()


def checked(module, name, check):
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        check(out, *args, **kwargs)
        return out
    setattr(module, name, wrapper)


def check_route(out, logits, top_k, n_experts, shared=False, rows=None, layout=False):
    ids, w, g, lay = out
    if lay.expert is None:
        return
    ids0, w0, g0, _ = route_step(logits, top_k, n_experts, shared, rows, False)
    same = torch.equal(ids, ids0) and torch.equal(w, w0) and (g is None or torch.equal(g, g0))
    note("routing", ids.shape[0], same, lambda: f"ids {ids.tolist()} {ids0.tolist()}\n weights {w.tolist()} {w0.tolist()}")
    ref = moe_layout.layout_ref(ids, n_experts + shared, moe_layout.STEP_ROWS, lay.blocks)
    ok = torch.equal(ref.expert, lay.expert) and torch.equal(ref.pairs, lay.pairs)
    note("layout", ids.shape[0], ok, lambda: f"ids {ids.tolist()}\n written {lay.expert.tolist()} "
         f"{lay.pairs.tolist()}\n ref {ref.expert.tolist()} {ref.pairs.tolist()}")


def derived(layout):
    return moe_layout.StepLayout(layout.ids, layout.blocks)


def check_swiglu(h, x, w, layout, top_k, n_experts, reads=None, shared=None, plan=None):
    if not isinstance(layout, moe_layout.StepLayout) or layout.expert is None:
        return
    h0 = swiglu(x, w, derived(layout), top_k, n_experts, None, shared, plan)
    T = layout.ids.shape[0]
    note("swiglu", T, torch.equal(h, h0), lambda: f"differ in pairs {(h != h0).any(1).nonzero().flatten().tolist()}")


def check_down(out, h, w, layout, n_experts, shared=None, plan=None, fold=None):
    if not isinstance(layout, moe_layout.StepLayout) or layout.expert is None or fold is not None:
        return
    y0 = down(h, w, derived(layout), n_experts, shared, plan)
    T = layout.ids.shape[0]
    note("down", T, torch.equal(out, y0), lambda: f"differ in pairs {(out != y0).any(1).nonzero().flatten().tolist()}")


swiglu, down, route_step = moe.expert_swiglu_triton, moe.expert_down_triton, moe_routing.route_step


def route_only(logits, top_k, n_experts, shared=False, rows=None, layout=False):
    """The routing kernel that writes the layout, its layout left unread: the expert kernels derive theirs."""
    ids, w, g, lay = route_step(logits, top_k, n_experts, shared, rows, layout)
    return ids, w, g, moe_layout.StepLayout(ids, lay.blocks)


def consume_only(logits, top_k, n_experts, shared=False, rows=None, layout=False):
    """The routing kernel that leaves the layout to derive, and the layout made apart (torch): the expert
    kernels read it as they read the routing's."""
    ids, w, g, lay = route_step(logits, top_k, n_experts, shared, rows, False)
    if not layout:
        return ids, w, g, lay
    ref = moe_layout.layout_ref(ids, n_experts + shared, moe_layout.STEP_ROWS, lay.blocks)
    return ids, w, g, moe_layout.StepLayout(ids, lay.blocks, ref.expert, ref.pairs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-35b-a3b")
    p.add_argument("--weights", default="int4")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--derived", action="store_true", help="the derived layout (the default plan's): nothing to check, the tokens only")
    p.add_argument("--mode", default="check", choices=["check", "route-only", "consume-only"],
                   help="check: every piece checked as it runs; route-only: the routing writes the layout, "
                        "the expert kernels derive theirs; consume-only: the expert kernels read a layout made apart")
    a = p.parse_args()
    if a.mode != "check":
        moe_routing.route_step = route_only if a.mode == "route-only" else consume_only
    checked(moe_routing, "route_step", check_route)
    checked(moe, "expert_swiglu_triton", check_swiglu)
    checked(moe, "expert_down_triton", check_down)
    config = ModelConfig.load(Path(bench.__file__).parent / "configs" / f"{a.model}.json")
    plan = KernelPlan.choose("cuda", config, a.weights == "fp8", a.weights == "int4").replace(routed_layout=not a.derived)
    engine = Engine(config, device="cuda", max_context=2048, weights=a.weights, plan=plan, cuda_graphs=False)
    ids = torch.randint(0, config.vocab_size - 64, (5,), generator=torch.Generator().manual_seed(0)).tolist()
    off = greedy_tokens(engine, ids, a.tokens)
    on = greedy_tokens(engine, ids, a.tokens, mtp=True, k=a.k)
    print("MTP on == off" if on == off else "MTP on differs", flush=True)
    for key in sorted(seen):
        print(*key, seen[key])
    for key, detail in first_bad.items():
        print("first bad", key, "\n", detail)


if __name__ == "__main__":
    main()
