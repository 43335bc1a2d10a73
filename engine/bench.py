"""Measurements for `mtpchat bench`: MTP off vs on, phase times, against the bandwidth floor.

The floor of a decode step is the bytes of weights it must read (every target weight but the
embedding rows it does not touch, plus the lm_head; in 4 bits, the memory plan's count of them)
over the device-to-device copy bandwidth measured in the same run. Every time is reported with its ratio to that floor.
"""
from __future__ import annotations

import statistics
import time

import torch

from mtpchat.engine import memory
from mtpchat.engine.dispatch import linear
from mtpchat.engine.events import Finished, Prefilled, Step
from mtpchat.engine.sampling import SamplingParams
from mtpchat.engine.spec import ProfileDrafter

PROFILE = (0.95, 0.83, 0.70, 0.55)   # P(at least i+1 drafts accepted): the optimistic end (3.48 at k = 3)
# P(at least i drafts accepted), i = 1..4, named after the acceptance they model (the mean
# acceptance length at k = 3 beside): what published measurements of Qwen3.6/3.8-27B's MTP give
# for code and reasoning with thinking off, for chat with thinking on, and for creative writing
PROFILES = {"code": (0.92, 0.78, 0.62, 0.48),             # 3.32
            "chat-thinking": (0.78, 0.48, 0.25, 0.12),    # 2.51
            "creative": (0.50, 0.22, 0.08, 0.03)}         # 1.80
# the long-context row's targets: decode per token at most this many times the short prompt's, and
# the MTP speedup (MTP off / on per token) at least this share of the short prompt's
LONG_DECODE_AT_MOST, LONG_SPEEDUP_AT_LEAST = 1.3, 0.9


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 20) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written; None on the CPU
    (no floor is drawn there: its caches make a copy's speed say little about a step's)."""
    if torch.device(device).type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3)


def _size(t) -> int:
    return t.numel() * t.element_size()


def _unread_experts(module, config) -> int:
    """Bytes of the routed experts one token does not read: all but k of E in each MoE layer."""
    if not config.is_moe:
        return 0
    E, k = config.num_experts, config.num_experts_per_tok
    stored = sum(_size(p) for name, p in module.named_parameters() if ".experts_" in name)
    return stored * (E - k) // E


def step_bytes(engine) -> int:
    """Weight bytes one decode step reads: all layers, the final norm and the lm_head; of an MoE
    layer's routed experts only the k one token chooses. 4-bit weights (packed words, scales,
    zeros, column orders) are counted as the memory plan stores them."""
    if engine.weight_format == "int4":
        return memory.step_read_bytes(engine.config, engine.dtype, "int4")
    total = sum(_size(p) for p in engine.model.parameters()) - _unread_experts(engine.model, engine.config)
    if not engine.config.tie_word_embeddings:
        total -= _size(engine.model.embed)          # only the looked-up rows are read
    return total


def draft_bytes(engine) -> int:
    """Weight bytes one MTP draft step reads: the head's layer and fc, and the lm_head again (the
    trimmed draft head's rows and their ids where there is one, in the form it keeps them); in 4
    bits the head as the memory plan counts it."""
    if engine.head is None:
        return 0
    draft = engine.decoder.draft_rows
    rows = draft.nbytes() if draft is not None else _size(engine.model.head)
    if engine.weight_format == "int4":
        return memory.head_read_bytes(engine.config, engine.dtype, "int4") + rows
    return (sum(_size(p) for p in engine.head.parameters()) - _unread_experts(engine.head, engine.config)
            + rows)


def generate(engine, prompt: list[int], tokens: int, mtp: bool, k: int = 3, drafter=None,
             adaptive: bool = False) -> dict:
    """One generation from an empty state; with `adaptive`, k is the policy's maximum and the
    policy starts from its prior acceptance (the step times it measured before are kept)."""
    engine.reset()
    engine.mtp, engine.draft_tokens, engine.drafter, engine.adaptive = mtp, k, drafter, adaptive
    if adaptive:
        engine.policy.forget()
    steps, done, prefill = [], None, None
    for ev in engine.generate(prompt, SamplingParams(max_tokens=tokens, stop_token_ids=())):
        if isinstance(ev, Prefilled):
            prefill = ev
        elif isinstance(ev, Step) and ev.times.total > 0:
            steps.append(ev)
        elif isinstance(ev, Finished):
            done = ev
    engine.drafter, engine.adaptive = None, False
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    return {"tokens": list(done.token_ids), "stats": done.stats, "prefill_ms": prefill.prefill_ms,
            "ms_per_token": done.stats.decode_ms / max(1, done.stats.new_tokens - 1),
            "ms_per_step": done.stats.decode_ms / max(1, done.stats.steps),
            "verify_ms": mean([s.times.verify for s in steps]),
            "draft_ms": mean([s.times.draft for s in steps]),
            "accept_ms": mean([s.times.accept for s in steps]),
            "host_ms": mean([s.times.host for s in steps])}


def draft_products(engine, repeats: int = 200) -> dict:
    """The draft step's lm_head product alone, ms: the full head and the trimmed one (CUDA only)."""
    if engine.device.type != "cuda" or engine.head is None:
        return {}
    h = torch.randn(1, engine.config.hidden_size, device=engine.device, dtype=engine.dtype)
    heads = {"full": engine.model.head}
    if engine.decoder.draft_rows is not None:
        heads[f"trimmed {engine.draft_vocab}"] = engine.decoder.draft_rows.w
    out = {}
    for name, w in heads.items():
        for _ in range(3):
            linear(h, w, True, engine.plan.products)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            linear(h, w, True, engine.plan.products)
        end.record()
        end.synchronize()
        out[name] = start.elapsed_time(end) / repeats
    return out


