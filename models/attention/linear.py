"""Linear attention, the kernelised baseline: φ(q)·(Σⱼ φ(kⱼ) vⱼᵀ) / (φ(q)·Σⱼ φ(kⱼ)), with φ(x) = elu(x) + 1.

The "vanilla linear attention" the InLine and FLatten papers compare against: the softmax kernel exp(q·k)
replaced by the product of positive feature maps, so the key-value sum is formed once, in Q(KᵀV) order, and the
cost is linear in the tokens. There is no local term, scale, position bias or window mask. Prefix tokens are
tokens like any other, and keys and values may come from a reduced map.

The sums over the tokens run in float32 at least, with autocast off, as averages (divided by the token count),
so that float16 inputs neither overflow nor lose the normaliser; a 1e-6 floor in the normaliser (as the usual
implementations add) keeps a row whose features all underflow finite.

Causal form (`causal=True`): query i sums over keys j ≤ i only, through the prefix sums of φ(k)vᵀ and φ(k),
taken chunk by chunk (`causal_linear_attention`); time and memory stay linear in the tokens.
"""
from typing import Optional

import torch
from torch import Tensor

from .causal import CAUSAL_CHUNK, chunk_tokens, later_tokens
from .layout import Grid, merge_heads
from .mixer import Mixer, MixContext, autocast_off
from .multimax_cpu import attention_matmul
from .registry import register_attention

__all__ = ['elu_feature_map', 'linear_attention', 'causal_linear_attention', 'LinearMixer']


def elu_feature_map(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1, positive everywhere, as exp(x − relu(x)) + relu(x): elu's values and gradients (1 at 0,
    where a clamp's would be 0), through an exponential instead of torch's CPU `elu`, whose expm1 took 11x the
    time of exp and a quarter of linear DeiT-T's inference (224², batch 8, one thread)."""
    positive_part = x.relu()
    return (x - positive_part).exp() + positive_part


def linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float = 1e-6, onednn: bool = False) -> Tensor:
    """q: (B, h, n, d), k: (B, h, m, d), v: (B, h, m, e) -> (B, h, n, e) in v's dtype.

    Σⱼ (φqᵢ·φkⱼ) vⱼ / (Σⱼ φqᵢ·φkⱼ + eps), both sums divided by m before the division. `onednn`: the state's
    products through oneDNN (`attention_matmul`).
    """
    if not torch.jit.is_scripting():  # TorchScript has no autocast to turn off
        with autocast_off(v.device):
            return _linear_attention(q, k, v, eps, onednn)
    return _linear_attention(q, k, v, eps, onednn)


def _linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float, onednn: bool) -> Tensor:
    work = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    m = k.shape[-2]
    phi_q, phi_k = elu_feature_map(q.to(work)), elu_feature_map(k.to(work))
    state = attention_matmul(phi_k.transpose(-2, -1), v.to(work) / m, onednn)
    normaliser = phi_q @ phi_k.mean(dim=-2, keepdim=True).transpose(-2, -1) + eps / m
    return (attention_matmul(phi_q, state, onednn) / normaliser).to(v.dtype)


def causal_linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float = 1e-6,
                            chunk_size: int = CAUSAL_CHUNK) -> Tensor:
    """q, k: (B, h, n, d), v: (B, h, n, e) -> (B, h, n, e) in v's dtype.

    Row i: Σ_{j≤i} (φqᵢ·φkⱼ) vⱼ / (Σ_{j≤i} φqᵢ·φkⱼ + eps), both sums divided by n before the division. In chunks
    of `chunk_size` tokens: a masked chunk×chunk score matrix for the keys of the query's own chunk, and for the
    earlier chunks the sums of φ(k)vᵀ and φ(k) over them, a (d, e) state per chunk.
    """
    if not torch.jit.is_scripting():  # TorchScript has no autocast to turn off
        if not q.shape[-2] == k.shape[-2] == v.shape[-2]:
            raise ValueError(f"causal linear attention takes as many queries as keys and values, got "
                             f"{q.shape[-2]} queries, {k.shape[-2]} keys and {v.shape[-2]} values")
        with autocast_off(v.device):
            return _causal_linear_attention(q, k, v, eps, chunk_size)
    return _causal_linear_attention(q, k, v, eps, chunk_size)


def _causal_linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float, chunk_size: int) -> Tensor:
    work = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    n = k.shape[-2]
    chunk = min(chunk_size, n)
    # padding after the feature map: zero keys and values add nothing to any sum
    phi_q = chunk_tokens(elu_feature_map(q.to(work)), chunk)
    phi_k = chunk_tokens(elu_feature_map(k.to(work)) / n, chunk)
    values = chunk_tokens(v.to(work), chunk)
    scores = (phi_q @ phi_k.transpose(-2, -1)).masked_fill(later_tokens(chunk, chunk, v.device), 0.)
    state = _sums_of_earlier_chunks(phi_k.transpose(-2, -1) @ values)
    key_sum = _sums_of_earlier_chunks(phi_k.sum(dim=-2, keepdim=True))
    numerator = scores @ values + phi_q @ state
    normaliser = scores.sum(dim=-1, keepdim=True) + phi_q @ key_sum.transpose(-2, -1) + eps / n
    return (numerator / normaliser).flatten(2, 3)[:, :, :n].to(v.dtype)


def _sums_of_earlier_chunks(x: Tensor) -> Tensor:
    """(B, h, K, ...) per-chunk sums -> for every chunk the sum over the chunks before it (zero for the first)."""
    return torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1].cumsum(dim=2)], dim=2)


@register_attention('linear')
class LinearMixer(Mixer):
    """Linear attention with the elu + 1 feature map; no parameters of its own. Option: `causal` (prefix sums,
    linear in the tokens)."""
    reduces_keys = True

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0., *,
                 causal: bool = False):
        super().__init__(dim, num_heads, group_grid, attn_drop)
        self.causal = causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        q, k, v = self.heads(q, k, v)
        if self.causal:
            return merge_heads(causal_linear_attention(q, k, v))
        return merge_heads(linear_attention(q, k, v, onednn=self.onednn))

    def extra_repr(self) -> str:
        return 'causal=True' if self.causal else ''
