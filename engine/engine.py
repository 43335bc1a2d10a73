"""The Engine API: the only thing the app, the CLI, the tests and the benchmarks use.

The engine sees token ids; the app owns text. One engine holds one conversation's decode state:
`generate` continues from the state of the previous call when the new prompt extends the tokens
already processed (a chat turn), and starts over otherwise.

    engine = Engine.load("path/to/checkpoint", device="cpu", dtype=torch.float32)
    for event in engine.generate(ids, SamplingParams(temperature=0)):
        ...   # Prefilled, then Step per target forward, then Finished (engine/events.py)
    engine.mtp = False          # live: takes effect at the next step
    engine.draft_tokens = 2     # live: 1..k_max (the most drafts a step carries)
    engine.adaptive = True      # live: each step's k chosen by engine/policy.py, at most draft_tokens
    engine.cancel()             # from another thread: generate ends with Finished("cancelled")
"""
from __future__ import annotations

import collections
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from mtpchat.engine.config import GenerationConfig, Int4Format, ModelConfig, UnsupportedFormat, rtn_format
from mtpchat.engine.decoder import Decoder, eager_prefill_length
from mtpchat.engine.draft_vocab import DEFAULT_DRAFT_VOCAB, context_rows, draft_token_ids, draft_vocab_size
from mtpchat.engine.events import Finished, PhaseTimes, Prefilled, Stats, Step, TokenLogprob
from mtpchat.engine.memory import CAPTURED_K, DEFAULT_SNAPSHOTS, K_MAX, prefill_chunk_that_fits
from mtpchat.engine.model import Model, SparseMoE
from mtpchat.engine.mtp import MTPHead
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.policy import AdaptiveK
from mtpchat.engine.runner import Runner
from mtpchat.engine.sampling import SamplingParams, make_generator, token_logprobs
from mtpchat.engine.state import DecodeState
from mtpchat.engine.tokenizer import Tokenizer
from mtpchat.engine.weights import (MTP_PREFIX, STACKED, TEXT_PREFIX, expert_layout, fill_random, has_mtp_weights,
                                    interleave_int4, load_into, mtp_places, text_places, text_prefix)
from mtpchat.kernels.fp8 import fp8_runs_on


DEFAULT_CONTEXT = 4096      # tokens, when Engine.load is given no max_context


def interleave_4bit(*modules) -> None:
    """The 4-bit weights under `modules` (None: skipped) stored interleaved where their layout
    allows (ProductPlan.int4_interleave); an MoE block's all or none."""
    for module in modules:
        if module is not None:
            interleave_int4(module, together=lambda m: isinstance(m, SparseMoE))