def policies(engine, prompt: list[int], tokens: int, profiles=None, ks=(1, 2, 3, 4), repeats: int = 2) -> dict:
    """Per profile: ms per token measured end to end (the mean of `repeats` runs, each with its own
    draws) with MTP off, each fixed k, and the adaptive policy (k at most max(ks)), the mean
    acceptance length drawn, the histogram of k, and whether the output equals MTP off."""
    ref = generate(engine, prompt, tokens, mtp=False)["tokens"]
    vocab = engine.config.vocab_size
    out = {}
    for p, (name, profile) in enumerate((profiles or PROFILES).items()):
        row = {}
        names = ("off", *ks, "adaptive")
        cells: dict = {policy: [] for policy in names}
        # the policies take turns within a repeat (each repeat in another order), so that a device
        # shared with other work slows them alike rather than whichever ran while it was busy
        for r in range(repeats):
            for policy in names[r % len(names):] + names[:r % len(names)]:
                drafter = ProfileDrafter(ref, profile, seed=1000 * p + 10 * r + 1, vocab=vocab)
                if policy == "off":
                    result = generate(engine, prompt, tokens, mtp=False)
                elif policy == "adaptive":
                    result = generate(engine, prompt, tokens, mtp=True, k=max(ks), drafter=drafter, adaptive=True)
                else:
                    result = generate(engine, prompt, tokens, mtp=True, k=policy, drafter=drafter)
                cells[policy].append(result)
        for policy in names:
            runs = cells[policy]
            hist: dict = {}
            for run in runs:
                for k, n in run["stats"].k_histogram.items():
                    hist[k] = hist.get(k, 0) + n
            row[str(policy)] = {
                "ms_per_token": statistics.fmean(run["ms_per_token"] for run in runs),
                "mean_acceptance_length": statistics.fmean(run["stats"].mean_acceptance_length for run in runs),
                "k_histogram": dict(sorted(hist.items())),
                "identical_to_mtp_off": all(run["tokens"] == ref for run in runs)}
        fixed = min(row[str(k)]["ms_per_token"] for k in ks)
        row["adaptive"]["vs_best_fixed"] = row["adaptive"]["ms_per_token"] / fixed
        row["adaptive"]["vs_off"] = row["adaptive"]["ms_per_token"] / row["off"]["ms_per_token"]
        out[name] = {"profile": list(profile), "expected_length_k3": 1 + sum(profile[:3]), "policies": row}
    return out


def time_to_first_token(engine, n: int, seed: int = 0, repeats: int = 3) -> float:
    """The best of `repeats` (the first call of a length also compiles kernels and tunes cuBLAS, so
    two leave one timing: the 27B FP8's 8K prompt read 527.6 and 549.0 ms in two such runs, 503-512
    in the rounds of one process, an H100, 2026-11-28)."""
    prompt = random_prompt(engine, n, seed)
    best = float("inf")
    for _ in range(repeats):
        engine.reset()
        t = time.perf_counter()
        for ev in engine.generate(prompt, SamplingParams(max_tokens=1, stop_token_ids=())):
            if isinstance(ev, Step):
                best = min(best, (time.perf_counter() - t) * 1e3)
                break
    return best


