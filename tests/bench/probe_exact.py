"""Greedy MTP on against MTP off on a random-weight model of real shapes, under the default plan
and with single forms of it turned off: which form, if any, breaks the exactness. Prints, for
each plan, the prompts whose MTP-on tokens differ and where.

    python3 probe_exact.py --model qwen3.5-35b-a3b --weights bf16 --plans "routed_layout=1;routed_layout=1,moe_normed=1"
    python3 probe_exact.py --plans "routed_layout=1" --eager       # the steps run eagerly
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import first_diff, greedy_tokens  # noqa: E402
from mtpchat.engine import Engine, bench  # noqa: E402
from mtpchat.engine.config import ModelConfig  # noqa: E402
from mtpchat.engine.plan import KernelPlan  # noqa: E402
from mtpchat.kernels import moe_routing  # noqa: E402


def parse(forms: str) -> dict:
    out = {}
    for item in filter(None, forms.split(",")):
        key, value = item.split("=")
        out[key.strip()] = value.strip() not in ("0", "false", "off")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-35b-a3b")
    p.add_argument("--weights", default="fp8")
    p.add_argument("--plans", default="", help="';'-separated plans, each ','-separated form=0|1 (the default plan first)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="steps run eagerly, no CUDA graphs")
    p.add_argument("--no-defaults", action="store_true", help="only the plans given, not the default plan first")
    a = p.parse_args()
    config = ModelConfig.load(Path(bench.__file__).parent / "configs" / f"{a.model}.json")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size - 64, (5 + 23 * i,), generator=g).tolist() for i in range(a.prompts)]
    for forms in ([] if a.no_defaults else [""]) + a.plans.split(";"):
        plan = KernelPlan.choose("cuda", config, a.weights == "fp8", a.weights == "int4").replace(**parse(forms))
        engine = Engine(config, device="cuda", max_context=2048, weights=a.weights, plan=plan,
                        cuda_graphs=not a.eager)
        bad, counts = [], []
        for i, ids in enumerate(prompts):
            off = greedy_tokens(engine, ids, a.tokens)
            counts.append(int(moe_routing.route_count(torch.device("cuda", torch.cuda.current_device())).abs().sum()))
            on = greedy_tokens(engine, ids, a.tokens, mtp=True, k=a.k)
            counts.append(int(moe_routing.route_count(torch.device("cuda", torch.cuda.current_device())).abs().sum()))
            if on != off:
                bad.append(f"prompt {i}: token {first_diff(on, off)}")
        # the routing's arrival count must be back at 0 after every step (a count left set would
        # write a routed layout from another program than the last, or none)
        left = f"  (routing count left at {counts})" if any(counts) else ""
        print(f"{forms or 'defaults':>28}: {'MTP on == off' if not bad else '; '.join(bad)}{left}", flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
