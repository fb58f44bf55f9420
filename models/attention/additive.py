"""Additive attention (Fastformer): tokens interact only through two pooled vectors per head.

Per head j, with d = C / heads channels:
    α = softmax over tokens of query_att(q)_j / √d,   g_q = Σ_i α_i q_i      (the head's channels)
    p_i = k_i ⊙ g_q,
    β = softmax over tokens of key_att(p)_j / √d,     g_k = Σ_i β_i p_i
    u_i = g_k ⊙ v_i,   o_i = transform(u_i) + q_i,
then the grouping's `proj`. The scores of every head come from the full C-channel vectors (`query_att`,
`key_att`: Linear(C, heads)). The cost is linear in the number of tokens; no token-by-token matrix is formed.

Causal form (`causal=True`): both pools become prefix pools, token i averaging tokens l ≤ i only,
    g_i = s_i / z_i,   s_i = s_{i−1} + e^{a_i}·x_i,   z_i = z_{i−1} + e^{a_i},
so p_i = k_i ⊙ g_q,i and u_i = g_k,i ⊙ v_i. Plain exponential prefix sums overflow once a logit passes the
dtype's exp range and, when shifted by one global maximum, underflow to 0/0 for prefixes far below it; here
every prefix is taken relative to its own running maximum, in chunks (`causal_additive_pool`).

Departure from the reference code: there the value is the query (parameter sharing); here the value is the
separate third of the `qkv` projection, so every attention of the zoo keeps one `qkv` Linear(C, 3C). The
Linear layers keep PyTorch's default initialisation unless a backbone re-initialises them.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .causal import CAUSAL_CHUNK, chunk_tokens, later_tokens
from .layout import Grid
from .mixer import Mixer, MixContext, autocast_off
from .registry import register_attention

__all__ = ['additive_pool', 'causal_additive_pool', 'AdditiveMixer']


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


def causal_additive_pool(x: Tensor, logits: Tensor, chunk_size: int = CAUSAL_CHUNK) -> Tensor:
    """x: (B, n, C), logits: (B, n, heads) -> (B, n, C).

    Row i: each head's channels of x averaged over tokens 0..i with the softmax over those tokens of the head's
    logits. Runs in at least float32, with autocast off, in chunks of `chunk_size` tokens: inside a chunk every
    row weighs the chunk's earlier tokens by e^{a_l − m_i}, m_i the running maximum of the chunk's logits up to
    row i, and the chunks before it enter through a carried (s, z) pair taken relative to their own running
    maximum. Every factor is at most 1 and every normaliser at least 1, so nothing overflows or divides 0 by 0.
    """
    if not torch.jit.is_scripting():  # TorchScript has no autocast to turn off
        with autocast_off(x.device):
            return _causal_additive_pool(x, logits, chunk_size)
    return _causal_additive_pool(x, logits, chunk_size)


def _causal_additive_pool(x: Tensor, logits: Tensor, chunk_size: int) -> Tensor:
    B, n, C = x.shape
    heads = logits.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)
    chunk = min(chunk_size, n)
    a = chunk_tokens(logits.to(work).transpose(1, 2), chunk)  # (B, h, K, c)
    values = chunk_tokens(x.to(work).view(B, n, heads, C // heads).transpose(1, 2), chunk)  # (B, h, K, c, d)
    # row i, column l: a_l, and −inf after i; its row maxima are the running maxima m_i (as cummax, which the ONNX
    # exporters lack)
    earlier = a.unsqueeze(-2).masked_fill(later_tokens(chunk, chunk, x.device), -math.inf)
    running_max = earlier.amax(dim=-1)
    weights = (earlier - running_max.unsqueeze(-1)).exp()  # e^{a_l − m_i}, 0 after i
    sums = weights @ values
    norms = weights.sum(dim=-1, keepdim=True)
    if a.shape[2] > 1:
        sums, norms = _add_earlier_chunks(sums, norms, running_max)
    pooled = (sums / norms).flatten(2, 3)[:, :, :n]
    return pooled.transpose(1, 2).reshape(B, n, C).to(x.dtype)


def _add_earlier_chunks(sums: Tensor, norms: Tensor, running_max: Tensor) -> Tuple[Tensor, Tensor]:
    """Chunk-local prefix sums (B, h, K, c, d), normalisers (B, h, K, c, 1) and running maxima (B, h, K, c) ->
    the prefix sums and normalisers over all earlier tokens, each row still relative to its running maximum.

    The last row of a chunk sums the whole chunk relative to the chunk's maximum; a carry (s, z, m) folds those
    rows chunk by chunk, rescaled to the larger maximum at each step.
    """
    carry_max, carry_sum, carry_norm = running_max[:, :, 0, -1], sums[:, :, 0, -1], norms[:, :, 0, -1]
    carried_max, carried_sum, carried_norm = [carry_max], [carry_sum], [carry_norm]
    for k in range(1, sums.shape[2] - 1):
        chunk_max = running_max[:, :, k, -1]
        new_max = torch.maximum(carry_max, chunk_max)
        old_scale = (carry_max - new_max).exp().unsqueeze(-1)
        chunk_scale = (chunk_max - new_max).exp().unsqueeze(-1)
        carry_sum = carry_sum * old_scale + sums[:, :, k, -1] * chunk_scale
        carry_norm = carry_norm * old_scale + norms[:, :, k, -1] * chunk_scale
        carry_max = new_max
        carried_max.append(carry_max)
        carried_sum.append(carry_sum)
        carried_norm.append(carry_norm)
    before_max = torch.stack(carried_max, dim=2).unsqueeze(-1)  # (B, h, K − 1, 1): chunks 1.. see these
    local_max = running_max[:, :, 1:]
    row_max = torch.maximum(local_max, before_max)
    local_scale = (local_max - row_max).exp().unsqueeze(-1)
    before_scale = (before_max - row_max).exp().unsqueeze(-1)
    later_sums = sums[:, :, 1:] * local_scale + torch.stack(carried_sum, dim=2).unsqueeze(-2) * before_scale
    later_norms = norms[:, :, 1:] * local_scale + torch.stack(carried_norm, dim=2).unsqueeze(-2) * before_scale
    return torch.cat([sums[:, :, :1], later_sums], dim=2), torch.cat([norms[:, :, :1], later_norms], dim=2)


@register_attention('additive')
class AdditiveMixer(Mixer):
    """Fastformer's additive attention; prefix tokens pool like any token.

    Parameters: `query_att`, `key_att` (Linear(C, heads)) and `transform` (Linear(C, C)). Every query needs its
    own value, so keys and values cannot come from a reduced map; there is no score matrix, so no position bias
    or window mask applies. Option: `causal` (prefix pools, linear in the tokens).

    The math on tensors is the pooling (`additive_pool`, `causal_additive_pool`); the layers run between the pools
    as modules, so that layers swapped for others (int8 quantization, adapters) take part as they are.
    """

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0., *,
                 causal: bool = False):
        super().__init__(dim, num_heads, group_grid, attn_drop)
        self.causal = causal
        self.query_att = nn.Linear(dim, num_heads)
        self.key_att = nn.Linear(dim, num_heads)
        self.transform = nn.Linear(dim, dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        """q, k, v: (B, n, C) -> (B, n, C)."""
        scale = self.head_dim ** -0.5
        global_query = self._pool(q, self.query_att(q) * scale)
        p = k * global_query
        global_key = self._pool(p, self.key_att(p) * scale)
        return self.transform(global_key * v) + q

    def _pool(self, x: Tensor, logits: Tensor) -> Tensor:
        return causal_additive_pool(x, logits) if self.causal else additive_pool(x, logits)

    def extra_repr(self) -> str:
        return 'causal=True' if self.causal else ''
