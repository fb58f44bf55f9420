"""FLatten: focused linear attention with a depthwise convolution on V.

Queries and keys (keys plus a learned positional encoding) go through the focused feature map

    φ(x) = f_p((ReLU(x) + 1e-6) / softplus(scale)),   f_p(t) = ‖t‖·t^p / ‖t^p‖   (norms over all C channels),

which sharpens the direction of each feature towards its largest channels while keeping its norm. Per head,
out_i = Σ_j (φq_i·φk_j) v_j / (Σ_j φq_i·φk_j + N·1e-6), computed in Q(KᵀV) order, plus a k×k depthwise
convolution of V imaged on the grid whose weights all heads share.

The cube, the norms and the normaliser overflow float16 at ordinary activation sizes (NaN under float16 AMP
is this attention's known failure), so the feature map and the attention run in float32 at least, with autocast off,
whatever the input dtype; float64 stays float64. There is no causal form: the convolution of V reaches the
tokens below and to the right on the grid.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import resample_grid_embedding, resize_grid_embedding
from .causal import no_causal_form
from .layout import Grid, image_to_tokens, merge_heads, tokens_to_image
from .mixer import Mixer, MixContext, autocast_off
from .multimax_cpu import attention_matmul
from .registry import register_attention

__all__ = ['focused_feature_map', 'focused_linear_attention', 'FocusedLinearMixer']


def focused_feature_map(x: Tensor, scale: Tensor, focusing_factor: float = 3.) -> Tensor:
    """x: (..., C), scale broadcastable to x -> (..., C) non-negative features φ(x), in float32 at least."""
    if not torch.jit.is_scripting():  # TorchScript has no autocast to turn off
        with autocast_off(x.device):
            return _focused_feature_map(x, scale, focusing_factor)
    return _focused_feature_map(x, scale, focusing_factor)


def _focused_feature_map(x: Tensor, scale: Tensor, focusing_factor: float) -> Tensor:
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = (F.relu(x.to(dtype)) + 1e-6) / F.softplus(scale.to(dtype))
    # t^p / ‖t^p‖ is the same for t over its largest entry, whose power is then 1: ‖t^p‖ neither underflows to 0
    # (a token with every channel cut by the ReLU, as (1e-6 / softplus(s))^p) nor overflows (large features)
    powered = (x / x.amax(dim=-1, keepdim=True)) ** focusing_factor
    return powered * (torch.linalg.vector_norm(x, dim=-1, keepdim=True)
                      / torch.linalg.vector_norm(powered, dim=-1, keepdim=True))


def focused_linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, eps: float = 1e-6, onednn: bool = False
                             ) -> Tensor:
    """phi_q, phi_k: (B, h, n, d) non-negative features, v: (B, h, n, e) -> (B, h, n, e) in v's dtype.

    Σ_j (φq_i·φk_j) v_j / (Σ_j φq_i·φk_j + n·eps); keys and values are scaled by n^-½ each so that KᵀV is an
    average rather than a sum over the tokens. `onednn`: KᵀV's products through oneDNN (`attention_matmul`).
    """
    if not torch.jit.is_scripting():  # TorchScript has no autocast to turn off
        with autocast_off(v.device):
            return _focused_linear_attention(phi_q, phi_k, v, eps, onednn)
    return _focused_linear_attention(phi_q, phi_k, v, eps, onednn)


def _focused_linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, eps: float, onednn: bool) -> Tensor:
    dtype = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    n = phi_k.shape[-2]
    phi_q, phi_k, values = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    z = 1 / (phi_q @ phi_k.mean(dim=-2, keepdim=True).transpose(-2, -1) + eps)
    kv = attention_matmul(phi_k.transpose(-2, -1) * n ** -0.5, values * n ** -0.5, onednn)
    return (attention_matmul(phi_q, kv, onednn) * z).to(v.dtype)


@register_attention('flatten')
class FocusedLinearMixer(Mixer):
    """Focused linear attention over a fixed token grid (the window or stripe when grouped, else the whole map).

    Parameters: `scale` (1, 1, C) (softplus gives the per-channel temperature), `positional_encoding` (1, T, C)
    added to the keys of the T grid tokens of a group (not to prefix tokens), and `dwc`, a depthwise
    Conv2d(head_dim, head_dim, kernel_size) applied to every head's V image. Options: `focusing_factor` (the
    power p) and `kernel_size`.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            group_grid: Optional[Grid] = None,
            attn_drop: float = 0.,
            *,
            focusing_factor: float = 3,
            kernel_size: int = 5,
            causal: bool = False,
    ):
        if causal:
            raise no_causal_form('flatten', "its depthwise 2-D convolution of V mixes every token with its "
                                            "neighbours on all sides of the grid")
        super().__init__(dim, num_heads, group_grid, attn_drop)
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"flatten attention: kernel_size {kernel_size} must be a positive odd number")
        # at 0 every token's feature is the same, below it ReLU's zeros become infinities; NaN and inf give NaN or
        # one-hot features
        if not math.isfinite(focusing_factor) or focusing_factor <= 0:
            raise ValueError(f"flatten attention: focusing_factor {focusing_factor} must be a finite number > 0")
        self.focusing_factor = focusing_factor
        self.kernel_size = kernel_size
        gh, gw = self.require_group_grid('the positional encoding')
        self.scale = nn.Parameter(torch.zeros(1, 1, dim))
        self.positional_encoding = nn.Parameter(torch.zeros(1, gh * gw, dim))
        self.dwc = nn.Conv2d(self.head_dim, self.head_dim, kernel_size, padding=kernel_size // 2, groups=self.head_dim)

    def extra_repr(self) -> str:
        return f'focusing_factor={self.focusing_factor}, kernel_size={self.kernel_size}'

    def adapt_loaded_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """A positional encoding of another square grid, resized bicubically to this mixer's grid."""
        if name == 'positional_encoding' and tensor.shape[-1] == self.dim:
            return resize_grid_embedding(tensor, self.group_grid)
        return tensor

    def set_group_grid(self, grid: Grid) -> None:
        with torch.no_grad():
            encoding = resample_grid_embedding(self.positional_encoding, self.group_grid, grid)
        self.positional_encoding = nn.Parameter(encoding, requires_grad=self.positional_encoding.requires_grad)
        super().set_group_grid(grid)

    def depthwise_local(self, v: Tensor, grid: Grid) -> Tensor:
        """v: (B, H*W, C) tokens of the (H, W) grid -> (B, H*W, C), `dwc` of every head's V image.

        One depthwise convolution over all C channels with the heads' shared weights repeated, on the channels-last
        image of the tokens: splitting the heads into the batch would copy every value into an NCHW image.
        """
        h, dtype, bias = self.num_heads, v.dtype, self.dwc.bias
        weight = self.dwc.weight.to(dtype).repeat(h, 1, 1, 1)
        bias = None if bias is None else bias.to(dtype).repeat(h)
        image = tokens_to_image(v.contiguous(), grid)
        return image_to_tokens(F.conv2d(image, weight, bias, padding=self.kernel_size // 2, groups=self.dim))

    def positioned_keys(self, k: Tensor, ctx: MixContext) -> Tensor:
        """k: (B', n, C) -> k + the positional encoding on the group's grid (resampled to another grid), none on
        the prefix tokens."""
        grid = ctx.grid
        encoding = self.positional_encoding
        if (grid[0], grid[1]) != self.group_grid:
            encoding = resample_grid_embedding(encoding, self.group_grid, grid)
        return k + F.pad(encoding, (0, 0, ctx.num_prefix_tokens, 0))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        grid, num_prefix = ctx.grid, ctx.num_prefix_tokens
        k = self.positioned_keys(k, ctx)
        power = float(self.focusing_factor)  # an int option is the same power; TorchScript wants the float
        phi_q = focused_feature_map(q, self.scale, power)
        phi_k = focused_feature_map(k, self.scale, power)
        phi_q, phi_k, vh = self.heads(phi_q, phi_k, v)
        out = merge_heads(focused_linear_attention(phi_q, phi_k, vh, onednn=self.onednn))
        local = self.depthwise_local(v[:, num_prefix:], grid)
        if num_prefix:
            local = F.pad(local, (0, 0, num_prefix, 0))
        return out + local
