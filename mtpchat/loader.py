"""From options to a loaded engine: resolve the model, pick the device, plan memory, then load.

Everything that can refuse does so before a weight is read: an unknown or incomplete model, a
device that is missing or too old, a model too large for the CPU, a plan that does not fit the
free memory (with what would fit instead). The CLI and the app share this path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mtpchat import hubcache, models
from mtpchat.errors import DeviceError, NotEnoughMemory, UserError
from mtpchat.settings import DEFAULT_CONTEXT, Options

CPU_MAX_PARAMS = 4.0e9      # above this the CPU path is too slow to be useful
MIN_CAPABILITY = (8, 0)     # bfloat16 and the Triton kernels need Ampere or newer


@dataclass
class Prepared:
    """What `prepare` decided; `load_engine` turns it into an Engine."""
    name: str
    path: Path | None         # None when planned from an alias's shape without a download
    config: object            # ModelConfig
    device: str
    dtype: str
    mtp: bool
    draft_tokens: int
    k_max: int
    max_context: int
    cuda_graphs: bool
    plan: object              # MemoryPlan
    free: int | None          # free bytes on the device, when known
    notices: list[str] = field(default_factory=list)
    snapshots: int = 4        # decode-state snapshots for chat turns (engine/snapshots.py)
    weights: str | None = None  # the weight format asked for: None (the checkpoint's), "fp8", "int4" or "bf16"
    draft_vocab: int = 32768    # rows of the trimmed draft head (0: the full head; engine/draft_vocab.py)
    adaptive_k: bool = True     # each step's k chosen by engine/policy.py, draft_tokens its maximum

    @property
    def draft_int4(self) -> bool:
        """Whether the engine keeps the trimmed draft head in 4 bits there (the kernel plan's rule)."""
        from mtpchat.engine.plan import draft_head_int4_on
        return draft_head_int4_on(self.device)


def pick_device(requested: str, said: str | None = None) -> tuple[str, bool]:
    """(device, whether it was chosen automatically); checks that CUDA is usable when asked. `said`:
    how the user asked for it (the flag, or the settings file's key), for the errors."""
    said = said or f"--device {requested}"
    import torch
    if requested == "auto":
        return ("cuda" if torch.cuda.is_available() else "cpu"), True
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            why = (f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
                   if torch.version.cuda is None else
                   f"no GPU is visible, or the NVIDIA driver is too old for CUDA {torch.version.cuda} "
                   "(check nvidia-smi)")
            raise DeviceError(f"{said}: CUDA is not available: {why}\n"
                              "small models run on the CPU with --device cpu")
        index = int(requested.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"{said}: only {torch.cuda.device_count()} GPU(s) are visible")
        cap = torch.cuda.get_device_capability(index)
        if cap < MIN_CAPABILITY:
            raise DeviceError(f"{torch.cuda.get_device_name(index)} has compute capability {cap[0]}.{cap[1]}; "
                              f"mtpchat needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ampere, Ada, Hopper)")
    return requested, False


def device_memory(device: str) -> tuple[int | None, int | None]:
    """(free, total) bytes of the device's memory (the host's for the CPU), before anything is loaded;
    (None, None) when unknown. What a started engine may take is engine.free_memory."""
    if device.startswith("cuda"):
        import torch
        free, total = torch.cuda.mem_get_info(int(device.partition(":")[2] or 0))
        return free, total
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None, None


def model_config(options: Options, dry_run: bool, notices: list[str]):
    """(name, folder or None, ModelConfig, has_mtp). A dry run of an alias that is not cached plans
    from the alias's known shape instead of downloading."""
    from mtpchat.engine.config import ModelConfig
    spec = options.model
    if dry_run and spec is not None:
        kind, target, alias = models.classify(spec)
        snap = hubcache.cached_snapshot(hubcache.hub_cache_dir(), target) if kind == "repo" else None
        if alias and not (snap and hubcache.check_folder(snap).complete):
            notices.append(f"{alias.name} is not downloaded: planned from its known shape")
            return alias.name, None, models.alias_config(alias), True
    resolved = models.resolve(spec, offline=options.offline, notify=notices.append)
    config = ModelConfig.load(resolved.path)
    return resolved.name, resolved.path, config, resolved.has_mtp and config.has_mtp


def prepare(options: Options, dry_run: bool = False) -> Prepared:
    from mtpchat.engine import memory
    from mtpchat.engine.plan import draft_head_int4_on
    notices: list[str] = []
    name, path, config, has_mtp = model_config(options, dry_run, notices)
    params = memory.text_params(config)
    asked = options.max_context
    if asked is not None and asked > config.max_position_embeddings:
        raise UserError(f"{options.said('max_context')} is longer than {name} supports "
                        f"({config.max_position_embeddings:,} tokens)")
    device, auto = pick_device(options.device, options.said("device"))
    elsewhere = dry_run and auto and device == "cpu" and params > CPU_MAX_PARAMS
    if elsewhere:  # a plan for the GPU this model needs, made on a machine without one
        device = "cuda"
        notices.append("no CUDA GPU here: planned for one (its free memory is unknown)")
    if device == "cpu" and params > CPU_MAX_PARAMS:
        lead = "no CUDA GPU was found, and " if auto else ""
        small = [a.name for a in models.smaller_aliases(int(CPU_MAX_PARAMS) + 1)][:1]
        raise DeviceError(f"{lead}{name} ({params / 1e9:.1f}B parameters) is too large for the CPU "
                          f"(up to {CPU_MAX_PARAMS / 1e9:.0f}B runs there)\n"
                          f"use a CUDA GPU, or a small model such as --model {small[0] if small else 'a 2B'}")
    if device == "cpu" and auto:
        notices.append("no CUDA GPU found: running on the CPU (fine for small models, slow for large ones)")
    dtype = options.dtype if options.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    mtp = options.mtp
    if mtp and not has_mtp:
        notices.append(f"{name} has no mtp.* weights: running with MTP off")
        mtp = False
    graphs = options.cuda_graphs and device.startswith("cuda")
    # MTP can be switched on live, so the head is loaded whenever the checkpoint has one
    # the engine's own limit (memory.K_MAX), whatever k it starts with: the draft count can rise live up to it
    k_max = memory.K_MAX
    free = None if elsewhere else device_memory(device)[0]
    snaps, weights = options.snapshots, weight_format(options.weights, config, device, name, notices,
                                                                options.said("weights"))
    draft_int4 = draft_head_int4_on(device)
    context = asked or default_context(config, name, free, k_max, dtype, has_mtp, graphs, snaps, notices, weights,
                                       draft_vocab=options.draft_vocab, draft_int4=draft_int4)
    plan = memory.plan_memory(config, context, k_max, dtype, mtp=has_mtp, cuda_graphs=graphs, snapshots=snaps,
                              weights=weights, draft_vocab=options.draft_vocab, draft_int4=draft_int4)
    prep = Prepared(name, path, config, device, dtype, mtp, options.draft_tokens, k_max,
                    context, graphs, plan, free, notices, snaps, weights, options.draft_vocab, options.adaptive_k)
    if free is not None and not plan.fits(free) and not dry_run:
        raise NotEnoughMemory(not_enough_memory_message(prep))
    return prep


def fp8_capable(device: str) -> bool:
    """Whether FP8 weights run on the device: a GPU of compute capability 8.9+ (Ada, Hopper); the
    CPU dequantizes them (as does the engine there)."""
    if not device.startswith("cuda"):
        return False
    import torch
    if not torch.cuda.is_available():
        return True        # a plan for a GPU made on a machine without one: assume a current GPU
    from mtpchat.kernels.fp8 import fp8_runs_on
    return fp8_runs_on(device)


def weight_format(asked: str, config, device: str, name: str, notices: list[str], said: str = "--weights fp8") -> str | None:
    """The engine's `weights` for the options: None keeps an FP8 checkpoint in FP8 where FP8 runs
    (else it is dequantized as it loads, said in a notice); fp8 where it cannot run is an error.
    4 bits run wherever mtpchat does (a GPU of compute capability 8.0+; on the CPU the engine
    dequantizes them), so a 4-bit checkpoint and `--weights int4` are taken as they are."""
    if asked == "fp8" and not fp8_capable(device):
        gpu = device.startswith("cuda")
        where = "this GPU (compute capability below 8.9)" if gpu else "the CPU"
        raise UserError(f"{said}: FP8 weights run on Ada or Hopper GPUs, not on {where}; "
                        "leave --weights out to run the model in bf16"
                        + (", or take --weights int4 (4 bits, which run on this GPU)" if gpu else ""), exit_code=2)
    if asked == "auto" and config.quantization == "fp8" and not fp8_capable(device):
        notices.append(f"{name} stores FP8 weights, which this device cannot multiply: "
                       "dequantized as they load (twice the memory)")
        return "bf16"
    return None if asked == "auto" else asked


def default_context(config, name: str, free: int | None, k_max: int, dtype: str, mtp: bool, graphs: bool,
                    snapshots: int, notices: list[str], weights: str | None = None, *,
                    draft_vocab: int, draft_int4: bool) -> int:
    """The context when none was asked for: DEFAULT_CONTEXT, or less where the model supports less
    or the free memory holds less (said in a notice). Where not even CONTEXT_STEP tokens fit, the
    default stays, and the plan's refusal says what would fit."""
    from mtpchat.engine import memory
    from mtpchat.engine.units import fmt_bytes
    context = min(DEFAULT_CONTEXT, config.max_position_embeddings)
    if context < DEFAULT_CONTEXT:
        notices.append(f"context: {context:,} tokens, the most {name} supports")
    rows = dict(draft_vocab=draft_vocab, draft_int4=draft_int4)
    if free is not None and not memory.plan_memory(config, context, k_max, dtype, mtp, graphs,
                                                   snapshots=snapshots, weights=weights, **rows).fits(free):
        fits = memory.max_context_that_fits(config, free, k_max, dtype, mtp, graphs, snapshots, weights, **rows)
        if fits is not None and fits < context:
            notices.append(f"context: {fits:,} tokens, what fits in the {fmt_bytes(free)} free "
                           f"(--max-context to choose)")
            context = fits
    return context


def not_enough_memory_message(prep: Prepared) -> str:
    from mtpchat.engine.units import fmt_bytes
    plan, free = prep.plan, prep.free
    where = "the GPU" if prep.device.startswith("cuda") else "memory"
    fmt = f" in {models.WEIGHT_LABELS[plan.weight_format]}" if plan.weight_format in models.WEIGHT_LABELS else ""
    head = (f"{prep.name} does not fit: it needs {fmt_bytes(plan.needed)} (weights{fmt} "
            f"{fmt_bytes(plan.weights)}, KV {fmt_bytes(plan.kv + plan.mtp_kv)} for "
            f"{plan.max_context:,} tokens) but {fmt_bytes(free)} is free on {where}")
    return head + "\n" + what_would_fit(prep)


def what_would_fit(prep: Prepared) -> str:
    from mtpchat.engine import memory
    ctx = memory.max_context_that_fits(prep.config, prep.free, prep.k_max, prep.dtype,
                                       prep.plan.mtp, prep.cuda_graphs, prep.snapshots, prep.weights,
                                       prep.draft_vocab, prep.draft_int4)
    options = [f"--max-context {ctx}"] if ctx else []
    options += [fewer] if (fewer := fewer_bytes(prep)) else []
    smaller = [a.name for a in models.smaller_aliases(memory.text_params(prep.config))
               if memory.plan_memory(models.alias_config(a), prep.max_context, prep.k_max,
                                     prep.dtype, True, prep.cuda_graphs, draft_vocab=prep.draft_vocab,
                                     draft_int4=prep.draft_int4).fits(prep.free)]
    options += [f"--model {smaller[0]}"] if smaller else []
    if not options:
        return "nothing fits: free some memory (other processes on the GPU?) or use a larger GPU"
    return "what fits: " + ", or ".join(options)


def fewer_bytes(prep: Prepared) -> str | None:
    """The same model in fewer bytes a weight, where that fits at the planned context: the largest
    such format first (FP8, then the official GPTQ-Int4 release, then every product in 4 bits), as a
    release of its own where there is one, else as --weights (on a GPU: the CPU runs float32)."""
    from mtpchat.engine import memory
    if not prep.device.startswith("cuda") or prep.dtype == "float32":
        return None
    fits = lambda config, weights: memory.plan_memory(
        config, prep.max_context, prep.k_max, prep.dtype, prep.plan.mtp, prep.cuda_graphs, snapshots=prep.snapshots,
        weights=weights, draft_vocab=prep.draft_vocab, draft_int4=prep.draft_int4).fits(prep.free)
    held, stored = prep.plan.weight_format, prep.config.quantization
    if held not in ("fp8", "int4") and stored != "int4" and fp8_capable(prep.device) and fits(prep.config, "fp8"):
        # an FP8 release, or quantized on load: the same bytes
        twin = models.release(prep.name, "fp8")
        return f"--model {twin.name}" if twin else "--weights fp8"
    if held == "int4" and stored != "int4":
        return None               # every product is in 4 bits already
    gptq = models.release(prep.name, "gptq-int4")
    if held != "int4" and stored != "int4" and gptq and fits(models.alias_config(gptq), None):
        return f"--model {gptq.name}"
    if stored is None:            # a bf16 checkpoint: quantized on load
        return "--weights int4" if fits(prep.config, "int4") else None
    base = models.release(prep.name, "bf16")    # an FP8 or 4-bit release: every product in 4 bits from the bf16 one
    return f"--model {base.name} --weights int4" if base and fits(models.alias_config(base), "int4") else None


def load_engine(prep: Prepared, progress=None):
    """Load the weights onto the device; run after `prepare` said the plan fits. `progress`: see
    Engine (mtpchat/progress.py draws it on the terminal)."""
    import torch
    from mtpchat.engine import Engine
    if prep.path is None:
        raise ValueError("a model planned from its shape alone cannot be loaded")
    return Engine.load(prep.path, device=prep.device, dtype=getattr(torch, prep.dtype),
                       max_context=prep.max_context, draft_tokens=prep.draft_tokens, k_max=prep.k_max,
                       mtp=prep.mtp, cuda_graphs=prep.cuda_graphs, snapshots=prep.snapshots,
                       weights=prep.weights, draft_vocab=prep.draft_vocab, adaptive=prep.adaptive_k,
                       progress=progress)


def sampling_params(options: Options, folder: Path | None):
    """SamplingParams from the options; unset ones come from generation_config.json, else off."""
    from mtpchat.engine import SamplingParams
    from mtpchat.engine.config import GenerationConfig
    gen = GenerationConfig.load(folder) if folder else GenerationConfig()
    pick = lambda mine, theirs, off: mine if mine is not None else theirs if theirs is not None else off
    return SamplingParams(temperature=pick(options.temperature, gen.temperature, 0.0),
                          top_k=pick(options.top_k, gen.top_k, 0),
                          top_p=pick(options.top_p, gen.top_p, 1.0),
                          min_p=pick(options.min_p, None, 0.0),
                          presence_penalty=pick(options.presence_penalty, None, 0.0),
                          max_tokens=options.max_tokens, seed=options.seed)
