"""`mtpchat bench`: MTP off vs on in one process, as a table or JSON (the figures: engine/bench.py)."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.units import fmt_bytes
from mtpchat.models import WEIGHT_LABELS
from mtpchat.malloc import cpu_allocator

RANDOM = ("qwen3.6-27b", "qwen3.5-9b", "qwen3.5-4b", "qwen3.5-0.8b", "qwen3.5-35b-a3b")
# the 4-bit releases: the shipped config of their shape, with their alias's quantization
RANDOM_4BIT = {"qwen3.5-27b-gptq-int4": "qwen3.6-27b", "qwen3.5-35b-a3b-gptq-int4": "qwen3.5-35b-a3b"}
LONG_CONTEXT = 131072    # the long-context row's prompt on a GPU, where the model takes it


def add_arguments(p):
    p.add_argument("--random-weights", choices=(*RANDOM, *RANDOM_4BIT), type=str.lower, metavar="NAME",
                   help=f"random weights of an official shape, built on the device ({', '.join(RANDOM)}; "
                        f"the 4-bit releases' form: {', '.join(RANDOM_4BIT)})")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding (default 1024)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per measurement (default 128)")
    p.add_argument("--exactness-prompts", type=int, default=1,
                   help="prompts checked for MTP on == off, token for token (default 1)")
    p.add_argument("--exactness-tokens", type=int, default=128)
    p.add_argument("--prompts", metavar="FILE",
                   help="JSON lines of {\"prompt\": text}: the real MTP head is measured on these "
                        "(raw text, no chat template) instead of a random prompt")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens per prefill forward at most (default: the engine's: on a GPU the largest "
                        "of 8192 / 4096 / 2048 that memory allows, 512 on the CPU)")
    p.add_argument("--long-context", type=int, metavar="N",
                   help=f"prompt tokens of the long-context row: decode and MTP k=3 after them against the "
                        f"--context prompt, and their time to first token (default {LONG_CONTEXT:,} on a GPU "
                        f"where the model and the memory take it, none on the CPU; 0: none)")
    p.add_argument("--policy-tokens", type=int, default=256,
                   help="tokens generated per run of the profile x policy table (default 256)")
    p.add_argument("--policy-repeats", type=int, default=2, help="runs averaged per cell of that table (default 2)")
    p.add_argument("--profiles-only", action="store_true",
                   help="only decode, the draft step and the profile x policy table")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _max_context(args, config, asked: int | None, long: int = 0) -> int:
    """Room for the 8K time to first token and a chat turn after it, where the model has it, and
    for the long-context row's prompt and generation."""
    return min(max(args.context + max(args.tokens, args.policy_tokens) * 2 + 64, 8192 + 128, asked or 0,
                   _long_room(args, long)), config.max_position_embeddings)


def _long_room(args, long: int) -> int:
    """The context the long-context row needs: its prompt, the tokens it generates and a verify's overshoot."""
    return long + 2 * args.tokens + 64 if long else 0


def long_context(args, config, device: str, free: int | None = None, **plan) -> int:
    """The long-context row's prompt length (0: none): --long-context, or LONG_CONTEXT on a GPU
    where the model takes it and, `free` given, where the memory plan of its context fits (`plan`:
    plan_memory's weights and draft_vocab). One asked for that does not fit is refused in one line;
    the default is dropped with a line on stderr."""
    from mtpchat.engine import memory
    from mtpchat.engine.plan import draft_head_int4_on
    asked = getattr(args, "long_context", None)
    n = LONG_CONTEXT if asked is None and device.startswith("cuda") else max(asked or 0, 0)
    if not n:
        return 0
    said = f"--long-context {n:,}" if asked is not None else f"the long-context row ({n:,} tokens)"
    limit, room = config.max_position_embeddings, _long_room(args, n)
    why = None
    if room > limit:
        why = f"needs {room:,} tokens of context but the model supports {limit:,}"
    elif free is not None:
        cuda = device.startswith("cuda")
        context = _max_context(args, config, getattr(getattr(args, "options", None), "max_context", None), n)
        need = memory.plan_memory(config, context, dtype="bfloat16" if cuda else "float32", cuda_graphs=cuda,
                                  draft_int4=draft_head_int4_on(device),
                                  **{k: v for k, v in plan.items() if v is not None}).needed
        if need > free:
            why = f"does not fit: {context:,} tokens of context need {fmt_bytes(need)} but {fmt_bytes(free)} is free"
    if why is None:
        return n
    if asked is None:
        if room <= limit:     # a model that supports less has no long row to miss
            print(f"mtpchat bench: {said} left out: it {why} (--long-context N for a shorter one)", file=sys.stderr)
        return 0
    raise SystemExit(f"mtpchat bench: {said} {why}: take a shorter --long-context, or 0 for none")


