"""Softmax attention, the backbones' native one: softmax(q·kᵀ/√d + bias) v.

Every grouping goes through `scaled_dot_product_attention`. Its fused kernels take a bias only in 4-D form, so
the bias is always given as (1, heads, n, m); shifted windows fold their window index into the heads
(`fold_windows`) so that one (1, nW·heads, n, m) bias, built once per forward, serves the whole batch instead of
a per-window copy of the mask for every image. On CPU the fused kernels take no bias that needs a gradient (a
learned position bias in training); there the plain formula is cheaper than the kernel's own fallback.

Causal form (`causal=True`): key j > i is masked out of query i's softmax, by the kernels' own causal mask
where there is no bias, else added to the bias as −inf.

With oneDNN's products (`onednn`, set by `models.convert_to_onednn`), float32 CPU attention against 128 keys or
more takes MultiMax's fused kernel with σ the identity (`multimax_cpu.py`), whose large products go through
oneDNN, where the fused kernel of `scaled_dot_product_attention` multiplies by the BLAS: inference with a bias and
a mask too (1.36× its speed at 197 tokens, 1.78× at 4097, one thread), training (forward and backward) without them
(1.29× at 197 tokens, 1.94× at 4097). Windows of 49 tokens stay with `scaled_dot_product_attention`, whose
products are too small for oneDNN to gain (the kernel took 1.1× its time there), and so do PVT's 49 reduced keys
(the kernel would save PVT-T under 1.5 % of its inference time and lose in training).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .causal import later_tokens
from .layout import Grid, merge_heads
from .mixer import Mixer, MixContext, needs_grad
from .multimax_cpu import KernelAttention, multimax_cpu, onednn_products_apply
from .registry import register_attention

__all__ = ['softmax_attention', 'window_bias', 'fold_windows', 'unfold_windows', 'SoftmaxMixer']

_ONEDNN_KERNEL_MIN_KEYS = 128


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, dropout_p: float = 0.,
                      causal: bool = False) -> Tensor:
    """q: (B, h, n, d), k, v: (B, h, m, d), bias broadcastable to (B, h, n, m) -> (B, h, n, d).

    `causal`: query i attends to keys j ≤ i only.
    """
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    bias = bias.to(q.dtype)
    if causal:
        bias = bias.masked_fill(later_tokens(q.shape[-2], k.shape[-2], q.device), -math.inf)
    if bias.requires_grad and torch.is_grad_enabled() and q.device.type == 'cpu':
        weights = (torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1)) + bias).softmax(dim=-1)
        return torch.matmul(F.dropout(weights, dropout_p) if dropout_p else weights, v)
    while bias.dim() < 4:  # the fused kernels reject a bias of fewer dimensions
        bias = bias.unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)


def window_bias(pos_bias: Optional[Tensor], mask: Tensor, num_heads: int) -> Tensor:
    """Window mask (nW, n, m) plus position bias (h, n, m) or None -> (1, nW·h, n, m), for `fold_windows`."""
    bias = mask.unsqueeze(1)
    bias = bias.expand(-1, num_heads, -1, -1) if pos_bias is None else bias + pos_bias
    return bias.flatten(0, 1).unsqueeze(0)


def fold_windows(x: Tensor, num_windows: int) -> Tensor:
    """(B·nW, h, n, d), windows of an image consecutive -> (B, nW·h, n, d), head j of window w at w·h + j."""
    Bw, h, n, d = x.shape
    return x.reshape(Bw // num_windows, num_windows * h, n, d)


def unfold_windows(x: Tensor, num_heads: int) -> Tensor:
    """Inverse of `fold_windows`: (B, nW·h, n, d) -> (B·nW, h, n, d)."""
    B, wh, n, d = x.shape
    return x.reshape(B * (wh // num_heads), num_heads, n, d)


@register_attention('softmax')
class SoftmaxMixer(Mixer):
    """Scaled dot-product attention; no parameters of its own. Option: `causal` (query i sees keys j ≤ i)."""
    forms_scores = True
    accepts_score_bias = True
    reduces_keys = True

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0., *,
                 causal: bool = False):
        super().__init__(dim, num_heads, group_grid, attn_drop)
        self.causal = causal

    def extra_repr(self) -> str:
        return ', '.join(option for option, on in (('causal=True', self.causal), ('onednn=True', self.onednn)) if on)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        h = self.num_heads
        q, k, v = self.heads(q, k, v)
        dropout_p = self.attn_drop if self.training else 0.
        mask = ctx.mask
        if not torch.jit.is_scripting():
            if self.onednn and _onednn_kernel_takes(q, k, v, ctx.pos_bias, mask, dropout_p, self.causal):
                # σ's scalars, zero: σ(x) = x (two tensors: compiled autograd functions take no input twice)
                ranges, ts = q.new_zeros(4), q.new_zeros(4)
                if ctx.pos_bias is None and mask is None:
                    return merge_heads(KernelAttention.apply(q, k, v, ranges, ts, True))
                return merge_heads(multimax_cpu(q, k, v, ranges, ts, ctx.pos_bias, mask, True)[0])
        if mask is None:
            return merge_heads(softmax_attention(q, k, v, ctx.pos_bias, dropout_p, self.causal))
        nW = mask.shape[0]
        out = softmax_attention(fold_windows(q, nW), fold_windows(k, nW), fold_windows(v, nW),
                                window_bias(ctx.pos_bias, mask, h), dropout_p, self.causal)
        return merge_heads(unfold_windows(out, h))


def _onednn_kernel_takes(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                         dropout_p: float, causal: bool) -> bool:
    """Whether the fused CPU kernel with oneDNN's products computes this call: float32 on the CPU against
    `_ONEDNN_KERNEL_MIN_KEYS` keys or more (`onednn_products_apply`: eager or compiled, not exported or under
    autocast), without dropout or causal masking; a bias or a mask in inference only (no input needing a
    gradient)."""
    if dropout_p or causal or k.shape[-2] < _ONEDNN_KERNEL_MIN_KEYS:
        return False
    inputs = [t for t in (q, k, v, bias) if t is not None]
    return onednn_products_apply(*inputs) and not (needs_grad(*inputs) and (bias is not None or mask is not None))