def second_turn(engine, history: int = 8192, new: int = 50, reply: int = 16, seed: int = 7,
                repeats: int = 2) -> dict:
    """Time to first token of a chat turn after one with thinking. The first turn's prompt is
    `history` tokens of conversation and a 3-token generation prompt, with a snapshot kept where
    the conversation ends; its reply (thinking) is left out of the next prompt, as Qwen's templates
    do, which adds `new` tokens to the conversation instead. Beside it, from an empty state each:
    the first prompt without the snapshot, and the second prompt prefilled whole (what a turn cost
    before snapshots). The best of `repeats` of each, in ms; second_reused: prompt tokens resumed."""
    convo, gen, tail = (random_prompt(engine, n, seed + i) for i, n in enumerate((history, 3, new)))
    first, second = convo + gen, convo + tail
    best: dict = {}

    def ttft(key, prompt, tokens=1, keep=(), fresh=True):
        if fresh:
            engine.reset()
        t = time.perf_counter()
        for ev in engine.generate(prompt, SamplingParams(max_tokens=tokens, stop_token_ids=()), snapshot_at=keep):
            if isinstance(ev, Prefilled) and key == "second_ms":
                best["second_reused"] = ev.cached_tokens
            if isinstance(ev, Step) and t is not None:
                best[key] = min(best.get(key, float("inf")), (time.perf_counter() - t) * 1e3)
                t = None                  # the rest of the reply runs untimed
    for _ in range(repeats):
        ttft("first_plain_ms", first)
        ttft("second_full_ms", second)
        ttft("first_ms", first, reply, keep=(history,))
        ttft("second_ms", second, fresh=False)
    return best | {"history": history, "new": new}


def random_prompt(engine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(engine.config.vocab_size, 200_000), (n,), generator=g).tolist()


def long_context(engine, n: int, tokens: int, short: dict, k: int = 3) -> dict:
    """Decode after an n-token prompt, MTP off and on at k under PROFILE (the short prompt's
    drafter), beside `short` (run's figures for the short prompt): per token, their ratio, the MTP
    speedup at both lengths (MTP off over MTP on at the expected length: independent of the draws)
    and its ratio, and the time to first token of the long prompt (the better of the two runs)."""
    prompt = random_prompt(engine, n, 2)
    off = generate(engine, prompt, tokens, mtp=False)
    on = generate(engine, prompt, tokens, mtp=True, k=k,
                  drafter=ProfileDrafter(off["tokens"], PROFILE, seed=k, vocab=engine.config.vocab_size))
    expected = 1 + sum(PROFILE[:k])
    on_ms = on["ms_per_step"] / expected
    short_off, short_on = short["decode_ms"], short["mtp_profile"][k]["ms_per_token_at_expected_length"]
    speedup, short_speedup = off["ms_per_token"] / on_ms, short_off / short_on
    out = {"prompt_tokens": n, "tokens": tokens, "k": k, "ttft_ms": min(off["prefill_ms"], on["prefill_ms"]),
           "decode_ms": off["ms_per_token"], "decode_ms_short": short_off,
           "decode_ratio": off["ms_per_token"] / short_off,
           "mtp_ms_per_token": on["ms_per_token"], "mtp_ms_per_token_at_expected_length": on_ms,
           "mtp_ms_per_token_short": short_on, "mean_acceptance_length": on["stats"].mean_acceptance_length,
           "expected_length": expected, "mtp_speedup": speedup, "mtp_speedup_short": short_speedup,
           "speedup_ratio": speedup / short_speedup, "identical_to_mtp_off": on["tokens"] == off["tokens"],
           "targets": {"decode_ratio_at_most": LONG_DECODE_AT_MOST, "speedup_ratio_at_least": LONG_SPEEDUP_AT_LEAST}}
    out["meets_targets"] = out["decode_ratio"] <= LONG_DECODE_AT_MOST and out["speedup_ratio"] >= LONG_SPEEDUP_AT_LEAST
    return out


def real_acceptance(engine, prompts: list[list[int]], tokens: int, ks=(1, 2, 3, 4)) -> dict:
    """The real MTP head over given prompts (greedy): mean acceptance length and ms/token per k,
    pooled over the prompts, and whether every output equals MTP off."""
    refs = [generate(engine, p, tokens, mtp=False)["tokens"] for p in prompts]
    out = {}
    for k in ks:
        runs = [generate(engine, p, tokens, mtp=True, k=k) for p in prompts]
        steps = sum(r["stats"].verify_steps for r in runs)
        accepted = sum(r["stats"].accepted for r in runs)
        out[k] = {"mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
                  "draft_acceptance_rate": accepted / max(1, sum(r["stats"].drafted for r in runs)),
                  "ms_per_token": statistics.fmean(r["ms_per_token"] for r in runs),
                  "identical_to_mtp_off": all(r["tokens"] == ref for r, ref in zip(runs, refs))}
    return out


