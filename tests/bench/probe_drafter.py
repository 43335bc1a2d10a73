"""What the benchmark's drafter costs a step: engine/spec.py's ProfileDrafter (the draws and one
kernel that writes the drafts in place) against its earlier forms (a table in torch: seven small
kernels and the decoder's copy; a where over the true and the wrong tokens: twelve and the copy;
the same draws, the same drafts), MTP on at k = 3 under the benchmark's profile, alternated rounds
in one process. The drafter runs eagerly between a step's draft and its verify, on the GPU's time
but not a real draft's, so the lower its cost the nearer a profile's figures are to a real head's.

    cd tests/bench && python3 probe_drafter.py [--model qwen3.6-27b] [--weights int4]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from mtpchat.bench import random_config
from mtpchat.engine import Engine, bench
from mtpchat.engine.spec import ProfileDrafter


class TableDrafter(ProfileDrafter):
    """The earlier form: one table of the wrong and the true tokens, looked up in torch (seven
    kernels), returned as a new tensor that the decoder copies into its drafts."""
    writes_in_place = False

    def __call__(self, position, drafts: torch.Tensor) -> torch.Tensor:
        k, dev = drafts.shape[0], drafts.device
        if self._rng is None:
            self._setup(dev)
            self._ahead = torch.arange(16 + len(self.profile), device=dev)
        n = len(self.reference)
        u = torch.rand(k, generator=self._rng, device=dev)
        right = (u < self._cond[:k]).cumprod(0)
        at = (torch.as_tensor(position, device=dev).view(-1)[:1] + self._ahead[:k]).clamp_(max=n)
        return self._table.index_select(0, at.add_(right, alpha=n + 1))


class WhereDrafter(ProfileDrafter):
    """The form before it: the true and the wrong tokens looked up apart, then a where."""
    writes_in_place = False

    def __call__(self, position, drafts: torch.Tensor) -> torch.Tensor:
        k, dev = drafts.shape[0], drafts.device
        if self._rng is None:
            self._setup(dev)
            self._ref = self._table[len(self.reference) + 1:]              # the true tokens
        u = torch.rand(k, generator=self._rng, device=dev)
        right = (u < self._cond[:k]).cumprod(0).bool()
        at = torch.as_tensor(position, device=dev).view(-1)[:1] + torch.arange(k, device=dev)
        true = self._ref[at.clamp(max=len(self.reference))]
        wrong = (true + 1) % self.vocab if self.vocab else true + 1
        return torch.where(right, true, wrong)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--weights", default="int4")
    a = p.parse_args()
    config = random_config(a.model)
    engine = Engine(config, device="cuda", max_context=4096, cuda_graphs=True, weights=a.weights)
    prompt = bench.random_prompt(engine, 1024, 0)
    ref = bench.generate(engine, prompt, 128, mtp=False)["tokens"]
    forms = {"where (twelve kernels)": WhereDrafter, "table (seven)": TableDrafter, "one kernel": ProfileDrafter}
    make = lambda form: forms[form](ref, bench.PROFILE, seed=3, vocab=config.vocab_size)
    for form in forms:
        bench.generate(engine, prompt, 128, mtp=True, k=3, drafter=make(form))
    rows = {form: [] for form in forms}
    for r in range(4):
        for form in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
            on = bench.generate(engine, prompt, 128, mtp=True, k=3, drafter=make(form))
            gap = on["ms_per_step"] - on["verify_ms"] - on["draft_ms"] - on["accept_ms"]
            rows[form].append((on["ms_per_step"], gap, on["stats"].mean_acceptance_length, on["tokens"] == ref))
    for form, rs in rows.items():
        print(f"{form:24s} ms a step {[round(x[0], 4) for x in rs]}  beside the phases (us) {[round(x[1] * 1e3, 1) for x in rs]}"
              f"  length {sorted({x[2] for x in rs})}  exact {all(x[3] for x in rs)}")
    steps = {form: statistics.median(x[0] for x in rs) for form, rs in rows.items()}
    last = steps["one kernel"]
    for form, step in steps.items():
        print(f"median step, one kernel / {form}: {last / step:.4f} ({(step - last) * 1e3:.1f} us a step)")


if __name__ == "__main__":
    main()
