"""MultiMax: softmax of piece-wise modulated scores, softmax(σ(q·kᵀ/√d + bias) + mask) v.

σ(x) = x + t₀·max(b₀ − x, 0) + t₁·max(x − b₁, 0) + t₂·max(b₂ − x, 0)² + t₃·max(x − b₃, 0)², with b = `ranges`
and t = `ts`, four learned scalars each shared by all heads of the module. σ runs before the mask is added
(σ(−inf) would be NaN) and, like the softmax, in float32 whatever the autocast dtype, since its squares
overflow float16.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import trunc_normal_

from .base import Grid, merge_heads, split_heads
from .registry import register_attention
from .softmax import SoftmaxAttention, score_bias

__all__ = ['multimax_modulation', 'multimax_attention', 'MultiMaxAttention']


def multimax_modulation(x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
    """Element-wise σ(x) with `ranges` = (b₀, b₁, b₂, b₃) and `ts` = (t₀, t₁, t₂, t₃); zeros give σ(x) = x."""
    return (x + ts[0] * torch.relu(ranges[0] - x) + ts[1] * torch.relu(x - ranges[1])
            + ts[2] * torch.relu(ranges[2] - x).square() + ts[3] * torch.relu(x - ranges[3]).square())


def multimax_attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ranges: Tensor,
        ts: Tensor,
        bias: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        dropout_p: float = 0.,
) -> Tensor:
    """q: (B, h, n, d), k, v: (B, h, m, d) -> (B, h, n, d).

    `bias` (added before σ) and `mask` (added after σ) broadcast to the (B, h, n, m) scores.
    """
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-2, -1)).to(work) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    scores = multimax_modulation(scores, ranges.to(work), ts.to(work))
    if mask is not None:
        scores = scores + mask
    weights = scores.softmax(dim=-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights.to(v.dtype), v)


@register_attention('multimax')
class MultiMaxAttention(SoftmaxAttention):
    """Softmax attention whose scores pass through the learned MultiMax modulation first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranges = nn.Parameter(torch.zeros(4))
        self.ts = nn.Parameter(torch.zeros(4))
        trunc_normal_(self.ranges, std=.02)
        trunc_normal_(self.ts, std=.02)

    def mix(self, q: Tensor, k: Tensor, v: Tensor, grid: Grid, num_prefix_tokens: int, tokens: Optional[Tensor],
            pos_bias: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        h = self.num_heads
        if mask is not None:
            mask = score_bias(q.shape[0], None, mask)
        out = multimax_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), self.ranges, self.ts,
                                 pos_bias, mask, self.attn_drop if self.training else 0.)
        return merge_heads(out)
