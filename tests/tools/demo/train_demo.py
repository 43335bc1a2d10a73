"""Train the demo checkpoint shipped in assets/demo: a small model of the Qwen3.5 hybrid architecture
(Gated DeltaNet and gated full-attention layers) with its MTP head, on the source text of Python's
own standard library (PSF licence), with a byte-level BPE tokenizer trained on the same text.

    PYTHONPATH=tests python -m tools.demo.train_demo --out assets/demo --device cuda --seed 0 --steps N

The corpus: every .py file under the standard library of the running Python, tests and data tables
left out, in sorted order; a fixed few percent of the files (by a hash of their path) is held out
for evaluation. Besides the raw files it holds chat turns built from the same files (the user gives
a function's docstring, the assistant thinks one line and writes the function; two turns in three
with thinking on), in the exact token layout of the chat template, so the app's chat prompts lead
somewhere familiar.

The model is trained in float32 on batches of packed windows. The MTP head learns what the engine
asks of it (engine/mtp.py): row p pairs the post-norm hidden h_p with the embedding of x_{p+1} and
predicts x_{p+2}; a second pass feeds the head its own output in place of h, as the engine chains
it for drafts 2..k. Its loss mixes cross-entropy on the true token with a KL term towards the
target's own next-token distribution (what verification compares against).

The forward used for training is `batched` (tests/tools/demo/forward.py): the engine's modules and
parameters, with the batch folded into the GDN heads and conv channels so one call of each float32
reference kernel serves the whole batch. `check_batched` verifies it against the engine's own Model / MTPHead
forward (through a DecodeState), outputs and gradients, before training starts.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.model import Model
from mtpchat.engine.mtp import MTPHead
from mtpchat.engine.weights import mtp_places, random_tensor, text_places
from tools.bpe import write_tokenizer_files
from tools.demo.corpus import build_corpus, heldout, stdlib_root
from tools.demo.forward import batched, engine_forward
from tools.tiny import text_config

# 8 layers, full attention at 3 and 7; GDN with Hv/Hk = 2; tied head. About 8M parameters, 16 MB in
# bf16 (one shard under 16 MiB).
SHAPE = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
VOCAB = 4096                 # BPE ids + Qwen's added tokens
# --- model -----------------------------------------------------------------------------------------

def demo_config(tok, vocab: int) -> dict:
    special = {name: tok.token_to_id(name) for name in ("<|endoftext|>", "<|image_pad|>", "<|video_pad|>")}
    text = text_config(vocab, tie=True, mtp=True, special=special, **SHAPE)
    half = int(SHAPE["head_dim"] * 0.25) // 2              # split as the official [11, 11, 10] splits 32
    third = -(-half // 3)
    text["rope_parameters"]["mrope_section"] = [third, third, half - 2 * third]
    text["dtype"] = "bfloat16"
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": True, "text_config": text,
            "image_token_id": special["<|image_pad|>"], "video_token_id": special["<|video_pad|>"]}


def init_tensor(name: str, shape: tuple[int, ...], g: torch.Generator, layers: int) -> torch.Tensor:
    """The engine's random init (engine/weights.py random_tensor), adjusted for training: a small tied
    embedding (it is also the head), residual-branch outputs scaled down with depth, and Mamba-style
    decay rates (dt in [1e-3, 0.1]) so the GDN state starts with a memory of tens of tokens rather
    than one."""
    t = random_tensor(name, shape, g)
    if name.endswith("embed_tokens.weight"):
        return t * 0.02
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
        return t / math.sqrt(2 * layers)
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
        return dt + torch.log(-torch.expm1(-dt))        # softplus(dt_bias) = dt
    return t


def build(c: ModelConfig, seed: int) -> tuple[Model, MTPHead]:
    """The engine's modules with real, trainable float32 parameters, laid out through the same
    name -> (parameter, row offset) tables the loader uses."""
    g = torch.Generator().manual_seed(seed)
    model, head = Model(c), MTPHead(c)
    for module, places in ((model, text_places(c)), (head, mtp_places(c))):
        params = {name: torch.empty(p.shape) for name, p in module.named_parameters()}
        for name, place in places.items():
            dest = params[place.param]
            t = init_tensor(name, place.shape, g, c.num_hidden_layers)
            dest[place.offset:place.offset + place.shape[0]] = t.reshape(-1, *dest.shape[1:])
        for name, t in params.items():
            _set(module, name, nn.Parameter(t))
    return model, head


def _set(module: nn.Module, name: str, value):
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, value)


def export(folder: Path, model: Model, head: MTPHead, config: dict, raw_tok) -> int:
    """The official layout: bf16 safetensors (one shard and its index), config.json with
    text_config, generation_config.json, tokenizer files and chat template. Returns the bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer_files(folder, raw_tok)
    c = ModelConfig.from_dict(config)
    tensors = {}
    for module, places in ((model, text_places(c)), (head, mtp_places(c))):
        params = dict(module.named_parameters())
        for name, place in places.items():
            t = params[place.param].detach()[place.offset:place.offset + place.shape[0]]
            tensors[name] = t.reshape(place.shape).to(torch.bfloat16).cpu().contiguous()
    shard = "model-00001-of-00001.safetensors"
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {n: shard for n in tensors}}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
         "pad_token_id": special["<|endoftext|>"], "do_sample": True, "temperature": 0.6,
         "top_k": 20, "top_p": 0.95}, indent=2))
    return total


