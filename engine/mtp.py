"""The MTP draft head (`mtp.*` weights): one extra full-attention decoder layer with its own KV cache,
reusing the target's embedding and lm_head (qwen35-model.md §6).

Row p pairs the target's post-final-norm hidden h_p with the embedding of token x_{p+1}, runs at
rotary position p, and predicts x_{p+2}:
    u   = fc([norm_e(embed(x_{p+1})) | norm_h(h_p)])      # order: embedding first, then hidden
    out = norm(DecoderLayer(u))                            # logits = lm_head(out)
For the j-th chained draft the head feeds its own previous `out` in place of h and the previous
draft as the token, one position further.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.dispatch import Ctx, weight
from mtpchat.engine.model import DecoderLayer, RMSNorm, empty
from mtpchat.kernels import norm


class MTPHead(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = empty(c.hidden_size, 2 * c.hidden_size)
        self.layer = DecoderLayer(c, "full_attention")
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, embed: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor, cache, ctx: Ctx):
        """ids [T] (tokens x_{p+1}), hidden [T, H] (h_p) at ctx.positions p -> out [T, H]."""
        if ctx.plan.head_input:     # the lookup, both norms and their concatenation in one launch
            x = norm.head_input(ids, embed, hidden, self.pre_fc_norm_embedding.weight,
                                self.pre_fc_norm_hidden.weight, self.pre_fc_norm_embedding.eps)
        else:
            e = self.pre_fc_norm_embedding(F.embedding(ids, embed))
            x = torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1)
        # the plan's fc_split: in a step on the GPU the fc's rows (5120 for the 27B: 80 column blocks
        # on 132 SMs) run split over K and finished by the layer's input norm, as the blocks' last
        # products are, rather than one program a block and a norm kernel
        u = (ctx.out_linear if ctx.plan.fc_split else ctx.linear)(x, weight(self, "fc"))
        out, residual = self.layer(u, None, cache, ctx)
        return ctx.add_norm(out, residual, self.norm, whole=True)[0]
