"""Each attention's weights as its math defines them, formed from one mixer call's grouped q, k, v and context.

One function per mixer class, registered with `@attention_matrix(MixerClass)`, kept apart from the mixers so that
the attentions compute nothing for analysis. A function forms only the requested query rows and returns a
`MixerWeights`:

- `weights` (B', heads, r, m): row i is the distribution (or the signed row, for InLine and SimA) that mixes the
  m values into query i's global term, so `weights @ v` is that term exactly;
- `pools` (B', heads, 2, n): for an attention that forms no token-by-token matrix (registered with `pools=True`),
  its two pooling distributions over the tokens (additive attention's query and key pools);
- `local` (B', n, C): the term added to the global one that is not an attention weight (InLine's residual,
  FLatten's depthwise convolution of V);
- `extras`: per-token quantities the papers draw, (B', heads, n) each (SimA's ‖q̂‖ and ‖k̂‖).

Everything runs in float32 at least, with autocast off; float64 inputs stay float64.
"""
from typing import Callable, Dict, NamedTuple, Optional, Type

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.additive import AdditiveMixer
from ..attention.flatten import FocusedLinearMixer, focused_feature_map
from ..attention.inline import InLineMixer, inline_local_residual
from ..attention.layout import split_heads
from ..attention.linear import LinearMixer, elu_feature_map
from ..attention.mixer import MixContext, Mixer, MixerContractError, autocast_off
from ..attention.multimax import MultiMaxMixer, multimax_modulation, regions_apart
from ..attention.sima import SimAMixer, l1_normalize_tokens
from ..attention.softmax import SoftmaxMixer

__all__ = ['MixerWeights', 'attention_matrix', 'mixer_weights', 'pools_tokens']


class MixerWeights(NamedTuple):
    weights: Optional[Tensor] = None
    pools: Optional[Tensor] = None
    local: Optional[Tensor] = None
    extras: Dict[str, Tensor] = {}


MatrixFn = Callable[[Mixer, Tensor, Tensor, Tensor, MixContext, Optional[Tensor]], MixerWeights]


class _Registered(NamedTuple):
    function: MatrixFn
    pools: bool


_MATRICES: Dict[Type[Mixer], _Registered] = {}


def attention_matrix(mixer_cls: Type[Mixer], *, pools: bool = False) -> Callable[[MatrixFn], MatrixFn]:
    """Register `fn(mixer, q, k, v, ctx, rows) -> MixerWeights` for `mixer_cls` (q: (B', n, C), k, v: (B', m, C),
    rows: query indices within a group or None for all). `pools`: the mixer forms no token-by-token weights and
    `fn` returns its pooling distributions (`MixerWeights.pools`), as for additive attention."""
    def wrap(fn: MatrixFn) -> MatrixFn:
        _MATRICES[mixer_cls] = _Registered(fn, pools)
        return fn
    return wrap


def mixer_weights(mixer: Mixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                  rows: Optional[Tensor] = None) -> MixerWeights:
    """The weights of `mixer` on one call's inputs, by `matrix_function` of its class."""
    weights_of = matrix_function(type(mixer))
    work = torch.promote_types(q.dtype, torch.float32)
    with autocast_off(q.device), torch.no_grad():
        result = weights_of(mixer, q.to(work), k.to(work), v.to(work), ctx, rows)
    batch, heads, queries = q.shape[0], mixer.num_heads, q.shape[1] if rows is None else len(rows)
    for what, got, expected, layout in (
            ('weights', result.weights, (batch, heads, queries, k.shape[1]), "(B', heads, rows, keys)"),
            ('pools', result.pools, (batch, heads, 2, q.shape[1]), "(B', heads, 2, tokens)"),
            ('local', result.local, tuple(q.shape), "(B', n, C)")):
        if got is not None and tuple(got.shape) != expected:
            raise MixerContractError(f"the attention matrix function of {type(mixer).__name__} returned {what} of "
                                     f"shape {tuple(got.shape)}; expected {layout} = {expected}")
    return result


