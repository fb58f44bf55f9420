"""InLine: injective linear attention with an input-dependent local residual.

The global term uses the identity kernel and subtracts each query's mean score, so every row of the implicit
attention matrix sums to one while distinct queries keep distinct weights:

    A_ij = (s/N)·(q_i·k_j − q_i·k̄) + 1/N,   s = head_dim^-½,  N = tokens of the group (prefix tokens included).

It is computed in Q(KᵀV) order, never forming A. The local residual is a 3×3 depthwise convolution of V imaged on
the grid whose kernel is predicted, per sample and channel, from the mean token of the group. There is no causal
form: the mean key and the kernels summarise every token, and the convolution reaches later ones.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .causal import no_causal_form
from .layout import Grid, image_to_tokens, merge_heads, tokens_to_image
from .mixer import Mixer, MixContext, is_exporting
from .multimax_cpu import attention_matmul, onednn_matmul, onednn_products_apply
from .registry import register_attention

__all__ = ['inline_attention', 'inline_local_residual', 'InLineMixer']


def inline_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, onednn: bool = False) -> Tensor:
    """q, k: (B, h, n, d), v: (B, h, n, e) -> (B, h, n, e), Σ_j A_ij v_j with A as in the module docstring.

    The k̄ term folds into the d×e state: Σ_j A_ij v_j = v̄ + (s/n)·q_i·Σ_j k_j (v_j − v̄)ᵀ, one state product and
    one fused multiply-add per query. Centring and scaling V before the product keeps the state an average of
    the scale of the inputs (no float16 overflow) and avoids the cancellation of subtracting q·k̄ afterwards.
    `onednn`: both products through oneDNN (`attention_matmul`), where it applies.
    """
    B, h, n, d = q.shape
    v_mean = v.mean(dim=-2, keepdim=True)
    state = attention_matmul(k.transpose(-2, -1), (v - v_mean) * (scale / k.shape[-2]), onednn)
    if not torch.jit.is_scripting():
        if onednn and onednn_products_apply(q, state):
            # oneDNN's batched product adds no term that broadcasts over the rows: v̄ after it
            return onednn_matmul(q, state) + v_mean
    out = torch.baddbmm(v_mean.flatten(0, 1), q.reshape(B * h, n, d), state.flatten(0, 1))
    return out.view(B, h, n, v.shape[-1])


def inline_local_residual(v: Tensor, grid: Grid, kernels: Tensor) -> Tensor:
    """v: (B, H*W, C) tokens of the (H, W) grid, kernels: (B, C, 3, 3) -> (B, H*W, C).

    Per-sample depthwise cross-correlation of V imaged on the grid, zero padding 1, no bias: one grouped
    convolution over all B·C channels, since every sample has its own kernels.
    """
    B, N, C = v.shape
    H, W = grid
    if B == 0:  # a convolution takes no zero groups
        return torch.zeros_like(v)
    if not torch.jit.is_scripting():
        if is_exporting():
            # a convolution's group count must be static in ONNX, and B is symbolic under torch.export: the nine
            # taps are summed instead
            padded = F.pad(tokens_to_image(v, grid), (1, 1, 1, 1))
            taps: List[Tensor] = []
            for u in range(3):
                for w in range(3):
                    taps.append(kernels[:, :, u, w, None, None] * padded[:, :, u:u + H, w:w + W])
            return image_to_tokens(torch.stack(taps).sum(dim=0))
        if torch.compiler.is_compiling():
            # inductor gives these models' convolutions NCHW inputs whatever they are given, and fuses the
            # transposition into NCHW with the ops around it
            out = F.conv2d(v.transpose(1, 2).reshape(1, B * C, H, W), kernels.reshape(B * C, 1, 3, 3), padding=1,
                           groups=B * C)
            return out.view(B, C, N).transpose(1, 2)
    # Eager, the B·C channels go last, a channels-last image of the (H*W, B, C) token rows: a copy of whole rows of
    # C values each way, where an NCHW image moves every value on its own (twice as slow from 7² to 56² grids).
    image = v.transpose(0, 1).reshape(1, H, W, B * C).permute(0, 3, 1, 2)
    out = F.conv2d(image, kernels.reshape(B * C, 1, 3, 3), padding=1, groups=B * C)
    return out.permute(0, 2, 3, 1).reshape(N, B, C).transpose(0, 1)


@register_attention('inline')
class InLineMixer(Mixer):
    """Injective linear attention plus the local residual (`residual`: token mean -> 3×3 kernels per channel).

    `residual` maps the (C,) mean token of a group through two 1×1 convolutions grouped by head to 9C values;
    value 9c + 3u + w is tap (u, w) of channel c's kernel. The mean covers prefix tokens, the convolution and
    its addition only the grid tokens.
    """
    needs_tokens = True

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0., *,
                 causal: bool = False):
        if causal:
            raise no_causal_form('inline', "its local residual is a 2-D convolution over the grid, with kernels and a "
                                           "mean key taken from all tokens")
        super().__init__(dim, num_heads, group_grid, attn_drop)
        self.residual = nn.Sequential(
            nn.Conv1d(dim, dim, kernel_size=1, groups=num_heads),
            nn.GELU(),
            nn.Conv1d(dim, dim * 9, kernel_size=1, groups=num_heads),
        )

    def residual_kernels(self, tokens: Tensor) -> Tensor:
        """tokens: (B', n, C) -> (B', C, 3, 3) kernels predicted from the mean token."""
        return self.residual(tokens.mean(dim=1).unsqueeze(-1)).view(-1, self.dim, 3, 3)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        tokens = ctx.tokens
        if tokens is None:
            raise ValueError("inline attention needs the grouped attention input (MixContext.tokens), got None")
        qh, kh, vh = self.heads(q, k, v)
        out = merge_heads(inline_attention(qh, kh, vh, self.head_dim ** -0.5, self.onednn))
        num_prefix = ctx.num_prefix_tokens
        local = inline_local_residual(v[:, num_prefix:], ctx.grid, self.residual_kernels(tokens))
        if num_prefix:
            return torch.cat([out[:, :num_prefix], out[:, num_prefix:] + local], dim=1)
        return out + local
