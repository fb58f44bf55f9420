"""Additive attention (Fastformer, non-causal): tokens interact only through two pooled vectors per head.

Per head j, with d = C / heads channels:
    α = softmax over tokens of query_att(q)_j / √d,   g_q = Σ_i α_i q_i      (the head's channels)
    p_i = k_i ⊙ g_q,
    β = softmax over tokens of key_att(p)_j / √d,     g_k = Σ_i β_i p_i
    u_i = g_k ⊙ v_i,   o_i = transform(u_i) + q_i,
then the grouping's `proj`. The scores of every head come from the full C-channel vectors (`query_att`,
`key_att`: Linear(C, heads)). The cost is linear in the number of tokens; no token-by-token matrix is formed.

Departure from the reference code: there the value is the query (parameter sharing); here the value is the
separate third of the `qkv` projection, so every attention of the zoo keeps one `qkv` Linear(C, 3C). The
Linear layers keep PyTorch's default initialisation unless a backbone re-initialises them.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layout import Grid
from .mixer import Mixer, MixContext
from .registry import register_attention

__all__ = ['additive_pool', 'additive_attention', 'AdditiveMixer']


def additive_pool(x: Tensor, logits: Tensor) -> Tensor:
    """x: (B, n, C), logits: (B, n, heads) -> (B, 1, C).

    Each head's channels of x averaged over the n tokens with the softmax over tokens of the head's logits. The
    softmax and the sum run in at least float32.
    """
    B, n, C = x.shape
    heads = logits.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)
    weights = logits.to(work).softmax(dim=1)
    pooled = (weights.unsqueeze(-1) * x.to(work).view(B, n, heads, C // heads)).sum(dim=1)
    return pooled.reshape(B, 1, C).to(x.dtype)


def additive_attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        query_att_weight: Tensor,
        query_att_bias: Optional[Tensor],
        key_att_weight: Tensor,
        key_att_bias: Optional[Tensor],
        transform_weight: Tensor,
        transform_bias: Optional[Tensor],
) -> Tensor:
    """q, k, v: (B, n, C); `*_att_weight`: (heads, C); `transform_weight`: (C, C) -> (B, n, C).

    The number of heads is the number of rows of the score weights.
    """
    scale = (q.shape[-1] // query_att_weight.shape[0]) ** -0.5
    global_query = additive_pool(q, F.linear(q, query_att_weight, query_att_bias) * scale)
    p = k * global_query
    global_key = additive_pool(p, F.linear(p, key_att_weight, key_att_bias) * scale)
    return F.linear(global_key * v, transform_weight, transform_bias) + q


@register_attention('additive')
class AdditiveMixer(Mixer):
    """Fastformer's additive attention; prefix tokens pool like any token.

    Parameters: `query_att`, `key_att` (Linear(C, heads)) and `transform` (Linear(C, C)). Every query needs its
    own value, so keys and values cannot come from a reduced map; there is no score matrix, so no position bias
    or window mask applies.
    """

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0.):
        super().__init__(dim, num_heads, group_grid, attn_drop)
        self.query_att = nn.Linear(dim, num_heads)
        self.key_att = nn.Linear(dim, num_heads)
        self.transform = nn.Linear(dim, dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        return additive_attention(
            q, k, v, self.query_att.weight, self.query_att.bias, self.key_att.weight, self.key_att.bias,
            self.transform.weight, self.transform.bias)