def _registration(mixer_cls: Type[Mixer]) -> _Registered:
    """The registration of `mixer_cls`, or of the base class whose `forward` it runs (a subclass with a `forward`
    of its own computes other weights than its base's); a ValueError where there is none."""
    for cls in mixer_cls.__mro__:
        if cls in _MATRICES:
            return _MATRICES[cls]
        if 'forward' in vars(cls):
            break
    raise ValueError(f"no attention matrix is defined for {mixer_cls.__name__}; register one with "
                     f"models.analysis.attention_matrix")


def matrix_function(mixer_cls: Type[Mixer]) -> MatrixFn:
    """The function registered for `mixer_cls` or the base whose `forward` it runs; a ValueError where none is."""
    return _registration(mixer_cls).function


def pools_tokens(mixer_cls: Type[Mixer]) -> bool:
    """Whether `mixer_cls`'s weights are pooling distributions (`attention_matrix(..., pools=True)`) rather than
    token-by-token rows; a ValueError where no function is registered for it."""
    return _registration(mixer_cls).pools


def _take(x: Tensor, rows: Optional[Tensor]) -> Tensor:
    """The query rows `rows` of (..., n, d)."""
    return x if rows is None else x[..., rows, :]


def _scores(mixer: Mixer, q: Tensor, k: Tensor, ctx: MixContext, rows: Optional[Tensor]) -> Tensor:
    """(B', heads, r, m) q·kᵀ/√d plus the position bias."""
    q, k = split_heads(q, mixer.num_heads), split_heads(k, mixer.num_heads)
    scores = _take(q, rows) * mixer.head_dim ** -0.5 @ k.transpose(-2, -1)
    if ctx.pos_bias is not None:
        scores = scores + _take(ctx.pos_bias.to(scores.dtype), rows)
    return scores