# --- losses, check, training -----------------------------------------------------------------------

MTP_WEIGHT = 0.3     # of the head's losses in the total; they reach the shared trunk and embedding


def losses(model: Model, h, out1, out2, ids) -> dict[str, torch.Tensor]:
    """Target cross-entropy; for the head (both passes) cross-entropy on the true token and KL towards
    the target's own distribution for the same token; and top-1 agreement with the target."""
    T = h.shape[1]
    logits = F.linear(h, model.head).float()                                   # row p predicts x_{p+1}
    teacher = logits.detach().log_softmax(-1)
    d1 = F.linear(out1, model.head).float().log_softmax(-1)                    # row p predicts x_{p+2}
    d2 = F.linear(out2, model.head).float().log_softmax(-1)                    # row p predicts x_{p+3}
    nll = lambda lp, y: F.nll_loss(lp.flatten(0, 1), y.flatten())
    kl = lambda lp, t: F.kl_div(lp, t, log_target=True, reduction="none").sum(-1).mean()
    agree = lambda lp, t: (lp.argmax(-1) == t.argmax(-1)).float().mean()
    out = {"main": F.cross_entropy(logits.flatten(0, 1), ids[:, 1:T + 1].flatten()),
           "mtp1": nll(d1, ids[:, 2:T + 2]), "mtp2": nll(d2, ids[:, 3:T + 2]),
           "kl1": kl(d1[:, :-1], teacher[:, 1:]), "kl2": kl(d2[:, :-1], teacher[:, 2:]),
           "agree1": agree(d1[:, :-1], teacher[:, 1:]), "agree2": agree(d2[:, :-1], teacher[:, 2:])}
    mtp = (out["mtp1"] + out["kl1"]) / 2 + (out["mtp2"] + out["kl2"]) / 4
    out["total"] = out["main"] + MTP_WEIGHT * mtp
    return out