def _configs() -> Path:
    """The official shapes' config.json files, shipped with the engine."""
    from mtpchat import engine
    return Path(engine.__file__).parent / "configs"


def random_config(name: str) -> ModelConfig:
    """The config of `--random-weights NAME`: a shipped one, or a 4-bit release's (its shape's
    shipped config with its alias's quantization: nothing is downloaded)."""
    config = ModelConfig.load(_configs() / f"{RANDOM_4BIT.get(name, name)}.json")
    if name in RANDOM_4BIT:
        from mtpchat.models import alias_config, lookup_alias
        quantized = alias_config(lookup_alias(name))
        config = dataclasses.replace(config, quantization=quantized.quantization, int4=quantized.int4)
    return config


def dry_run_options(args):
    """The options whose memory plan `bench --dry-run` prints: random weights are planned from their
    alias's shape, and the context is the one the bench allocates."""
    from mtpchat.models import lookup_alias, resolve
    opts = dataclasses.replace(args.options)
    if args.random_weights:
        opts.model = lookup_alias(args.random_weights).name
        config = random_config(args.random_weights)
    else:
        config = ModelConfig.load(resolve(opts.model, offline=opts.offline).path)
    device = opts.device
    if device in (None, "auto"):     # as loader.prepare plans it: a GPU where there is one or the model needs one
        from mtpchat.engine import memory
        from mtpchat.loader import CPU_MAX_PARAMS, pick_device
        device = pick_device("auto")[0]
        device = "cuda" if memory.text_params(config) > CPU_MAX_PARAMS else device
    opts.max_context = _max_context(args, config, opts.max_context, long_context(args, config, device))
    return opts


def main(args) -> int:
    import torch                       # with the engine: only once bench runs
    from mtpchat.engine import Engine, bench

    opts = getattr(args, "options", None)
    device = getattr(opts, "device", None)
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu_allocator(device)
    graphs = getattr(opts, "cuda_graphs", True) and device.startswith("cuda")   # none on the CPU
    context = args.context
    if args.random_weights:
        config = random_config(args.random_weights)
        model, name = config, f"random {args.random_weights}"
    else:                              # a model as the other commands take it: the demo one by default
        from mtpchat.models import resolve
        resolved = resolve(getattr(opts, "model", None), offline=getattr(opts, "offline", False))
        model, name, config = resolved.path, resolved.name, ModelConfig.load(resolved.path)
    weights = getattr(opts, "weights", "auto")
    draft_vocab = getattr(opts, "draft_vocab", None)
    from mtpchat.loader import device_memory
    long = long_context(args, config, device, device_memory(device)[0],
                        weights=None if weights in (None, "auto") else weights, draft_vocab=draft_vocab)
    max_context = _max_context(args, config, getattr(opts, "max_context", None), long)
    engine = Engine(model, device=device, max_context=max_context, cuda_graphs=graphs, prefill_chunk=args.prefill_chunk,
                    weights=None if weights in (None, "auto") else weights,
                    **({} if draft_vocab is None else {"draft_vocab": draft_vocab}))
    fmt = engine.weight_format
    if fmt in WEIGHT_LABELS:
        name += f", {WEIGHT_LABELS[fmt]} weights"
    prompts = None
    if args.prompts:
        if engine.tokenizer is None:
            raise SystemExit("mtpchat bench: --prompts needs a checkpoint with a tokenizer, not random weights")
        lines = Path(args.prompts).read_text().splitlines()
        prompts = [engine.tokenizer.encode(json.loads(line)["prompt"]) for line in lines if line.strip()]
    result = {"model": name, "weights": fmt, "cuda_graphs": graphs, "prefill_chunk": engine.decoder.prefill_chunk,
              "kernel_plan": engine.plan.describe(), **bench.run(
        engine, context=context, tokens=args.tokens, exactness_prompts=args.exactness_prompts,
        exactness_tokens=args.exactness_tokens, prompts=prompts, ttft=tuple(n for n in (512, 8192) if n + 8 < max_context),
        policy_tokens=args.policy_tokens, policy_repeats=args.policy_repeats, profiles_only=args.profiles_only, long=long)}
    print(json.dumps(_finite(result), indent=1, default=str) if args.json else table(result))
    return 0