def _window_mask(ctx: MixContext, groups: int, rows: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """The shifted-window mask of every group as (B', 1, r, m), group g taking mask[g % nW]."""
    mask = ctx.mask.to(dtype)
    return _take(mask.repeat(groups // mask.shape[0], 1, 1), rows).unsqueeze(1)


def _masked_softmax(logits: Tensor, ctx: MixContext, groups: int, rows: Optional[Tensor]) -> MixerWeights:
    if ctx.mask is not None:
        logits = logits + _window_mask(ctx, groups, rows, logits.dtype)
    return MixerWeights(weights=logits.softmax(dim=-1))


@attention_matrix(SoftmaxMixer)
def softmax_weights(mixer: SoftmaxMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                    rows: Optional[Tensor]) -> MixerWeights:
    return _masked_softmax(_scores(mixer, q, k, ctx, rows), ctx, q.shape[0], rows)


@attention_matrix(MultiMaxMixer)
def multimax_weights(mixer: MultiMaxMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                     rows: Optional[Tensor]) -> MixerWeights:
    scores = _scores(mixer, q, k, ctx, rows)
    logits = multimax_modulation(scores, mixer.ranges.to(scores.dtype), mixer.ts.to(scores.dtype))
    return _masked_softmax(logits, ctx._replace(mask=regions_apart(ctx.mask)), q.shape[0], rows)


def _grid_local(v: Tensor, ctx: MixContext, local_of: Callable[[Tensor], Tensor]) -> Tensor:
    """`local_of` V's (B', h·w, C) grid tokens, as (B', n, C) with zeros at the prefix tokens."""
    num_prefix = ctx.num_prefix_tokens
    return F.pad(local_of(v[:, num_prefix:]), (0, 0, num_prefix, 0))


@attention_matrix(InLineMixer)
def inline_weights(mixer: InLineMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                   rows: Optional[Tensor]) -> MixerWeights:
    """A_ij = (s/n)·(q_i·k_j − q_i·k̄) + 1/n: rows sum to one, entries may be negative."""
    qh, kh = split_heads(q, mixer.num_heads), split_heads(k, mixer.num_heads)
    n = kh.shape[-2]
    centred = kh - kh.mean(dim=-2, keepdim=True)
    weights = _take(qh, rows) @ centred.transpose(-2, -1) * (mixer.head_dim ** -0.5 / n) + 1 / n
    param_dtype = mixer.residual[0].weight.dtype
    kernels = mixer.residual_kernels(ctx.tokens.to(param_dtype)).to(q.dtype)
    return MixerWeights(weights=weights,
                        local=_grid_local(v, ctx, lambda tokens: inline_local_residual(tokens, ctx.grid, kernels)))


@attention_matrix(FocusedLinearMixer)
def flatten_weights(mixer: FocusedLinearMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                    rows: Optional[Tensor]) -> MixerWeights:
    """A_ij = φq_i·φk_j / (Σ_j φq_i·φk_j + n·1e-6), with the focused feature map φ."""
    k = mixer.positioned_keys(k, ctx)
    phi_q, phi_k = (split_heads(focused_feature_map(t, mixer.scale, float(mixer.focusing_factor)), mixer.num_heads)
                    for t in (q, k))
    kernel = _take(phi_q, rows) @ phi_k.transpose(-2, -1)
    weights = kernel / (kernel.sum(dim=-1, keepdim=True) + phi_k.shape[-2] * 1e-6)
    return MixerWeights(weights=weights,
                        local=_grid_local(v, ctx, lambda tokens: mixer.depthwise_local(tokens, ctx.grid)))


@attention_matrix(SimAMixer)
def sima_weights(mixer: SimAMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                 rows: Optional[Tensor]) -> MixerWeights:
    """A = q̂k̂ᵀ with q̂, k̂ ℓ1-normalised over the tokens per channel; entries may be negative."""
    q_hat, k_hat = (l1_normalize_tokens(split_heads(t, mixer.num_heads)) for t in (q, k))
    extras = dict(q_norm=q_hat.norm(dim=-1), k_norm=k_hat.norm(dim=-1))
    return MixerWeights(weights=_take(q_hat, rows) @ k_hat.transpose(-2, -1), extras=extras)


@attention_matrix(LinearMixer)
def linear_weights(mixer: LinearMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                   rows: Optional[Tensor]) -> MixerWeights:
    """A_ij = φq_i·φk_j / (Σ_j φq_i·φk_j + 1e-6), φ = elu + 1."""
    phi_q, phi_k = (elu_feature_map(split_heads(t, mixer.num_heads)) for t in (q, k))
    kernel = _take(phi_q, rows) @ phi_k.transpose(-2, -1)
    return MixerWeights(weights=kernel / (kernel.sum(dim=-1, keepdim=True) + 1e-6))


@attention_matrix(AdditiveMixer, pools=True)
def additive_weights(mixer: AdditiveMixer, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext,
                     rows: Optional[Tensor]) -> MixerWeights:
    """Per head, α = softmax over tokens of query_att(q)/√d and β = softmax over tokens of key_att(k ⊙ g_q)/√d."""
    scale = mixer.head_dim ** -0.5
    alpha = (F.linear(q, mixer.query_att.weight.to(q.dtype), mixer.query_att.bias.to(q.dtype)) * scale).softmax(1)
    global_query = (alpha.unsqueeze(-1) * split_heads(q, mixer.num_heads).transpose(1, 2)).sum(dim=1)
    p = k * global_query.reshape(q.shape[0], 1, -1)
    beta = (F.linear(p, mixer.key_att.weight.to(q.dtype), mixer.key_att.bias.to(q.dtype)) * scale).softmax(1)
    return MixerWeights(pools=torch.stack([alpha, beta], dim=-1).permute(0, 2, 3, 1))
