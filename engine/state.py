"""Decode state, allocated once for `max_context` tokens, typed per layer, rolled back explicitly.

- full attention: K and V caches [max_context, Hkv, D]; rollback = a length that does not advance.
- GDN: a conv window [conv_dim, K-1 + k_max+1] (model dtype), a ring whose committed K-1 columns
  start at `conv_off` (kernels/conv.py); the recurrent state [Hv, dk, dv] (float32) before the last step's tokens, and those
  tokens as the recurrence used them (pend [2, k_max+1, Hv, dk+dv+2], the last step's in half
  `parity`). Accepting n tokens adds n to the conv offset and commits `fold` n: the next step (or prefill)
  folds those n into the state before its own tokens (kernels/gdn.py), so a verify of T tokens
  writes one state, not T, and nothing is copied at acceptance. A decode step writes the state
  after its one token (always accepted) and commits `fold` 0.
- the MTP head's own K and V caches.
`conv_off`, `fold` and `parity` are device tensors shared by all GDN layers; `length` (committed
tokens) is mirrored on the host.
"""
from __future__ import annotations

import torch

from mtpchat.engine.config import ModelConfig
from mtpchat.kernels import gdn


class DecodeState:
    def __init__(self, c: ModelConfig, max_context: int, k_max: int, device, dtype, mtp: bool):
        self.k_max = k_max
        self.conv_width = c.linear_conv_kernel_dim - 1 + k_max + 1
        # rows of the KV caches: a step may write up to k_max+1 rows past the last position
        self.rows = rows = max_context + k_max + 1
        kv = lambda: (torch.zeros(rows, c.num_key_value_heads, c.head_dim, device=device, dtype=dtype),
                      torch.zeros(rows, c.num_key_value_heads, c.head_dim, device=device, dtype=dtype))
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        # the GDN layers' recurrent states and kept tokens, each one tensor with a layer a row, so
        # that one launch may fold every layer (kernels/gdn.py fold_pending_layers); a layer's own
        # are views of its row, each row 256-byte aligned as a tensor of its own would be (a kernel
        # compiled for an aligned pointer is the one every layer takes)
        n = sum(kind != "full_attention" for kind in c.layer_types)
        self.gdn_states = _rows((n, hv, dk, dv), device)
        self.gdn_pends = _rows((n, 2, k_max + 1, hv, gdn.pending_width(dk, dv)), device)
        # indexed, not iterated: iterating a tensor unbinds it, and views that come out of one call
        # together may not be written in place once autograd is on (a caller's training loop)
        gdn_rows = iter([(self.gdn_states[i], self.gdn_pends[i]) for i in range(n)])
        gdn_state = lambda: (torch.zeros(c.conv_dim, self.conv_width, device=device, dtype=dtype), *next(gdn_rows))
        self.kernel = c.linear_conv_kernel_dim
        self.layers = [kv() if kind == "full_attention" else gdn_state() for kind in c.layer_types]
        self.gdn_layers = [cache for kind, cache in zip(c.layer_types, self.layers) if kind != "full_attention"]
        self.kv_layers = [cache for kind, cache in zip(c.layer_types, self.layers) if kind == "full_attention"]
        self.mtp = kv() if mtp else None
        self.conv_off = torch.zeros(1, dtype=torch.long, device=device)
        self.fold = torch.zeros(1, dtype=torch.long, device=device)
        self.parity = torch.zeros(1, dtype=torch.long, device=device)
        self.length = 0

    def reset(self):
        """Forget the sequence: zero the GDN states (the KV caches are masked by length)."""
        for layer in self.gdn_layers:
            for t in layer:
                t.zero_()
        for t in (self.conv_off, self.fold, self.parity):
            t.zero_()
        self.length = 0

    def gdn_committed(self, model, any_stride: bool = False) -> list[torch.Tensor]:
        """Each GDN layer's recurrent state with every committed token run in (copies, for tests),
        by the kernel a step folds them with (in the plan's form: KernelPlan.any_stride). `model`:
        the Model whose layers these are."""
        mixers = [layer.mixer for layer in model.layers if layer.kind != "full_attention"]
        out = []
        for (_, state, pend), m in zip(self.gdn_layers, mixers):
            s = state.clone()
            gdn.fold_pending(s, pend, self.fold, self.parity, m.A_log, m.dt_bias, any_stride)
            out.append(s)
        return out

    def commit_prefill(self, T: int):
        """After a prefill chunk of T tokens (steps commit on the device: engine/decoder.py): the
        conv call wrote its inputs past the window, so the window moves on by T (kernels/conv.py)."""
        self.conv_off.add_(T)
        self.length += T

    def commit_step(self, T: int):
        """After a forward of T tokens in the step form that keeps them all (a short prefill,
        engine/decoder.py): what an acceptance of T tokens commits (kernels/accept.py commit_ref),
        a decode's one token folded by its own kernel, a verify's by the next forward."""
        self.conv_off.add_(T)
        if T > 1:
            self.fold.fill_(T)
            self.parity.copy_(1 - self.parity)
        else:
            self.fold.zero_()
        self.length += T

    def nbytes(self) -> dict[str, int]:
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        return {"kv": size(t for pair in self.kv_layers for t in pair),
                "mtp_kv": size(self.mtp) if self.mtp else 0,
                "gdn_state": size(t for layer in self.gdn_layers for t in layer)}


def _rows(shape: tuple, device, align: int = 64) -> torch.Tensor:
    """Zeros of float32 `shape`, its first axis' rows each `align` floats aligned (padded between),
    the rest of each row contiguous."""
    inner = [1]
    for d in reversed(shape[1:]):
        inner.insert(0, inner[0] * d)            # inner[0]: a row's size, then each axis' stride
    row = -(-inner[0] // align) * align
    return torch.zeros(shape[0] * row, device=device, dtype=torch.float32).as_strided(shape, (row, *inner[1:]))
