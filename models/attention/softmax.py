"""Softmax attention, the backbones' native one: softmax(q·kᵀ/√d + bias) v."""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from .base import Attention, Grid, merge_heads, split_heads
from .registry import register_attention

__all__ = ['softmax_attention', 'score_bias', 'SoftmaxAttention']


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, dropout_p: float = 0.) -> Tensor:
    """q: (B, h, n, d), k, v: (B, h, m, d), bias broadcastable to (B, h, n, m) -> (B, h, n, d)."""
    if bias is not None:
        bias = bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)


def score_bias(batch: int, pos_bias: Optional[Tensor], mask: Optional[Tensor]) -> Optional[Tensor]:
    """Position bias (h, n, m) plus window mask (nW, n, m) as one additive bias broadcastable to (batch, h, n, m).

    Group g of the batch uses mask[g % nW], the order `window_partition` gives.
    """
    if mask is None:
        return pos_bias
    mask = mask.repeat(batch // mask.shape[0], 1, 1).unsqueeze(1)
    return mask if pos_bias is None else mask + pos_bias


@register_attention('softmax')
class SoftmaxAttention(Attention):
    """Scaled dot-product attention with the groupings of DeiT, PVT, Swin and CSwin."""
    supports_reduction = True

    def mix(self, q: Tensor, k: Tensor, v: Tensor, grid: Grid, num_prefix_tokens: int, tokens: Optional[Tensor],
            pos_bias: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        h = self.num_heads
        bias = score_bias(q.shape[0], pos_bias, mask)
        out = softmax_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), bias,
                                self.attn_drop if self.training else 0.)
        return merge_heads(out)
