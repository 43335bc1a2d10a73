"""The 24 GB target on the GPU: `--weights int4` with MTP, 4 turn snapshots and CUDA graphs fits a
24 GB card with the 27B at 32K tokens of context and the 35B-A3B at 16K. Random weights of the
shipped shapes (as `mtpchat bench --random-weights`), quantized on load as a checkpoint would be,
under a memory cap of 23 GiB (a 24 GB card's 24 GiB, less the CUDA context and the driver's own):
load, a prefill of a few thousand tokens and a few MTP steps at k = 3 stay under the cap and within
the memory plan that `mtpchat run` checks before loading (tests/test_memory.py checks that plan on
the CPU)."""
import gc
from pathlib import Path

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine import memory
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import free_memory
from mtpchat.engine.events import Finished
from mtpchat.engine.plan import draft_head_int4_on
from helpers import random_ids

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "configs"    # the official shapes, as shipped
GiB = 1 << 30
CAP = 23 * GiB
PROMPT = 3000


@pytest.fixture
def capped():
    total = torch.cuda.get_device_properties(0).total_memory
    if total < CAP:
        pytest.skip(f"needs a GPU of {CAP / GiB:.0f} GiB or more")
    # an engine of a test before (the 27B's: 17 GiB of weights, 3 GiB of caches) is a cycle of
    # objects: only the collector frees it, and it must be gone before the cap counts
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() < GiB, f"{torch.cuda.memory_allocated() / GiB:.1f} GiB still allocated"
    torch.cuda.set_per_process_memory_fraction(CAP / total)
    torch.cuda.reset_peak_memory_stats()
    yield
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name, context", [("qwen3.6-27b", 32768), ("qwen3.5-35b-a3b", 16384)])
def test_int4_fits_24_gb(capped, name, context):
    config = ModelConfig.load(CONFIGS / f"{name}.json")
    free = free_memory(torch.device("cuda"))
    engine = Engine.load(config, device="cuda", weights="int4", max_context=context, snapshots=4, mtp=True,
                         draft_tokens=3)
    assert engine.weight_format == "int4" and engine.mtp_available
    done = None
    prompt = random_ids(PROMPT, 0, config.vocab_size)
    for event in engine.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=())):
        done = event if isinstance(event, Finished) else done
    assert done.stats.new_tokens == 12 and done.stats.verify_steps > 0     # the k = 3 steps ran
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # the prefill chunk the engine chose within the cap (memory.prefill_chunk_that_fits)
    chunk = engine.decoder.prefill_chunk
    four = engine.plan.draft_head_int4          # the trimmed head's rows in 4 bits, as the plan counts them
    assert four == draft_head_int4_on("cuda")   # what the CLI's memory plan asks (mtpchat/loader.py)
    plan = memory.plan_memory(config, context, engine.k_max, "bfloat16", snapshots=4, weights="int4",
                              prefill_chunk=chunk, draft_int4=four)
    print(f"{name}, {context:,} tokens, prefill chunk {chunk:,}: peak {peak / GiB:.2f} GiB allocated, "
          f"{torch.cuda.max_memory_reserved() / GiB:.2f} GiB reserved; planned {plan.needed / GiB:.2f} GiB")
    assert torch.cuda.max_memory_reserved() <= CAP and peak <= plan.needed
    assert chunk == memory.prefill_chunk_that_fits(config, free, context, engine.k_max, snapshots=4, weights="int4",
                                                   draft_int4=four)
    assert free <= CAP
    del engine
