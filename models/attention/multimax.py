"""MultiMax: softmax of piece-wise modulated scores, softmax(σ(q·kᵀ/√d + bias) + mask) v.

σ(x) = x + t₀·max(b₀ − x, 0) + t₁·max(x − b₁, 0) + t₂·max(b₂ − x, 0)² + t₃·max(x − b₃, 0)², with b = `ranges`
and t = `ts`, four learned scalars each shared by all heads of the module. σ runs before the mask is added
(σ(−inf) would be NaN) and, like the softmax, in float32 whatever the autocast dtype, since its squares
overflow float16.

Two paths compute the same function. On CUDA, σ is FlexAttention's `score_mod` (it is element-wise on the
scores), so the fused kernel never stores the score matrix. Elsewhere, and with attention dropout, the plain
path forms the scores; its σ keeps only its input for the backward pass instead of four score-sized
intermediates, and without autograd it runs a block of query rows at a time, so inference never holds more
than a few MiB of scores.
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import trunc_normal_

from .base import Grid, merge_heads, split_heads
from .registry import register_attention
from .softmax import SoftmaxAttention

try:
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:  # older torch: the plain path everywhere
    flex_attention = None

__all__ = ['multimax_modulation', 'multimax_attention', 'MultiMaxAttention']


def multimax_modulation(x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
    """Element-wise σ(x) with `ranges` = (b₀, b₁, b₂, b₃) and `ts` = (t₀, t₁, t₂, t₃); zeros give σ(x) = x."""
    return (x + ts[0] * torch.relu(ranges[0] - x) + ts[1] * torch.relu(x - ranges[1])
            + ts[2] * torch.relu(ranges[2] - x).square() + ts[3] * torch.relu(x - ranges[3]).square())


class _Modulation(torch.autograd.Function):
    """`multimax_modulation` computed in place, with a backward pass that needs only x (autograd of the formula
    keeps four score-sized intermediates)."""

    @staticmethod
    def forward(ctx, x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
        ctx.save_for_backward(x, ranges, ts)
        out = (ranges[0] - x).clamp_(min=0).mul_(ts[0]).add_(x)
        out.add_((x - ranges[1]).clamp_(min=0).mul_(ts[1]))
        out.add_((ranges[2] - x).clamp_(min=0).square_().mul_(ts[2]))
        return out.add_((x - ranges[3]).clamp_(min=0).square_().mul_(ts[3]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, ranges, ts = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the formula's own backward is differentiable
            wanted = [t for t, need in zip((x, ranges, ts), ctx.needs_input_grad) if need]
            grads = iter(torch.autograd.grad(multimax_modulation(x, ranges, ts), wanted, grad, create_graph=True))
            return tuple(next(grads) if need else None for need in ctx.needs_input_grad)
        below0 = (ranges[0] - x).clamp_(min=0)
        above1 = (x - ranges[1]).clamp_(min=0)
        below2 = (ranges[2] - x).clamp_(min=0)
        above3 = (x - ranges[3]).clamp_(min=0)
        # relu's derivative is 0 at 0, as autograd takes it
        inside0, inside1 = below0.sign(), above1.sign()
        flat = grad.reshape(-1)

        def total(part: Tensor) -> Tensor:
            return torch.dot(flat, part.reshape(-1))

        grad_ranges = grad_ts = None
        if ctx.needs_input_grad[1]:
            grad_ranges = torch.stack([ts[0] * total(inside0), -ts[1] * total(inside1),
                                       2 * ts[2] * total(below2), -2 * ts[3] * total(above3)])
        if ctx.needs_input_grad[2]:
            grad_ts = torch.stack([total(below0), total(above1), total(below2.square()), total(above3.square())])
        # dσ/dx = 1 − t₀·[x < b₀] + t₁·[x > b₁] − 2t₂·max(b₂ − x, 0) + 2t₃·max(x − b₃, 0)
        slope = above3.mul_(2 * ts[3]).addcmul_(below2, -2 * ts[2]).addcmul_(inside0, -ts[0])
        grad_x = slope.addcmul_(inside1, ts[1]).add_(1).mul_(grad)
        return grad_x, grad_ranges, grad_ts


_compiled_flex: Optional[Callable[..., Tensor]] = None


def _fused_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled once; without compilation it would form the score matrix."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def multimax_attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ranges: Tensor,
        ts: Tensor,
        bias: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        dropout_p: float = 0.,
        use_flex: Optional[bool] = None,
) -> Tensor:
    """q: (B, h, n, d), k, v: (B, h, m, d) -> (B, h, n, d).

    `bias` (added before σ) broadcasts to the (B, h, n, m) scores; `mask` (nW, n, m) is added after σ, batch
    entry b taking mask[b % nW] (windows of an image are consecutive). `use_flex`: None takes FlexAttention on
    CUDA without dropout and the plain path otherwise; True forces FlexAttention (compiled on CUDA, its unfused
    reference elsewhere, forward only on CPU).
    """
    if use_flex is None:
        use_flex = flex_attention is not None and q.is_cuda and not dropout_p
    if use_flex:
        if dropout_p:
            raise ValueError(f"the FlexAttention path of MultiMax has no attention dropout, got dropout_p={dropout_p}")
        return _multimax_flex(q, k, v, ranges, ts, bias, mask)
    if dropout_p or _tracks_grad(q, k, v, ranges, ts, bias):
        return _multimax_plain(q, k, v, ranges, ts, bias, mask, dropout_p)
    return _multimax_rows(q, k, v, ranges, ts, bias, mask)


def _tracks_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _multimax_plain(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                    mask: Optional[Tensor], dropout_p: float) -> Tensor:
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1)).to(work)
    if bias is not None:
        scores = scores + bias.to(work)
    scores = _Modulation.apply(scores, ranges.to(work), ts.to(work))
    if mask is not None:
        B, h, n, m = scores.shape
        nW = mask.shape[0]
        scores = (scores.view(B // nW, nW, h, n, m) + mask.to(work).unsqueeze(1)).view(B, h, n, m)
    weights = scores.softmax(dim=-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights.to(v.dtype), v)


# Scores of this many bytes per block of query rows stay in cache between the passes over them.
_ROW_BLOCK_BYTES = 4 << 20


def _multimax_rows(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                   mask: Optional[Tensor]) -> Tensor:
    """The plain path without autograd, a block of query rows at a time (σ and the softmax are row-wise, so this
    is exact): peak memory is one block of scores, not the (n, m) matrix per head."""
    B, h, n, _ = q.shape
    m = k.shape[-2]
    rows = max(1, _ROW_BLOCK_BYTES // (B * h * m * 4))
    if rows >= n:
        return _multimax_plain(q, k, v, ranges, ts, bias, mask, 0.)
    blocks = [slice(start, start + rows) for start in range(0, n, rows)]
    return torch.cat([
        _multimax_plain(q[..., block, :], k, v, ranges, ts, _row_block(bias, block), _row_block(mask, block), 0.)
        for block in blocks], dim=-2)


def _row_block(scores_like: Optional[Tensor], block: slice) -> Optional[Tensor]:
    if scores_like is None or scores_like.shape[-2] == 1:
        return scores_like
    return scores_like[..., block, :]


def _multimax_flex(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                   mask: Optional[Tensor]) -> Tensor:
    work = torch.promote_types(q.dtype, torch.float32)
    ranges, ts = ranges.to(work), ts.to(work)
    bias = None if bias is None else bias.to(work)
    mask = None if mask is None else mask.to(work)
    num_windows = 1 if mask is None else mask.shape[0]

    def modulate(score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        score = score.to(work)
        if bias is not None:
            score = score + bias[head, q_idx, kv_idx]
        score = multimax_modulation(score, ranges, ts)
        if mask is not None:
            score = score + mask[batch % num_windows, q_idx, kv_idx]
        return score

    # inside a compiled model the surrounding compilation fuses FlexAttention itself
    fused = q.is_cuda and not torch.compiler.is_compiling()
    return (_fused_flex() if fused else flex_attention)(q, k, v, score_mod=modulate)


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
        out = multimax_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), self.ranges, self.ts,
                                 pos_bias, mask, self.attn_drop if self.training else 0.)
        return merge_heads(out)
