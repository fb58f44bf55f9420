"""SimA, softmax-free attention: Q̂ K̂ᵀ V with queries and keys ℓ1-normalised over the tokens.

Every channel of every head of Q and K is divided by its ℓ1 norm over the tokens of the group (clamped at 1e-12,
as `F.normalize(p=1, dim=-2)` does); there is no scale, no softmax and no score bias. The product is taken in the
cheaper order for the shapes, (Q̂K̂ᵀ)V when the group has fewer tokens than a head has channels, else Q̂(K̂ᵀV): the
two are equal, only their cost differs. Prefix tokens (a class token) are normalised with the grid tokens.
There is no causal form: the ℓ1 norms sum over every token of the group.
"""
from typing import Optional

import torch
from torch import Tensor

from .causal import no_causal_form
from .layout import Grid, merge_heads
from .mixer import Mixer, MixContext
from .multimax_cpu import attention_matmul
from .registry import register_attention

__all__ = ['l1_normalize_tokens', 'sima_attention', 'SimAMixer']


def l1_normalize_tokens(x: Tensor, eps: float = 1e-12) -> Tensor:
    """(..., n, d) divided by its ℓ1 norm over the n tokens, per channel, clamped at `eps`.

    The sums run in at least float32: in float16 the clamp `eps` underflows to zero and an all-zero channel
    would give 0/0.
    """
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide / wide.abs().sum(dim=-2, keepdim=True).clamp_min(eps)).to(x.dtype)


def sima_attention(q: Tensor, k: Tensor, v: Tensor, onednn: bool = False) -> Tensor:
    """q: (B, h, n, d), k, v: (B, h, m, d) -> (B, h, n, d); `onednn`: the products through oneDNN
    (`attention_matmul`)."""
    q, k = l1_normalize_tokens(q), l1_normalize_tokens(k)
    if q.shape[-2] < q.shape[-1]:
        return attention_matmul(attention_matmul(q, k.transpose(-2, -1), onednn), v, onednn)
    return attention_matmul(q, attention_matmul(k.transpose(-2, -1), v, onednn), onednn)


@register_attention('sima')
class SimAMixer(Mixer):
    """SimA; no parameters of its own. It forms no score matrix, so no position bias or window mask applies."""
    reduces_keys = True

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0., *,
                 causal: bool = False):
        if causal:
            raise no_causal_form('sima', "its ℓ1 normalisation of queries and keys sums over all tokens, later ones "
                                         "included")
        super().__init__(dim, num_heads, group_grid, attn_drop)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        q, k, v = self.heads(q, k, v)
        return merge_heads(sima_attention(q, k, v, self.onednn))
