"""Linear attention, the kernelised baseline: φ(q)·(Σⱼ φ(kⱼ) vⱼᵀ) / (φ(q)·Σⱼ φ(kⱼ)), with φ(x) = elu(x) + 1.

The "vanilla linear attention" the InLine and FLatten papers compare against: the softmax kernel exp(q·k)
replaced by the product of positive feature maps, so the key-value sum is formed once, in Q(KᵀV) order, and the
cost is linear in the tokens. There is no local term, scale, position bias or mask. Prefix tokens are tokens like
any other, and keys and values may come from a reduced map.

The sums over the tokens run in float32 at least, with autocast off, as averages (divided by the token count),
so that float16 inputs neither overflow nor lose the normaliser; a 1e-6 floor in the normaliser (as the usual
implementations add) keeps a row whose features all underflow finite.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import merge_heads
from .mixer import Mixer, MixContext, autocast_off
from .registry import register_attention

__all__ = ['elu_feature_map', 'linear_attention', 'LinearMixer']


def elu_feature_map(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1, positive everywhere."""
    return F.elu(x) + 1


def linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float = 1e-6) -> Tensor:
    """q: (B, h, n, d), k: (B, h, m, d), v: (B, h, m, e) -> (B, h, n, e) in v's dtype.

    Σⱼ (φqᵢ·φkⱼ) vⱼ / (Σⱼ φqᵢ·φkⱼ + eps), both sums divided by m before the division.
    """
    if not torch.jit.is_scripting():  # TorchScript has no autocast to turn off
        with autocast_off(v.device):
            return _linear_attention(q, k, v, eps)
    return _linear_attention(q, k, v, eps)


def _linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float) -> Tensor:
    work = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    m = k.shape[-2]
    phi_q, phi_k = elu_feature_map(q.to(work)), elu_feature_map(k.to(work))
    state = phi_k.transpose(-2, -1) @ (v.to(work) / m)
    normaliser = phi_q @ phi_k.mean(dim=-2, keepdim=True).transpose(-2, -1) + eps / m
    return ((phi_q @ state) / normaliser).to(v.dtype)


@register_attention('linear')
class LinearMixer(Mixer):
    """Linear attention with the elu + 1 feature map; no parameters of its own."""
    reduces_keys = True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        q, k, v = self.heads(q, k, v)
        return merge_heads(linear_attention(q, k, v))