def _finite(x):
    """JSON has no NaN or infinity: a figure that could not be measured is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def policy_table(policies: dict) -> list[str]:
    """ms per token, measured end to end, per profile (rows) and policy (columns)."""
    names = list(next(iter(policies.values()))["policies"]) if policies else []
    head = f"{'profile (len at k=3)':<26}" + "".join(f"{('k=' + n) if n.isdigit() else n:>10}" for n in names)
    lines = ["", "ms per token, end to end: MTP off, fixed k, adaptive k", head]
    for name, p in policies.items():
        row = p["policies"]
        cells = "".join(f"{row[n]['ms_per_token']:>10.3f}" for n in names)
        a = row["adaptive"]
        flag = "" if all(c["identical_to_mtp_off"] for c in row.values()) else "  OUTPUT DIFFERS"
        lines.append(f"{name + ' (' + format(p['expected_length_k3'], '.2f') + ')':<26}{cells}  "
                     f"adaptive/best fixed {a['vs_best_fixed']:.3f}, /off {a['vs_off']:.3f}, "
                     f"k {a['k_histogram']}{flag}")
    return lines + [""]


def long_table(x: dict, row) -> list[str]:
    """The long-context row beside the short prompt's figures, with the targets."""
    n, short, t = f"{x['prompt_tokens']:,}", f"{x['short_prompt_tokens']:,}", x["targets"]
    flag = "" if x["identical_to_mtp_off"] else "  OUTPUT DIFFERS"
    return ["", f"long context: a {n}-token prompt, {x['tokens']} tokens generated, against the {short}-token one",
            f"{'time to first token, ' + n + ' tokens':<44}{x['ttft_ms']:>10.1f} ms",
            row(f"decode, MTP off (per token), {n}", x["decode_ms"])
            + f"  {x['decode_ratio']:.3f} x the {short}'s (target <= {t['decode_ratio_at_most']})",
            row(f"MTP on k={x['k']}, profile (len {x['mean_acceptance_length']:.2f})", x["mtp_ms_per_token"]) + flag,
            row(f"  the same at the expected len {x['expected_length']:.2f}", x["mtp_ms_per_token_at_expected_length"]),
            f"MTP speedup (off / on at the expected len): {x['mtp_speedup']:.3f} at {n}, "
            f"{x['mtp_speedup_short']:.3f} at {short}: {x['speedup_ratio']:.3f} (target >= {t['speedup_ratio_at_least']})"
            + ("" if x["meets_targets"] else "  BELOW TARGET")]


