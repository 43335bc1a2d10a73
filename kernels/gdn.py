"""Gated DeltaNet: the recurrence (decode / verify, with per-token state snapshots) and its chunked
form (prefill). These are the float32 torch references; the engine runs them on the CPU.

Shapes (one sequence): q, k [T, Hk, dk]; v [T, Hv, dv]; a, b [T, Hv]; A_log, dt_bias [Hv];
states [Hv, dk, dv] float32 (the dk x dv layout of transformers and fla). V head j reads Q/K head
j // (Hv // Hk). Per token, with g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b):
    S = exp(g) * S ;  S = S + k ⊗ beta * (v - Sᵀk) ;  o = Sᵀ q        (q, k l2-normalised, q * dk^-0.5)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """[T, Hv] a, b -> (g, beta) float32; g <= 0 is the log decay, beta in (0, 1) the write strength."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, a, b, A_log, dt_bias):
    """Normalise q/k, expand them to the value heads and compute the gates; all float32, heads first."""
    group = v.shape[1] // k.shape[1]
    q = l2norm(q).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5   # [T, Hv, dk]
    k = l2norm(k).repeat_interleave(group, dim=1)                          # [T, Hv, dk]
    g, beta = gates(a, b, A_log, dt_bias)                                   # [T, Hv]
    return q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1), g.T, beta.T


def recurrent_ref(q, k, v, a, b, A_log, dt_bias, ring: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """T = 1..k+1 tokens through the recurrence, starting from ring[slot].

    ring [S, Hv, dk, dv] float32 holds the snapshot slots; the state after token t is written to
    ring[t] (so slot t is the state with t+1 of these tokens consumed). `slot` is a 1-element long
    tensor, read before any write. Returns o [T, Hv, dv] in v's dtype.
    """
    T = q.shape[0]
    assert ring.dtype == torch.float32 and T <= ring.shape[0], "ring must be float32 with >= T slots"
    q, k, v, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias)   # [Hv, T, *]
    S = ring.index_select(0, slot)[0]                              # [Hv, dk, dv]
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", S, k[:, t])                # what the state recalls for k
        delta = beta[:, t, None] * (v[:, t] - pred)                  # [Hv, dv]
        S = S + k[:, t, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[:, t]))
        ring[t] = S
    return torch.stack(out).to(v.dtype if v.dtype != torch.float32 else torch.float32)


def chunk_ref(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, chunk: int = 64):
    """The same recurrence over a long sequence, `chunk` tokens at a time in closed (WY) form.

    state [Hv, dk, dv] float32 is the initial state. Returns (o [T, Hv, dv] in v's dtype, final state).
    Within a chunk with cumulative log decay G_t and start state S0, the delta-rule writes w_j solve
        w_j + sum_{i<j} beta_j e^{G_j-G_i} (k_j·k_i) w_i = beta_j (v_j - e^{G_j} S0ᵀ k_j)
    (a unit lower-triangular system), then o_t = e^{G_t} S0ᵀ q_t + sum_{j<=t} e^{G_t-G_j} (q_t·k_j) w_j
    and S_end = e^{G_C} S0 + sum_j e^{G_C-G_j} k_j w_jᵀ.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias)   # [Hv, T, *]
    T = q.shape[1]
    S = state.float()
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc = q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk]
        G = g[:, s:s + chunk].cumsum(-1)                                   # [Hv, C]
        C = G.shape[1]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # e^{G_t - G_j} for j <= t, 0 above the diagonal (masked before exp: the exponent is > 0 there)
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()   # [Hv, C, C]
        kk = kc @ kc.transpose(-1, -2)                                     # [Hv, C, C]
        lower = (beta[:, s:s + chunk, None] * kk * decay).tril(-1)
        eye = torch.eye(C, device=q.device)
        rhs = beta[:, s:s + chunk, None] * (vc - G.exp()[..., None] * (kc @ S))
        w = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)  # [Hv, C, dv]
        o = G.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ w
        outs.append(o)
        tail = (G[:, -1:] - G).exp()                                       # e^{G_C - G_j}, [Hv, C]
        S = G[:, -1].exp()[:, None, None] * S + (kc * tail[..., None]).transpose(-1, -2) @ w
    o = torch.cat(outs, dim=1).transpose(0, 1)                             # [T, Hv, dv]
    return o.to(out_dtype), S
