"""How far the GDN chunk kernels' forms (kernels/gdn_chunk.py: "solved", "terms", "fused_out") move a
bf16 model's logits, against how far bf16 itself sits from float32: a random dense model (no FP8
activations, no experts chosen by rank, which turn a last-bit difference into a large one), its
prefill of 300 tokens, the engine's GDN taking chunk_triton under each form.

    PYTHONPATH=tests python3 tests/bench/probe_gdn_drift.py        # on a CPU: Triton's interpreter

Each row: the relative L2 distance of the logits to the float32 model's, and to the bf16 model's
with the reference GDN (chunk_ref). On a CPU the interpreter's products are exact float32 (a GPU's
are tf32).
"""
from __future__ import annotations

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before the kernels import Triton

from helpers import random_ids, rel_err                              # noqa: E402
from tools.tiny import write_tiny_checkpoint                         # noqa: E402

from mtpchat.engine import Engine                                    # noqa: E402
from mtpchat.kernels import gdn_chunk                                # noqa: E402

FORMS = {"float32 between the kernels": {}, "terms bf16": {"terms": "bfloat16"},
         "w, u and terms bf16": {"solved": "bfloat16", "terms": "bfloat16"},
         "fused, all bf16": {"fused_out": True, "solved": "bfloat16", "terms": "bfloat16"}}


def main():
    torch.set_num_threads(1)
    folder = write_tiny_checkpoint(tempfile.mkdtemp() + "/model", seed=3, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=64, linear_value_head_dim=64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    want = Engine.load(folder, device="cpu", dtype=torch.float32, max_context=512)
    ids = random_ids(300, 5, want.config.vocab_size - 64)
    want = want.logits(ids).float()
    engine = Engine.load(folder, device=device, dtype=torch.bfloat16, max_context=512, cuda_graphs=False)
    reference = gdn_chunk.chunk
    ref = engine.logits(ids).float().cpu()
    print(f"bf16, the reference GDN: {rel_err(ref, want, ord=2):.4f} from float32")
    try:
        for name, config in FORMS.items():
            gdn_chunk.chunk = lambda q, k, v, a, b, A_log, dt_bias, state, chunk=64, out=None, config=config, **_: \
                gdn_chunk.chunk_triton(q, k, v, a, b, A_log, dt_bias, state, chunk, config, out)
            got = engine.logits(ids).float().cpu()
            print(f"bf16, the kernels, {name}: {rel_err(got, want, ord=2):.4f} from float32, "
                  f"{rel_err(got, ref, ord=2):.4f} from the reference GDN's", flush=True)
    finally:
        gdn_chunk.chunk = reference


if __name__ == "__main__":
    main()