def table(r: dict) -> str:
    floor = r["floor_ms"]
    row = lambda label, ms: f"{label:<44}{ms:>10.3f} ms" + (f" {ms / floor:>8.3f} x floor" if floor else "")
    weights = f"{fmt_bytes(r['step_bytes'])} of weights per target step"
    lines = [f"{r['model']} on {r['device']}" + (f", CUDA graphs {'on' if r['cuda_graphs'] else 'off'}"
                                                 if r["device"] != "cpu" else ""),
             f"copy bandwidth {r['copy_bandwidth_tb_s']:.3f} TB/s; {weights} -> floor {floor:.3f} ms; "
             f"capture {r['capture_s']:.1f} s" if floor else f"{weights} (no bandwidth floor on the CPU)",
             "kernel plan: " + " ".join(f"{k}={v}" for k, v in r["kernel_plan"].items() if k != "products")
             + " " + " ".join(f"{k}={v}" for k, v in r["kernel_plan"]["products"].items()), ""]
    for n, ms in r["ttft_ms"].items():
        lines.append(f"{'time to first token, ' + str(n) + ' tokens':<44}{ms:>10.1f} ms")
    if "second_turn" in r:
        t = r["second_turn"]
        lines.append(f"{'chat turn after ' + format(t['history'], ',') + ' tokens, +' + str(t['new']) + ' new':<44}"
                     f"{t['second_ms']:>10.1f} ms to first token ({t['second_reused']:,} reused; prefilled "
                     f"whole {t['second_full_ms']:.1f} ms)")
        lines.append(f"{'  the turn before, its snapshot kept':<44}{t['first_ms']:>10.1f} ms "
                     f"(without the snapshot {t['first_plain_ms']:.1f} ms)")
    lines.append(row("decode, MTP off (per token)", r["decode_ms"])
                 + f"  (faster of {', '.join(f'{ms:.3f}' for ms in r['decode_runs_ms'])})")
    lines.append(row("decode step, device time", r["decode_step_ms"]))
    for k, m in r["mtp_profile"].items():
        lines.append(row(f"verify k={k}", m["verify_ms"]))
        lines.append(row(f"draft step (k={k})", m["draft_ms_per_step"]))
        lines.append(row(f"MTP on k={k}, profile (len {m['mean_acceptance_length']:.2f})", m["ms_per_token"])
                     + ("" if m["identical_to_mtp_off"] else "  OUTPUT DIFFERS"))
        lines.append(row(f"  the same at the expected len {m['expected_length']:.2f}", m["ms_per_token_at_expected_length"]))
        if "experts_per_layer" in m:
            x = m["experts_per_layer"]
            lines.append(f"  experts read per layer: verify {x['verify']:.1f} (decode {r['decode_experts_per_layer']:.1f}), "
                         f"head {x['draft']:.1f} per step")
    lines.append(f"draft vocabulary: {r['draft_vocab'] or 'full'}; one draft step / one decode step: " + ", ".join(
        f"k={k} {x:.4f}" for k, x in r["draft_step_ratio"].items()))
    if r.get("draft_products_ms"):
        lines.append("draft product alone: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in r["draft_products_ms"].items()))
    if "long_context" in r:
        lines += long_table(r["long_context"], row)
    lines += policy_table(r["policies"])
    for k, m in r.get("mtp_real", {}).items():
        lines.append(row(f"MTP on k={k}, real head (len {m['mean_acceptance_length']:.2f})", m["ms_per_token"])
                     + ("" if m["identical_to_mtp_off"] else "  OUTPUT DIFFERS"))
    e = r.get("exactness")
    if e is not None:
        lines.append(f"exactness: {e['prompts']} prompts x {e['tokens']} tokens x k={e['ks']}: "
                     f"{e['mismatches']} mismatches")
    if "peak_beyond_weights" in r:
        lines.append(f"peak GPU memory beyond the weights at {r['max_context']:,} tokens of context: "
                     f"{fmt_bytes(r['peak_beyond_weights'])}")
    mem = r["memory"]
    lines.append("memory: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items()))
    return "\n".join(lines)