def check_batched(model: Model, head: MTPHead, ids: torch.Tensor, tol: float = 1e-4):
    """`batched` against the engine's forward, one sequence at a time: hidden states and gradients
    (float32, on the CPU, where the engine's kernels are the references)."""
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    params = [p for m in (model, head) for p in m.parameters()]
    grads = []
    for fn in (lambda: batched(model, head, ids),
               lambda: [torch.stack(t) for t in zip(*(engine_forward(model, head, row) for row in ids))]):
        for p in params:
            p.grad = None
        hs = fn()
        losses(model, *hs, ids)["total"].backward()
        grads.append(([h.detach() for h in hs], [p.grad.clone() for p in params]))
    (ours, g_ours), (ref, g_ref) = grads
    worst = max(rel(a, b) for a, b in zip(ours, ref))
    worst_grad = max(rel(a, b) for a, b in zip(g_ours, g_ref))
    missing = sum(not g.abs().sum() > 0 for g in g_ref)
    print(f"check: batched vs engine forward, hidden rel err {worst:.1e}, gradient rel err {worst_grad:.1e}, "
          f"{missing} parameters without gradient", flush=True)
    if worst > tol or worst_grad > 10 * tol or missing:
        raise SystemExit("the batched training forward does not match the engine's forward")
    for p in params:
        p.grad = None


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def windows(ids: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate_loss(model, head, held: torch.Tensor, device) -> dict[str, float]:
    out = losses(model, *batched(model, head, held.to(device)), held.to(device))
    return {k: v.item() for k, v in out.items()}


def train(model, head, train_ids, held, args, device) -> dict:
    params = [p for m in (model, head) for p in m.parameters()]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(args.seed)
    L, total, warmup = args.seq + 2, args.steps, 100
    t0, timed, step, log = time.perf_counter(), None, 0, {}
    print(f"training: batch {args.batch} x {args.seq} tokens, peak lr {args.lr}, "
          f"{'steps ' + str(total) if total else f'{args.minutes} minutes'}", flush=True)
    while total is None or step < total:
        if step == 3:
            timed = time.perf_counter()
        if total is None and step == 13:   # from the time of 10 steps, inside the warm-up (lr independent of total)
            per = (time.perf_counter() - timed) / 10
            total = max(step + 1, int((args.minutes * 60 - (time.perf_counter() - t0)) / per) + step)
            print(f"  {per * 1e3:.0f} ms per step: {total} steps in the time budget", flush=True)
            continue
        lr = lr_at(step, total or 10 ** 9, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = windows(train_ids, torch.randint(0, train_ids.numel() - L, (args.batch,), generator=g), L).to(device)
        out = losses(model, *batched(model, head, batch), batch)
        opt.zero_grad(set_to_none=True)
        out["total"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == total:
            held_loss = evaluate_loss(model, head, held, device) if step % (args.log_every * 4) == 0 or step == total else None
            elapsed = time.perf_counter() - t0
            line = (f"  step {step:5d}  lr {lr:.2e}  loss {out['main'].item():.3f}  mtp1 {out['mtp1'].item():.3f}  "
                    f"mtp2 {out['mtp2'].item():.3f}  agree1 {out['agree1'].item():.3f}  agree2 {out['agree2'].item():.3f}  "
                    f"{step * args.batch * args.seq / elapsed:,.0f} tok/s  {elapsed:.0f} s")
            if held_loss:
                line += (f"  | held-out loss {held_loss['main']:.3f} mtp1 {held_loss['mtp1']:.3f} "
                         f"mtp2 {held_loss['mtp2']:.3f} agree1 {held_loss['agree1']:.3f}")
                log = {"step": step, "train": {k: round(v.item(), 4) for k, v in out.items()},
                       "held_out": {k: round(v, 4) for k, v in held_loss.items()}}
            print(line, flush=True)
        if args.steps is None and time.perf_counter() - t0 > args.minutes * 60 * 1.5:
            print(f"  stopped at step {step} of {total}: past 1.5x the time budget", flush=True)
            break
    log["steps"], log["seconds"] = step, round(time.perf_counter() - t0, 1)
    return log


# --- evaluation through the engine -----------------------------------------------------------------

def acceptance(engine, prompts: list[list[int]], k: int = 3, tokens: int = 64, temperature: float = 0.0) -> float:
    """Mean acceptance length (tokens per target forward) over the prompts, `tokens` new tokens each."""
    from mtpchat.engine import SamplingParams
    from mtpchat.engine.events import Finished
    engine.mtp, engine.draft_tokens = True, k
    accepted = steps = 0
    for ids in prompts:
        engine.reset()
        params = SamplingParams(temperature=temperature, max_tokens=tokens, stop_token_ids=(), seed=0)
        for event in engine.generate(ids, params):
            if isinstance(event, Finished):
                accepted, steps = accepted + event.stats.accepted, steps + event.stats.verify_steps
    return 1.0 + accepted / max(1, steps)


def complete(engine, ids: list[int], tokens: int = 64, mtp: bool = True) -> list[int]:
    from mtpchat.engine import SamplingParams
    from mtpchat.engine.events import Finished
    engine.mtp = mtp
    engine.reset()
    for event in engine.generate(ids, SamplingParams(max_tokens=tokens)):
        if isinstance(event, Finished):
            return list(event.token_ids)


def report(folder: Path, model, head, held: torch.Tensor) -> dict:
    """Load the written checkpoint with the engine on the CPU (float32, as the tests do): its
    logits against the training model's, then held-out acceptance and two samples."""
    from mtpchat.engine import Engine
    engine = Engine.load(folder, device="cpu", dtype=torch.float32, max_context=1024)
    ids = held[0, :256]
    with torch.no_grad():
        h, _, _ = batched(model, head, ids[None].to(model.embed.device))
        ours = F.linear(h[0], model.head).float().cpu()
    theirs = engine.logits(ids[:-2].tolist())
    same = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in heldout(8)]
    chats = [tok.apply_chat_template([{"role": "user", "content": r}]) for r in heldout(8, chat=True)]
    out = {"engine_argmax_agreement": round(same, 4),
           "acceptance_k3_code": round(acceptance(engine, prompts), 3),
           "acceptance_k3_chat": round(acceptance(engine, chats), 3),
           "acceptance_k3_code_t0.6": round(acceptance(engine, prompts, temperature=0.6), 3),
           "acceptance_k1_code": round(acceptance(engine, prompts, k=1), 3),
           "acceptance_k2_code": round(acceptance(engine, prompts, k=2), 3)}
    print(f"engine (CPU, float32) on the written checkpoint: argmax agreement with training {same:.4f}", flush=True)
    for key, value in out.items():
        print(f"  {key}: {value}")
    print("sample, raw 'def ':\n" + tok.decode(complete(engine, tok.encode("def "))), flush=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "Return the number of lines in a text file."}])
    print("sample, chat:\n" + tok.decode(complete(engine, chat, 96)), flush=True)
    if same < 0.9:
        raise SystemExit("the written checkpoint does not reproduce the trained model")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="PYTHONPATH=tests python -m tools.demo.train_demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/demo", help="checkpoint folder to write (default: assets/demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=4.0, help="time budget when --steps is not given")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the schedule: reproducible)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (quick runs)")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device(args.device)
    t0 = time.perf_counter()
    raw, tok, train_ids, held_ids = build_corpus(stdlib_root(), VOCAB, args.seed, args.max_files)
    config = demo_config(raw, 64 * math.ceil(tok.vocab_size / 64))
    c = ModelConfig.from_dict(config)
    model, head = build(c, args.seed)
    n_model, n_head = (sum(p.numel() for p in m.parameters()) for m in (model, head))
    print(f"model: {n_model:,} parameters + MTP head {n_head:,}; vocab {c.vocab_size}; layers {list(c.layer_types)}; "
          f"corpus ready in {time.perf_counter() - t0:.0f} s", flush=True)
    check_batched(model, head, train_ids[:2 * 132].view(2, 132))
    model.to(device), head.to(device)
    L = args.seq + 2
    n_held = min(16, held_ids.numel() // L)
    held = windows(held_ids, torch.linspace(0, held_ids.numel() - L, n_held).long(), L)
    log = train(model, head, train_ids, held, args, device)
    folder = Path(args.out)
    size = export(folder, model, head, config, raw)
    print(f"wrote {folder}: {size / 1e6:.1f} MB of bf16 weights", flush=True)
    log |= {"report": report(folder, model, head, held), "python": sys.version.split()[0],
            "torch": torch.__version__, "args": vars(args),
            "command": f"PYTHONPATH=tests python -m tools.demo.train_demo --out {args.out} --seed {args.seed} "
                       f"--steps {log['steps']} --batch {args.batch} --seq {args.seq} --lr {args.lr}"}
    print("result: " + json.dumps(log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
