"""How far a short prefill's logits land from the CPU's float32 engine on each route a GPU takes: a
tiny checkpoint in 4 bits as it loads (`--weights int4`; `--weights bf16` for the same model in
bf16), its last logits after a 28-token prompt (a chunk of 24, then a step piece of 4), under the
plan's default eager chunk, the graph-chunk route run eagerly (its start read on the device, its
attention by the steps' kernel), and each with the 4-bit products of a few rows in the slab forms
or the few-row kernel (ProductPlan.int4_prefill_rows); then every 4-bit product alone, the few-row
kernel and the decode kernel against the float32 product of the dequantized weight.

    cd tests/bench && python3 probe_prefill_routes.py [--weights int4]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import GPU_SHAPE, gpu_prompts, rel_err  # noqa: E402
from mtpchat.engine import Engine  # noqa: E402
from mtpchat.engine.dispatch import weight  # noqa: E402
from mtpchat.kernels import int4, matvec  # noqa: E402
from mtpchat.kernels.int4 import GroupInt4  # noqa: E402
from tools.tiny import write_tiny_checkpoint  # noqa: E402


def products(engine):
    """The engine's 4-bit products, one of each shape and form: (name, weight)."""
    seen = set()
    for name, module in engine.model.named_modules():
        for p in list(module._parameters):
            w = weight(module, p)
            key = (tuple(w.shape), w.group, str(w.w.dtype), w.perm is not None) if isinstance(w, GroupInt4) else None
            if key is not None and key not in seen:
                seen.add(key)
                yield f"{name}.{p} {key}", w


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default="int4", choices=("int4", "bf16"))
    a = p.parse_args()
    folder = write_tiny_checkpoint(Path(tempfile.mkdtemp()), **GPU_SHAPE)
    load = dict(weights="int4") if a.weights == "int4" else {}
    cpu = Engine.load(folder, device="cpu", dtype=torch.float32, max_context=256, **load)
    ids = gpu_prompts(cpu, 2)[1][:28]
    cpu.decoder.begin(ids)
    truth = cpu.decoder.last_logits.float().cpu()
    base = Engine.load(folder, device="cuda", dtype=torch.bfloat16, max_context=1024, cuda_graphs=False, **load)
    plan = base.plan.replace(int4_prefill_rows=0, prefill_graphs=(), prefill_early=())
    plans = {"eager chunk, slab forms": plan,
             "graph-chunk route (eagerly), slab forms": plan.replace(prefill_graphs=(8, 16, 24)),
             "eager chunk, few-row kernel": plan.replace(int4_prefill_rows=64),
             "graph-chunk route (eagerly), few-row kernel": plan.replace(int4_prefill_rows=64, prefill_graphs=(8, 16, 24))}
    del base
    out = {}
    for name, plan_ in plans.items():
        engine = Engine.load(folder, device="cuda", dtype=torch.bfloat16, max_context=1024, cuda_graphs=False,
                             plan=plan_, **load)
        engine.reset()
        engine.decoder.begin(ids)
        out[name] = engine.decoder.last_logits.float().cpu()
        print(f"{name}: {rel_err(out[name], truth, 2):.4f} from the CPU's float32 logits", flush=True)
        if name == "eager chunk, few-row kernel":
            for what, w in products(engine):
                for T in (4, 24, 64):
                    x = torch.randn(T, w.shape[1], generator=torch.Generator().manual_seed(T)).to("cuda", torch.bfloat16)
                    want = x.float() @ int4.dequantize_ref(w).float().T
                    few = matvec.matvec_prefill(x, w, engine.plan.products).float()
                    step = matvec.matvec(x[:4], w, plan=engine.plan.products).float()
                    print(f"   {what} T={T}: few-row {rel_err(few, want, 2):.2e}, "
                          f"decode kernel (4 rows) {rel_err(step, want[:4], 2):.2e}")
        del engine
    names = list(out)
    for i, x in enumerate(names):
        print(x, " ".join(f"{rel_err(out[x], out[y], 2):.4f}" for y in names[i + 1:]))


if __name__ == "__main__":
    main()
