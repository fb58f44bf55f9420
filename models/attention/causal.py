"""What the causal forms share: token i mixes tokens j ≤ i only, in token order (prefix tokens first).

The mixers take `causal=True` as a method option. Softmax and MultiMax mask their scores; the linear-cost
attentions (additive, linear) run over chunks of tokens: an explicit chunk×chunk lower-triangular matrix inside
a chunk and a state carried from chunk to chunk, so time and memory grow linearly with the tokens. Attentions
without a causal form refuse the option with `no_causal_form`.
"""
from typing import Any, Mapping

import torch
from torch import Tensor

__all__ = ['CAUSAL_CHUNK', 'chunk_tokens', 'later_tokens', 'no_causal_form', 'check_causal_grouping']

# Tokens per chunk of the linear-cost causal forms: the chunk×chunk matrices cost `CAUSAL_CHUNK` multiply-adds
# per token and channel, the chunk-to-chunk states one per chunk.
CAUSAL_CHUNK = 64


def chunk_tokens(x: Tensor, chunk_size: int) -> Tensor:
    """(B, h, n, ...) -> (B, h, K, chunk_size, ...) with K = ⌈n / chunk_size⌉, zero-padded after the last token.

    Padding comes after every real token, so a causal form never mixes it into a real token's output.
    """
    shape = list(x.shape)
    num_chunks = (shape[2] + chunk_size - 1) // chunk_size
    pad = num_chunks * chunk_size - shape[2]
    if pad:
        x = torch.cat([x, x.new_zeros(shape[:2] + [pad] + shape[3:])], dim=2)
    return x.reshape(shape[:2] + [num_chunks, chunk_size] + shape[3:])


def later_tokens(n: int, m: int, device: torch.device, first_row: int = 0) -> Tensor:
    """(n, m) bool, True where key j comes after query row i: j > first_row + i."""
    return torch.ones(n, m, dtype=torch.bool, device=device).triu_(first_row + 1)


def no_causal_form(name: str, reason: str) -> ValueError:
    """The one-line error of an attention that refuses `causal=True`."""
    return ValueError(f"{name} attention has no causal form: {reason}")


def check_causal_grouping(grouping: str, grouping_kwargs: Mapping[str, Any]) -> None:
    """A ValueError unless `grouping` keeps every token in one sequence, the order a causal mask follows."""
    if grouping == 'global' or (grouping == 'reduction' and grouping_kwargs.get('sr_ratio', 1) == 1
                                and grouping_kwargs.get('pool_size') is None):
        return
    what = _GROUPED_BY.get(grouping, f'{grouping} groups')
    raise ValueError(f"causal=True needs one sequence of tokens (grouping 'global', or 'reduction' with sr_ratio=1 "
                     f"and no pool_size); "
                     f"grouping {grouping!r} mixes {what}, where token order has no meaning")


_GROUPED_BY = {
    'reduction': 'queries with keys pooled from patches of the grid',
    'window': 'tokens within windows of the grid',
    'stripes': 'tokens within stripes of the grid',
}
