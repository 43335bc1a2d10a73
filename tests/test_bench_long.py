"""`mtpchat bench`'s long-context row: decode and MTP k=3 after a long prompt against the short one,
on a tiny checkpoint (CPU, a "long" prompt of 600 tokens: two prefill chunks); when the row runs by
default; and the memory plan of the 27B FP8 at 128K with MTP and the turn snapshots on one 80 GB card."""
import json
from argparse import Namespace
from dataclasses import replace

import pytest

from mtpchat import bench
from mtpchat.cli import main
from mtpchat.engine import memory
from mtpchat.engine.bench import LONG_DECODE_AT_MOST, LONG_SPEEDUP_AT_LEAST
from tools.tiny import write_tiny_checkpoint

GiB = 2 ** 30
ARGS = ["bench", "--device", "cpu", "--tokens", "12", "--context", "24", "--policy-tokens", "8",
        "--policy-repeats", "1", "--profiles-only"]


def test_long_row_beside_the_short_one(capsys, gqa3):
    assert main(ARGS + ["--model", str(gqa3), "--long-context", "600", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    x = r["long_context"]
    assert x["prompt_tokens"] == 600 and x["short_prompt_tokens"] == 24 and x["tokens"] == 12 and x["k"] == 3
    assert x["identical_to_mtp_off"]                   # MTP on == off after the long prompt too
    assert x["ttft_ms"] > 0 and x["decode_ms"] > 0 and x["mtp_ms_per_token"] > 0
    assert x["decode_ms_short"] == r["decode_ms"]
    assert len(r["decode_runs_ms"]) == 2 and r["decode_ms"] == min(r["decode_runs_ms"])   # the faster of two
    assert x["mtp_ms_per_token_short"] == r["mtp_profile"]["3"]["ms_per_token_at_expected_length"]
    assert x["decode_ratio"] == pytest.approx(x["decode_ms"] / r["decode_ms"])
    assert x["mtp_speedup"] == pytest.approx(x["decode_ms"] / x["mtp_ms_per_token_at_expected_length"])
    assert x["speedup_ratio"] == pytest.approx(x["mtp_speedup"] / x["mtp_speedup_short"])
    assert x["targets"] == {"decode_ratio_at_most": LONG_DECODE_AT_MOST, "speedup_ratio_at_least": LONG_SPEEDUP_AT_LEAST}
    assert x["meets_targets"] == (x["decode_ratio"] <= 1.3 and x["speedup_ratio"] >= 0.9)
    assert main(ARGS + ["--model", str(gqa3), "--long-context", "600"]) == 0
    table = capsys.readouterr().out
    assert "long context: a 600-token prompt, 12 tokens generated, against the 24-token one" in table
    assert "time to first token, 600 tokens" in table and "(target <= 1.3)" in table and "(target >= 0.9)" in table


def test_no_long_row_on_the_cpu_by_default(capsys, gqa3):
    assert main(ARGS + ["--model", str(gqa3), "--json"]) == 0
    assert "long_context" not in json.loads(capsys.readouterr().out)


def _args(**kw):
    return Namespace(**({"context": 1024, "tokens": 128, "policy_tokens": 256, "long_context": None} | kw))


def test_when_the_long_row_runs(capsys):
    c27 = bench.random_config("qwen3.6-27b")
    assert bench.long_context(_args(), c27, "cpu") == 0
    assert bench.long_context(_args(), c27, "cuda") == bench.LONG_CONTEXT == 131072
    assert bench.long_context(_args(long_context=0), c27, "cuda") == 0
    assert bench.long_context(_args(long_context=600), c27, "cpu") == 600
    # the bench's context holds the long prompt and what it generates
    assert bench._max_context(_args(), c27, None, 131072) >= 131072 + 2 * 128
    # a model that supports less has no default row, and one asked for is refused in one line
    short = replace(c27, max_position_embeddings=32768)
    assert bench.long_context(_args(), short, "cuda") == 0
    with pytest.raises(SystemExit, match=r"^mtpchat bench: --long-context 131,072 needs 131,392 tokens of context "
                                         r"but the model supports 32,768: take a shorter --long-context, or 0"):
        bench.long_context(_args(long_context=131072), short, "cuda")
    # memory: the default is dropped with a line on stderr, one asked for is refused
    assert bench.long_context(_args(), c27, "cuda", free=40 * GiB, weights="fp8") == 131072
    assert bench.long_context(_args(), c27, "cuda", free=34 * GiB, weights="fp8") == 0
    assert "the long-context row (131,072 tokens) left out: it does not fit" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--long-context 131,072 does not fit: 131,392 tokens of context need "):
        bench.long_context(_args(long_context=131072), c27, "cuda", free=34 * GiB, weights="fp8")


def test_bench_dry_run_plans_the_long_context(capsys):
    # no GPU here: the 27B is planned for one, where the long row runs by default
    assert main(["bench", "--random-weights", "qwen3.6-27b", "--weights", "fp8", "--dry-run"]) == 0
    assert "context 131,392 tokens" in capsys.readouterr().out


def test_27b_fp8_at_128k_with_mtp_and_snapshots_fits_an_80gb_card(capsys):
    """The 27B in FP8 with the long row's context, MTP (up to K_MAX drafts, as `run` loads it) and
    the 4 turn snapshots, within 79 GiB (an 80 GB H100's free memory after the CUDA context)."""
    c27 = bench.random_config("qwen3.6-27b")
    context = bench._max_context(_args(), c27, None, bench.LONG_CONTEXT)
    plan = memory.plan_memory(c27, context, memory.K_MAX, weights="fp8")
    print("\n".join(memory.describe(plan)))
    assert plan.mtp and plan.snapshots == memory.DEFAULT_SNAPSHOTS * memory.snapshot_bytes(c27)
    # never under-counted: K and V of 16 main + 1 MTP attention layer, 4 kv heads x 256, bf16, every row
    assert plan.kv + plan.mtp_kv >= (16 + 1) * 2 * 4 * 256 * 2 * context
    assert plan.fits(79 * GiB) and plan.needed < 40 * GiB
    # and the longest context the 27B FP8 takes on that card is longer still
    assert memory.max_context_that_fits(c27, 79 * GiB, memory.K_MAX, weights="fp8") >= 262144 - 1024


def test_prefill_attention_on_the_cpu_copies_no_kv_per_query_head():
    """A later prefill chunk on the CPU: causal over the cache rows below it and among its own, GQA
    read in place (no [Hq, n, D] copies of K and V, 3 GiB each for the 27B at 131K in float32)."""
    import torch
    from torch.profiler import profile

    from helpers import rel_err
    from mtpchat.engine.model import prefill_attention
    g = torch.Generator().manual_seed(3)
    T, n, Hq, Hkv, D = 5, 37, 6, 2, 16
    q, k, v = (torch.randn(1, h, m, D, generator=g) for h, m in ((Hq, T), (Hkv, n), (Hkv, n)))
    with profile() as prof:
        out = prefill_attention(q, k, v, first=False, scale=D ** -0.5)
    assert not {"aten::repeat_interleave", "aten::repeat"} & {e.name for e in prof.events()}
    kk, vv = k.repeat_interleave(Hq // Hkv, 1).double(), v.repeat_interleave(Hq // Hkv, 1).double()
    s = (q.double() @ kk.transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - T, n)[:, None], float("-inf"))
    assert rel_err(out, s.softmax(-1) @ vv) < 1e-5