def run(engine, context: int = 1024, tokens: int = 128, ks=(1, 2, 3, 4), ttft=(512, 8192),
        exactness_prompts: int = 1, exactness_tokens: int = 128, prompts: list[list[int]] | None = None,
        policy_tokens: int = 256, policy_repeats: int = 2, profiles_only: bool = False, long: int = 0) -> dict:
    """The whole benchmark: one dict of figures (ms) and their ratios to the floor. `profiles_only`:
    only decode, the draft step and the profile x policy table (no prefill, real head, exactness).
    `long`: also decode after a prompt of that many tokens (long_context), against the short one."""
    bw = copy_bandwidth(engine.device)
    if engine.device.type == "cuda":
        # from here on: what serving needs, not loading or the bandwidth measurement's 2 GiB
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    floor = (lambda nbytes: nbytes / bw * 1e3) if bw else (lambda nbytes: None)
    out = {"device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
           "copy_bandwidth_tb_s": bw / 1e12 if bw else None, "step_bytes": step_bytes(engine),
           "draft_bytes": draft_bytes(engine), "floor_ms": floor(step_bytes(engine)),
           "draft_floor_ms": floor(draft_bytes(engine)), "draft_vocab": engine.draft_vocab,
           "memory": engine.memory(), "capture_s": engine.runner.capture_s if engine.runner else 0.0}
    out["ttft_ms"] = {n: time_to_first_token(engine, n) for n in ttft if n < engine.max_context and not profiles_only}
    history = max((n for n in ttft if n + 100 < engine.max_context), default=0)
    if history and engine.decoder.snapshots.count and not profiles_only:
        out["second_turn"] = second_turn(engine, history)
    prompt = random_prompt(engine, context, 1)
    # untimed: the first flush of the MTP rows compiles kernels for its row count, and the profile
    # drafter's first call sets itself up on the device (once a process each)
    warm = generate(engine, prompt, tokens, mtp=False)["tokens"]
    generate(engine, prompt, tokens, mtp=True, k=1, drafter=ProfileDrafter(warm, PROFILE, vocab=engine.config.vocab_size))
    # MTP off twice, the faster kept: a one-off stall of the host (once 0.5 s in 128 tokens of the
    # 35B-A3B, whose step's GPU time and every other figure of the run were as usual) is no cost of
    # a token; both are reported
    runs = [generate(engine, prompt, tokens, mtp=False) for _ in range(2)]
    off = min(runs, key=lambda r: r["ms_per_token"])
    out["decode_ms"] = off["ms_per_token"]
    out["decode_runs_ms"] = [r["ms_per_token"] for r in runs]
    out["decode_step_ms"] = off["verify_ms"]
    if engine.config.is_moe:
        out["decode_experts_per_layer"] = off["stats"].experts_per_layer["decode"]
    out["mtp_profile"], out["mtp_real"] = {}, {}
    for k in ks:
        drafter = ProfileDrafter(off["tokens"], PROFILE, seed=k, vocab=engine.config.vocab_size)
        on = generate(engine, prompt, tokens, mtp=True, k=k, drafter=drafter)
        # the drawn mean length wanders from the profile's expectation over a short run; a step's time
        # over the expected length is the figure that does not depend on the draws
        expected = 1 + sum(PROFILE[:k])
        out["mtp_profile"][k] = {
            "ms_per_token": on["ms_per_token"], "ms_per_step": on["ms_per_step"], "expected_length": expected,
            "ms_per_token_at_expected_length": on["ms_per_step"] / expected,
            "verify_ms": on["verify_ms"], "draft_ms_per_step": on["draft_ms"] / k,
            "accept_ms": on["accept_ms"], "host_ms": on["host_ms"],
            "mean_acceptance_length": on["stats"].mean_acceptance_length,
            "identical_to_mtp_off": on["tokens"] == off["tokens"],
            **({"experts_per_layer": on["stats"].experts_per_layer} if engine.config.is_moe else {})}
    # one draft step (the head's layer and the draft product) over one decode step, per k
    out["draft_step_ratio"] = {k: m["draft_ms_per_step"] / off["verify_ms"] for k, m in out["mtp_profile"].items()}
    out["draft_products_ms"] = draft_products(engine)
    if long:
        out["long_context"] = long_context(engine, long, tokens, out) | {"short_prompt_tokens": context}
    out["policies"] = policies(engine, prompt, policy_tokens, ks=ks, repeats=policy_repeats)
    if profiles_only:
        return out
    out["mtp_real"] = real_acceptance(engine, prompts or [prompt], tokens, ks)
    mismatches = 0
    for p in range(exactness_prompts):
        prompt = random_prompt(engine, 64 + 37 * p, 100 + p)
        ref = generate(engine, prompt, exactness_tokens, mtp=False)["tokens"]
        for k in ks:
            drafter = ProfileDrafter(ref, PROFILE, seed=p * 10 + k, vocab=engine.config.vocab_size)
            mismatches += generate(engine, prompt, exactness_tokens, mtp=True, k=k, drafter=drafter)["tokens"] != ref
    out["exactness"] = {"prompts": exactness_prompts, "tokens": exactness_tokens, "ks": list(ks),
                        "mismatches": mismatches}
    if engine.device.type == "cuda":
        # everything the run ever held beyond the weights: state, graph pools, prefill activations
        out["peak_beyond_weights"] = torch.cuda.max_memory_allocated() - engine.memory()["weights"]
        out["max_context"] = engine.max_context
    return out
