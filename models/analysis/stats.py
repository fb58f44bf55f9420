"""Statistics of recorded attention rows, per layer and head, accumulated over a data set.

Every statistic is taken on a row's mass p = |w| / Σ|w| (rows of InLine and SimA can be negative; for the
distributions of the other attentions p = w), then averaged over the rows and images seen:

- `entropy` (nats) and `effective_tokens` = exp(entropy), the number of equally weighted tokens of that entropy;
- `top5_mass`: the mass of the five largest weights;
- `gini`: the Gini coefficient of the row (0: uniform, → 1: one token);
- `near_zero`: the share of weights below 1 % of the uniform weight 1/M;
- `negative`: the share of weights below zero (of w, not p);
- `distance_px`: the mean distance in pixels from the query to the keys, weighted by p over the grid keys (the
  "attention distance" of the ViT paper), for grid queries, each token at the centre of its cell's part inside the
  image (a padded grid's last cells reach past it);
- `collisions`: the injectivity probe, the share of pairs of queries of one image and head that differ (beyond
  `query_rtol` of their size, in the max norm) yet get the same row (within `row_rtol` of its size);
- `rank`: the numerical rank of the R × M matrix of recorded rows (`torch.linalg.matrix_rank`'s tolerance for the
  dtype the rows were formed in).

In windows and stripes the keys outside a query's group count as zero weights of its row. Additive attention's
rows are its pooling distributions, which belong to no query: distance and the injectivity
probe do not apply to them (NaN), and the empty rows of heads with fewer groups than others are not counted.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .record import LayerAttention, cell_centres

__all__ = ['STATISTICS', 'row_statistics', 'collision_share', 'AttentionStatistics']

STATISTICS = ('entropy', 'effective_tokens', 'top5_mass', 'gini', 'near_zero', 'negative', 'distance_px',
              'collisions', 'rank')


def _mass(weights: Tensor) -> Tensor:
    magnitude = weights.abs()
    return magnitude / magnitude.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def _gini(mass: Tensor) -> Tensor:
    """(..., M) rows of mass summing to one -> (...) Gini coefficients: Σ_i (2i − M − 1)·p_(i) / M, p sorted."""
    M = mass.shape[-1]
    ranks = torch.arange(1, M + 1, dtype=mass.dtype, device=mass.device)
    return (mass.sort(dim=-1).values * (2 * ranks - M - 1)).sum(dim=-1) / M


def collision_share(weights: Tensor, query_vectors: Tensor, row_rtol: float = 1e-5,
                    query_rtol: float = 1e-3) -> Tensor:
    """weights: (B, heads, R, M), query_vectors: (B, heads, R, d) -> (heads,) share of pairs of different queries
    with the same row, over the pairs of different queries of every image (0 where there are none)."""
    def close(x: Tensor, rtol: float) -> Tensor:
        scale = x.abs().amax(dim=-1)
        distance = torch.cdist(x, x, p=float('inf'))
        return distance <= rtol * torch.maximum(scale.unsqueeze(-1), scale.unsqueeze(-2))

    weights, query_vectors = weights.double(), query_vectors.double()
    upper = torch.ones(weights.shape[-2], weights.shape[-2], dtype=torch.bool, device=weights.device).triu(1)
    different = ~close(query_vectors, query_rtol) & upper
    colliding = close(weights, row_rtol) & different
    pairs = different.sum(dim=(0, 2, 3))
    return colliding.sum(dim=(0, 2, 3)) / pairs.clamp_min(1)


def row_statistics(layer: LayerAttention, image_size: Tuple[int, int], row_rtol: float = 1e-5,
                   query_rtol: float = 1e-3) -> Dict[str, Tensor]:
    """Every statistic of `STATISTICS` of one recorded layer, per head: (heads,) each,
    averaged over the rows and the B images."""
    weights = layer.weights.double()
    B, heads, R, M = weights.shape
    mass = _mass(weights)
    entropy = -(mass * mass.clamp_min(1e-300).log()).sum(dim=-1)
    stats = {
        'entropy': entropy,
        'effective_tokens': entropy.exp(),
        'top5_mass': mass.topk(min(5, M), dim=-1).values.sum(dim=-1),
        'gini': _gini(mass),
        'near_zero': (mass < 0.01 / M).double().mean(dim=-1),
        'negative': (weights < 0).double().mean(dim=-1),
    }
    if layer.is_pooling:  # the empty rows of heads with fewer groups than others (CSwin's branches) are no pools
        present = (weights != 0).any(dim=-1).double()
        out = {key: (value * present).sum(dim=(0, 2)) / present.sum(dim=(0, 2)) for key, value in stats.items()}
    else:
        out = {key: value.mean(dim=(0, 2)) for key, value in stats.items()}
    nan = torch.full((heads,), math.nan, dtype=torch.float64)
    out['distance_px'] = out['collisions'] = nan
    if not layer.is_pooling:
        out['distance_px'] = _distance(layer, mass, image_size)
        out['collisions'] = collision_share(weights, layer.query_vectors, row_rtol, query_rtol).cpu()
    # the rank tolerance of the precision the weights were formed in: float32 rounding is no extra rank
    out['rank'] = torch.linalg.matrix_rank(layer.weights).double().mean(dim=0).cpu()
    return {key: value.cpu() for key, value in out.items()}


def _distance(layer: LayerAttention, mass: Tensor, image_size: Tuple[int, int]) -> Tensor:
    """(heads,) mean pixel distance from the grid queries to the grid keys, weighted by the rows' mass."""
    prefix = layer.num_prefix_tokens
    grid_rows = layer.queries >= prefix
    if not grid_rows.any():
        return torch.full((mass.shape[1],), math.nan, dtype=torch.float64)
    device = mass.device
    queries = cell_centres(layer.grid, layer.extent, image_size, device)[layer.queries[grid_rows] - prefix]
    keys = cell_centres(layer.key_grid, layer.key_extent, image_size, device)
    grid_mass = mass[:, :, grid_rows, prefix:]
    grid_mass = grid_mass / grid_mass.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    return (grid_mass * torch.cdist(queries, keys)).sum(dim=-1).mean(dim=(0, 2)).cpu()


class AttentionStatistics:
    """Running means of `row_statistics` per layer over batches: `add(layer)` after every recorded forward,
    then `rows()` gives one dict per layer and head (layer, attention, head and every statistic)."""

    def __init__(self, image_size: Tuple[int, int]):
        self.image_size = image_size
        self._sums: Dict[str, Dict[str, Tensor]] = {}
        self._counts: Dict[str, int] = {}
        self._attention: Dict[str, str] = {}

    def add(self, layer: LayerAttention) -> None:
        batch = layer.weights.shape[0]
        stats = row_statistics(layer, self.image_size)
        sums = self._sums.setdefault(layer.name, {key: torch.zeros_like(value) for key, value in stats.items()})
        for key, value in stats.items():
            sums[key] += value * batch
        self._counts[layer.name] = self._counts.get(layer.name, 0) + batch
        self._attention[layer.name] = layer.attention

    def rows(self, model: Optional[str] = None) -> List[Dict[str, object]]:
        rows = []
        for depth, (name, sums) in enumerate(self._sums.items()):
            count = self._counts[name]
            heads = next(iter(sums.values())).shape[0]
            for head in range(heads):
                row: Dict[str, object] = {} if model is None else {'model': model}
                row.update(layer=name, depth=depth, attention=self._attention[name], head=head)
                row.update({key: sums[key][head].item() / count for key in STATISTICS})
                rows.append(row)
        return rows