def free_memory(device: torch.device) -> int:
    """Bytes an engine could take on `device` as it starts: the device's free memory and what this
    process's allocator holds unused, within the process's memory fraction where one is set (0 for
    the CPU, where nothing is chosen by it)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    fraction = torch.cuda.get_per_process_memory_fraction(index) \
        if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    return min(free + torch.cuda.memory_reserved(index) - allocated, int(fraction * total) - allocated)


class Engine:
    def __init__(self, model: str | Path | ModelConfig, device="cpu", dtype: torch.dtype | None = None,
                 max_context: int | None = None, draft_tokens: int = 3, mtp: bool = True,
                 cuda_graphs: bool = True, k_max: int = K_MAX, prefill_chunk: int | None = None, seed: int = 0,
                 snapshots: int = DEFAULT_SNAPSHOTS, weights: str | None = None, adaptive: bool = False,
                 draft_vocab: int | None = DEFAULT_DRAFT_VOCAB, plan: KernelPlan | None = None,
                 progress=None):
        """`model` is a checkpoint folder, or a ModelConfig for random weights of its shapes (benchmarks;
        no tokenizer then). `max_context` None: DEFAULT_CONTEXT, or what the model supports if less.
        `weights`: None keeps the checkpoint's format (FP8 for an FP8 release, 4 bits for a GPTQ or
        compressed-tensors one); "fp8" stores the big products in block-scaled FP8, quantizing a bf16
        checkpoint as it loads; "int4" stores them in group-scaled 4 bits (kernels/int4.py), as a
        4-bit checkpoint holds them or quantizing a bf16 or FP8 one as it loads (config.rtn_format);
        "bf16" stores them in the model dtype, dequantizing an FP8 or 4-bit checkpoint. `k_max`: the
        most drafts a step may carry (memory.K_MAX, whatever draft_tokens starts at; steps of more than
        CAPTURED_K run eagerly). `adaptive`: each step's k chosen by
        engine/policy.py, draft_tokens its maximum. `draft_vocab`: rows of the trimmed head the drafts
        are chosen from (engine/draft_vocab.py); 0 or None, or a vocabulary no larger than those rows and their
        context rows: the full head. `plan`: the kernels' forms (engine/plan.py); None: the measured
        ones for this device, model and weight format (KernelPlan.choose). `progress`: called with an
        events.LoadProgress as the weights load (and quantize) and as CUDA graphs are captured.
        `prefill_chunk`: tokens a prefill forward takes at most; None: on a GPU what the memory free
        as the engine starts allows (memory.prefill_chunk_that_fits), 512 on the CPU."""
        # build -> load -> allocate state -> (warm up and capture: the CUDA runner)
        self.device = torch.device(device)
        free = free_memory(self.device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.notices: list[str] = []
        if isinstance(model, ModelConfig):
            folder, self.config = None, model
            self.generation_config, self.tokenizer = GenerationConfig(), None
            self.mtp_available = model.has_mtp
        else:
            folder = Path(model)
            self.config = ModelConfig.load(folder)
            self.generation_config = GenerationConfig.load(folder, json.loads((folder / "config.json").read_text()))
            self.tokenizer = Tokenizer.load(folder)
            self.mtp_available = self.config.has_mtp and has_mtp_weights(folder)
        if not self.mtp_available:
            self.notices.append("this checkpoint has no mtp.* weights: running with MTP off")
        supported = self.config.max_position_embeddings
        if max_context is None:
            max_context = min(DEFAULT_CONTEXT, supported)
        elif max_context > supported:
            raise ValueError(f"max_context {max_context:,} is longer than this model supports ({supported:,} tokens)")
        if not 1 <= draft_tokens <= k_max:
            raise ValueError(f"draft_tokens must be between 1 and {k_max}, got {draft_tokens}")
        self.k_max, self.max_context, self.cuda_graphs = k_max, max_context, cuda_graphs
        self._draft_tokens, self._mtp = draft_tokens, mtp and self.mtp_available
        self.policy, self.adaptive = AdaptiveK(k_max), adaptive

        if weights not in (None, "fp8", "int4", "bf16"):
            raise ValueError(f"weights must be 'fp8', 'int4' or 'bf16' (or None: the checkpoint's), got {weights!r}")
        stored = self.config.quantization
        if stored == "int4" and weights == "fp8":
            raise UnsupportedFormat("this checkpoint is in 4 bits: it loads in 4 bits (weights 'int4' or the "
                                    "checkpoint's own) or dequantized (weights 'bf16'), not in FP8")
        # the 4-bit form the products are kept in: the checkpoint's, or quantized as they load
        self.int4: Int4Format | None = None
        if weights == "int4" or (weights is None and stored == "int4"):
            self.int4 = self.config.int4 if stored == "int4" else rtn_format()
        self.fp8 = weights == "fp8" or (weights is None and stored == "fp8")
        if self.fp8 and weights is None and (self.device.type == "cpu" or not fp8_runs_on(self.device)):
            # nothing on the CPU or an Ampere GPU multiplies FP8: dequantized once, not at every product
            where = "the CPU" if self.device.type == "cpu" else "this GPU (FP8 needs compute capability 8.9+)"
            self.notices.append(f"FP8 weights on {where}: dequantized to {str(self.dtype).removeprefix('torch.')} "
                                "as they load")
            self.fp8 = False
        if self.fp8 and not fp8_runs_on(self.device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(self.device)))
            raise UnsupportedFormat(f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                                    f"this one has {cap}: load without weights='fp8'")
        self.plan = plan or KernelPlan.choose(self.device, self.config, self.fp8, weights == "int4",
                                              four_bit=self.int4 is not None)
        # an FP8 or 4-bit model keeps the GDN's bf16 [b | a] apart from its quantized [qkv | z]
        split_ba = self.fp8 or self.int4 is not None
        self.model = Model(self.config, split_ba=split_ba)
        self.head = MTPHead(self.config) if self.mtp_available else None
        prefix = text_prefix(folder) if folder is not None else TEXT_PREFIX
        experts = lambda prefix: expert_layout(folder, prefix) if folder is not None and self.config.is_moe else STACKED
        modules = {"model": self.model}
        places = {"model": text_places(self.config, split_ba=split_ba, experts=experts(prefix), prefix=prefix)}
        if self.head is not None:
            modules["mtp"], places["mtp"] = self.head, mtp_places(self.config, experts(MTP_PREFIX))
        if folder is None:
            fill_random(modules, places, self.device, self.dtype, seed, fp8=self.fp8, int4=self.int4, progress=progress)
        else:
            load_into(modules, places, folder, self.device, self.dtype, fp8=self.fp8, quantized=stored == "fp8",
                      int4=self.int4, stored_int4=self.config.int4, progress=progress)
        if self.plan.products.int4_interleave:
            interleave_4bit(*modules.values())

        self.state = DecodeState(self.config, max_context, k_max, self.device, self.dtype, self.head is not None)
        if not prefill_chunk and self.device.type == "cuda":
            # the format the products are kept in (an FP8 checkpoint dequantized counts as bf16)
            stored = "fp8" if self.fp8 else "int4" if self.int4 is not None else "bf16"
            prefill_chunk = prefill_chunk_that_fits(
                self.config, free, max_context, k_max, self.dtype, self.head is not None, cuda_graphs, snapshots,
                stored, draft_vocab, self.plan.draft_head_int4)
        prefill_chunk = prefill_chunk or 512
        self.decoder = Decoder(self.model, self.head, self.state, self.plan, prefill_chunk, snapshots,
                               four_bit=self.int4 is not None)
        self.draft_vocab = draft_vocab_size(self.config.vocab_size, draft_vocab) if self.head is not None else 0
        if self.draft_vocab:
            ids = draft_token_ids(self.tokenizer, self.config.vocab_size, self.draft_vocab)
            self.decoder.trim_draft_head(ids, context_rows(self.draft_vocab))
        self.runner = None
        if self.device.type == "cuda":
            self.runner = self.decoder.runner = Runner(self.decoder, cuda_graphs)
            with torch.inference_mode():
                self.runner.capture(min(k_max, CAPTURED_K), self.head is not None, SamplingParams(), progress)
        if self.device.type == "cpu" and sum(p.numel() for p in self.model.parameters()) < 100_000_000:
            # small models are a few thousand tiny ops per token: threads cost more than they give
            torch.set_num_threads(1)
        self._cancel = threading.Event()
        # steps in flight at once: two on CUDA (the host reads one while the device runs the next)
        self.pipeline = 2 if self.device.type == "cuda" else 1
        self.time_steps()

    def time_steps(self, steps: int = 4) -> dict[int, float]:
        """Warm-up: the time of a step with each number of drafts, 0..CAPTURED_K, measured here, so that
        the adaptive policy weighs drafts by what they cost on this device from its first step (a
        verify of k+1 rows costs about one decode step on a GPU, several on a CPU). The median of
        `steps` greedy steps each, after one untimed; the decode state is empty again after. (A
        larger k, eager, is timed by the policy when it first runs.) On a GPU a prompt that no graph
        route takes is prefilled first (decoder.eager_prefill_length: 459 tokens on a bf16, FP8 or
        4-bit MoE model, whose first prompt may take the early chunks, 203 on a dense 4-bit one), so
        the eager chunks' own kernels (prefill attention's) compile here, not in the first long turn."""
        top = min(self.k_max, CAPTURED_K)
        need = (top + 1) * (steps + 1) + 32
        if self.head is None or need >= self.max_context:
            return {}
        params, dec = SamplingParams(max_tokens=need, stop_token_ids=()), self.decoder
        p = self.plan
        eager = eager_prefill_length(dec.R, p.step_prefill, p.prefill_graphs, p.prefill_pieces, p.prefill_early,
                                     p.prefill_early_rows, p.prefill_early_beside)
        prompt = torch.randint(0, self.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
        with torch.inference_mode():
            if self.device.type == "cuda" and eager < self.max_context:
                dec.reset()
                dec.begin(torch.randint(0, self.config.vocab_size, (eager,),
                                        generator=torch.Generator().manual_seed(1)).tolist())
            for k in range(top + 1):
                dec.reset()
                dec.begin(prompt)             # (no draft_context: the warm-up's tokens take no context rows)
                dec.first_token(params, None)
                dec.limit(need, set())
                ms = []
                for i in range(steps + 1):
                    result = dec.step(k, params, None)
                    ms.append(result.times.draft + result.times.verify + result.times.accept)
                self.policy.step_ms[k] = statistics.median(ms[1:])
        dec.reset()
        return dict(self.policy.step_ms)

    @classmethod
    def load(cls, model: str | Path | ModelConfig, **options) -> "Engine":
        """The documented entry point; the same as calling Engine(model, **options)."""
        return cls(model, **options)

    # --- live switches -------------------------------------------------------------------------
    @property
    def mtp(self) -> bool:
        return self._mtp

    @mtp.setter
    def mtp(self, on: bool):
        if on and not self.mtp_available:
            return  # said once at load (notices); MTP simply stays off
        self._mtp = bool(on)

    @property
    def draft_tokens(self) -> int:
        return self._draft_tokens

    @draft_tokens.setter
    def draft_tokens(self, k: int):
        if not 1 <= k <= self.k_max:
            raise ValueError(f"draft_tokens must be between 1 and {self.k_max}, got {k}")
        self._draft_tokens = int(k)

    @property
    def drafter(self):
        """A ProfileDrafter (engine/spec.py) that replaces the head's draft tokens, or None."""
        return self.decoder.drafter

    @drafter.setter
    def drafter(self, drafter):
        self.decoder.drafter = drafter

    def cancel(self):
        self._cancel.set()

    def reset(self):
        self.decoder.reset()

    def memory(self) -> dict[str, int]:
        size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters()) if m is not None else 0
        draft = self.decoder.draft_rows.nbytes() if self.decoder.draft_rows is not None else 0   # its own copy
        return {"weights": size(self.model) + size(self.head) + draft, **self.state.nbytes(),
                "graph_pool": self.runner.pool_bytes if self.runner else 0, "workspace": self.decoder.nbytes(),
                "snapshots": self.decoder.snapshots.nbytes()}

    @property
    def weight_format(self) -> str:
        """How the big products are stored: "fp8", "int4", or the model dtype ("bf16", "float32", ...)."""
        if self.int4 is not None:
            return "int4"
        if self.fp8:
            return "fp8"
        name = str(self.dtype).removeprefix("torch.")
        return {"bfloat16": "bf16", "float16": "fp16"}.get(name, name)

    @property
    def moe_layers(self) -> int:
        """The target's MoE layers (0 for a dense model): Step.experts_read / this = experts per layer."""
        return self.config.num_hidden_layers if self.config.is_moe else 0

    @property
    def stop_ids(self) -> tuple[int, ...]:
        if self.generation_config.eos_token_ids or self.tokenizer is None:
            return self.generation_config.eos_token_ids
        return tuple(self.tokenizer.eos_token_ids)

    # --- inference -----------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """A full forward from an empty state, separate from the conversation: [T, vocab] float32."""
        scratch = DecodeState(self.config, len(ids), self.k_max, self.device, self.dtype, mtp=False)
        # eager chunks (no graphs of its own to replay), the engine's expert counters left alone
        plan = self.plan.replace(step_prefill=0, prefill_graphs=(), prefill_early=())
        decoder = Decoder(self.model, None, scratch, plan, self.decoder.prefill_chunk, count_experts=False)
        return decoder.logits(decoder.prefill(ids, keep_all=True), rowwise=False)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 snapshot_at: tuple[int, ...] = ()) -> Iterator:
        """Prefilled, Steps, Finished (engine/events.py). `snapshot_at`: positions in the prompt where
        the decode state is worth keeping for a later turn (the end of the rendered conversation
        before the generation prompt); the state at the end of the reply is kept too."""
        params = params or SamplingParams()
        with torch.inference_mode():
            yield from self._generate(list(prompt_ids), params, tuple(snapshot_at))

    def _generate(self, prompt: list[int], params: SamplingParams, snapshot_at: tuple[int, ...]):
        self._cancel.clear()
        dec, stats = self.decoder, Stats(prompt_tokens=len(prompt), moe_layers=self.moe_layers)
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else self.stop_ids)
        if not prompt:
            raise ValueError("the prompt is empty: pass at least one token id")
        if len(prompt) + 1 > self.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens but max_context is {self.max_context}; "
                             "start a new chat or load the model with a larger --max-context")
        generator = make_generator(params, self.device)
        t0 = time.perf_counter()
        cached = dec.begin(prompt, snapshot_at)
        dec.draft_context(prompt)
        first = dec.first_token(params, generator)
        stats.prefill_ms = stats.ttft_ms = (time.perf_counter() - t0) * 1e3
        stats.reused_tokens = cached
        yield Prefilled(prompt_tokens=len(prompt), prefill_ms=stats.prefill_ms, cached_tokens=cached)

        out = [first]
        stats.new_tokens = 1
        yield Step((first,), (False,), 0, 0, False, PhaseTimes(), stats.prefill_ms,
                   logprobs=self._logprobs(dec.last_logits, [first], params))
        t_first = time.perf_counter()
        dec.limit(min(params.max_tokens - 1, self.max_context - 1 - dec.length), stop)
        # Steps commit on the device and stop there by themselves (engine/decoder.py), so the next one
        # is launched before the last one is read: the device never waits for the host. A drafter
        # that reads the host's position (tests) needs each step read before the next.
        on_device = self.decoder.drafter is None or getattr(self.decoder.drafter, "on_device", False)
        # logprobs read a step's logits (decoder.v_logits) before the next step overwrites them
        depth = self.pipeline if on_device and params.logprobs is None else 1
        flight: collections.deque = collections.deque()
        reason = self._finish_reason(out[-1], stats.new_tokens, params, stop)
        try:
            while True:
                while reason is None and len(flight) < depth:
                    # what the steps in flight may still emit, at most: this one must fit after them
                    room = min(params.max_tokens - stats.new_tokens, self.max_context - 1 - dec.length)
                    room -= sum(s.k + 1 for s in flight)
                    k, why = self._draft_tokens, ""
                    if self._mtp and self.adaptive:
                        k, why = self.policy.choose(k)
                    k = max(min(k, room - 1, self.k_max), 0) if self._mtp else 0
                    if room < 1 or (flight and dec.needs_flush(k, [s.k for s in flight])):
                        break
                    flight.append(dec.launch(k, params, generator))
                    flight[-1].why = why
                    if why:
                        self.policy.launched(k, why)
                if not flight:
                    break
                launched = flight.popleft()
                result = dec.finish(launched)
                if not result.tokens:
                    continue                    # launched after the generation ended on the device
                k = launched.k
                stats.steps += 1
                stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1
                # what the policy learns: a window cut by a stop id or the token limit says nothing of acceptance
                full = len(result.tokens) > result.accepted
                self.policy.observe(k, result.accepted if full else None, result.times, self._draft_tokens)
                if k:
                    stats.verify_steps += 1
                    stats.drafted += k
                    stats.accepted += result.accepted
                    while len(stats.accepted_at_least) < k:
                        stats.accepted_at_least.append(0)
                    for i in range(result.accepted):
                        stats.accepted_at_least[i] += 1
                stats.count_experts(k, *result.experts_read)
                p = stats.phase_ms
                stats.phase_ms = PhaseTimes(p.draft + result.times.draft, p.verify + result.times.verify,
                                            p.accept + result.times.accept, p.host + result.times.host)
                out += result.tokens
                dec.draft_context(result.tokens)
                stats.new_tokens += len(result.tokens)
                stats.decode_ms = (time.perf_counter() - t_first) * 1e3
                reason = reason or self._finish_reason(out[-1], stats.new_tokens, params, stop)
                yield Step(tuple(result.tokens), tuple(result.from_draft), k, result.accepted, bool(k),
                           result.times, (time.perf_counter() - t0) * 1e3, why=launched.why,
                           experts_read=result.experts_read[0], draft_experts_read=result.experts_read[1],
                           logprobs=self._logprobs(dec.v_logits[:len(result.tokens)], result.tokens, params))
        finally:
            while flight:                       # abandoned mid-way: keep the host's mirror exact
                dec.finish(flight.popleft())
        stats.decode_ms = (time.perf_counter() - t_first) * 1e3
        dec.snapshot()                          # the end of the reply, for a turn that goes on from it
        yield Finished(reason, stats, tuple(out))

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams):
        """Where asked for: each emitted token's logprob under the target's raw distribution, from
        the logits that chose it (the emitted tokens of a step are its verify rows 0..n-1: row i
        predicts the token after the i-th token fed). A host sync per step."""
        if params.logprobs is None:
            return None
        return tuple(TokenLogprob(t, lp, tuple(top))
                     for t, (lp, top) in zip(tokens, token_logprobs(logits, tokens, params.logprobs)))

    def _finish_reason(self, last: int, produced: int, params: SamplingParams, stop: set[int]) -> str | None:
        if last in stop:
            return "stop"
        if produced >= params.max_tokens:
            return "length"
        if self._cancel.is_set():
            return "cancelled"
        if self.decoder.length + 1 >= self.max_context:
            return "context"
        return None
