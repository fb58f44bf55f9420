"""Record the attention weights of any model of the zoo: `with record_attention(model) as rec: model(x)`.

Temporary forward pre-hooks on the chosen attention layers (the groupings) and their mixers keep references to the
grouped q, k, v and context of the last forward; they are removed on exit, so the model carries no state and its
outputs do not change. Nothing is formed during the forward pass: `rec[layer]` forms the layer's weights with
`matrices.mixer_weights`, only for the requested query rows, and maps windows, shifted windows and stripes back to
the token order of the layer's input, so that a query's row can be drawn on the image. On a grid that does not
divide into windows or stripes, the weights on the padding (outside the image) are left out, so those rows sum to
less. Stripes pad q, k and v with zeros, so their rows still reproduce the output; windows pad the tokens before
the projection to q, k, v, whose bias is then the padding's value, so theirs reproduce it only with that term.

Each layer's grid is placed on the image by the pixel stride of its cells (the `reduction` of the model's
`feature_info` stage that holds it) and the size of the images the model was called on: a grid padded below and
right before a patch merging or rounded up by a strided convolution (Swin, CSwin, PVT v2 at sizes that do not halve
evenly) covers more than the image, its last cells partly outside it.
"""
import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.grouping import (
    CrossShapedAttention, GroupedAttention, SpatialReductionAttention, StripeBranch,
)
from ..attention.layout import (
    Grid, image_to_tokens, pad_tokens, padded_grid, split_heads, tokens_to_image, window_partition,
)
from ..attention.mixer import MixContext, Mixer
from .matrices import matrix_function, mixer_weights, pools_tokens

__all__ = ['LayerAttention', 'AttentionRecord', 'record_attention', 'attention_layers', 'cell_centres', 'Query']

# A query: a token index of the layer's input (0 is a class token), or a point (y, x) of the image as fractions
# of its height and width in [0, 1), resolved to the grid token whose cell covers it in every layer.
Query = Union[int, Tuple[float, float]]


@dataclass
class LayerAttention:
    """The attention of one layer for a batch of B images, in the token order of the layer's input.

    name: the layer's module name; attention: the registered attention name.
    grid: (H, W) grid of the N - num_prefix_tokens query tokens; key_grid: (h, w) grid of the key tokens
        (smaller than `grid` under spatial reduction).
    queries: (R,) token index of each row of `weights`; None for additive attention, whose rows are pools.
    weights: (B, heads, R, M) rows over the M key tokens, zero outside a query's window or stripe; for additive
        attention the G query-pooling then the G key-pooling distributions of its G groups (R = 2G; where heads
        have different group counts, as CSwin's two stripe branches on a non-square grid, G is the largest and a
        head's rows past its own count are empty). Where the grid is padded to whole windows or stripes the
        padding's weights are left out: such rows sum to less.
    query_vectors: (B, heads, R, d) the query of each row (None for pools).
    values: (B, heads, M, d), so that `weights @ values` is each row's global term.
    local: (B, N, C) the local term added to the global one (InLine's residual, FLatten's depthwise
        convolution, CSwin's LePE), or None.
    extras: per-token maps: (B, heads, N) over the query tokens (SimA's 'q_norm') or (B, heads, M) over the key
        tokens (its 'k_norm', on `key_grid`).
    extent: the share (height, width) of the image, from its top left corner, that `grid` covers: above 1 where the
        grid was padded or rounded up (Swin at 40: the 3×3 grid of stage 2, padded from 5×5 before the merging, has
        16-pixel cells over 48×48 pixels, 1.2); 1 where the stride is not known (a layer run on its own).
    key_extent: the share (height, width) of the image, from its top left corner, that the key grid covers: less
        than `extent` where a strided reduction leaves the grid's last rows or columns out (PVT v2 at 80: a 20×20
        grid under stride 8 gives 2×2 keys over its first 16×16 cells, 0.8).
    """
    name: str
    attention: str
    grid: Grid
    key_grid: Grid
    num_prefix_tokens: int
    queries: Optional[Tensor]
    weights: Tensor
    query_vectors: Optional[Tensor]
    values: Tensor
    local: Optional[Tensor] = None
    extras: Dict[str, Tensor] = field(default_factory=dict)
    extent: Tuple[float, float] = (1.0, 1.0)
    key_extent: Tuple[float, float] = (1.0, 1.0)

    @property
    def is_pooling(self) -> bool:
        return self.queries is None


def attention_layers(model: nn.Module) -> Dict[str, GroupedAttention]:
    """Every attention layer (grouping module) of `model` by module name, in forward order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, GroupedAttention)}


def cell_centres(grid: Grid, extent: Tuple[float, float], image_size: Grid,
                 device: Optional[torch.device] = None) -> Tensor:
    """(h·w, 2) pixel coordinates (y, x) of the centres of the `grid` (h, w) cells that cover the `extent` share of
    an image of `image_size` (H, W) from its top left corner: of each cell's part inside the image, which is all of
    it but for the last cells of a padded grid."""
    axes = []
    for cells, share, side in zip(grid, extent, image_size):
        edges = (torch.arange(cells + 1, device=device, dtype=torch.float64) * (side * share / cells)).clamp(max=side)
        axes.append((edges[:-1] + edges[1:]) / 2)
    return torch.stack(torch.meshgrid(*axes, indexing='ij'), dim=-1).view(-1, 2)


def _strides(model: nn.Module, layers: Sequence[str]) -> Dict[str, int]:
    """The pixel stride of the grid cells of each of `layers` that lies in a stage of `model`'s `feature_info`
    (timm's `reduction` of the stage); a layer outside every stage (one recorded on its own) has none."""
    stages = getattr(model, 'feature_info', None)
    stages = stages if isinstance(stages, list) else []  # timm's features-only wrappers hold a FeatureInfo
    return {name: stage['reduction'] for name in layers for stage in stages if name.startswith(stage['module'] + '.')}


def _select_layers(model: nn.Module, layers: Optional[Sequence[Union[str, int]]]) -> Dict[str, GroupedAttention]:
    found = attention_layers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention layer of this zoo")
    names = list(found)
    if layers is not None and not len(layers):
        raise ValueError(f"layers {layers!r} selects no layer; expected None for all {len(names)} or indices / names "
                         f"of some, e.g. [-1] for the last")
    chosen: Dict[str, GroupedAttention] = {} if layers is not None else found
    for layer in layers or ():
        if isinstance(layer, int) and -len(names) <= layer < len(names):
            layer = names[layer]
        if layer not in found:
            raise ValueError(f"unknown layer {layer!r}; expected an index from {-len(names)} to {len(names) - 1} or "
                             f"one of {', '.join(names)}")
        chosen[layer] = found[layer]
    for name, layer in chosen.items():
        if any(getattr(module, 'causal', False) for module in layer.modules()):
            raise ValueError(f"layer {name!r} is causal; recording forms the non-causal matrices only, expected a "
                             f"model built without causal=True")
        for _, mixer, _ in _mixers(layer):  # before the model runs, not when the first layer is read
            matrix_function(type(mixer))
    return chosen


@dataclass
class _Call:
    """One mixer call: its branch (CSwin's stripe direction, else 0) and its grouped inputs."""
    branch: int
    q: Tensor
    k: Tensor
    v: Tensor
    ctx: MixContext


@dataclass
class _Capture:
    batch: int = 0
    tokens: int = 0
    size: Grid = (0, 0)
    image: Optional[Grid] = None  # (H, W) of the images of the model's call the layer ran in; None: run on its own
    calls: List[_Call] = field(default_factory=list)


def _mixers(layer: GroupedAttention) -> List[Tuple[int, Mixer, Optional[StripeBranch]]]:
    if isinstance(layer, CrossShapedAttention):
        return [(i, branch.mixer, branch) for i, branch in enumerate(layer.attns)]
    return [(0, layer.mixer, None)]


def _origin(layer: GroupedAttention, branch: Optional[StripeBranch], size: Grid, num_tokens: int) -> Tensor:
    """(G, n) token index, in the layer's input, of every position of the G groups of one image; a position in
    the padding of a grid that does not divide into the windows takes `num_tokens`, a row `_ungroup` drops."""
    window = branch.stripe_on(size) if branch is not None else getattr(layer, 'window', None)
    if window is None:
        return torch.arange(num_tokens).view(1, num_tokens)
    # numbered from 1, so that the layer's zero padding reads as index -1
    index = torch.arange(1, num_tokens + 1).view(1, num_tokens, 1)
    padded = padded_grid(size, window)
    if branch is not None:
        grouped = window_partition(pad_tokens(index, size, padded) if padded != size else index, padded, window)
    else:
        grouped = layer._group(index, size, padded)
    origin = grouped.squeeze(-1) - 1
    return origin.masked_fill(origin < 0, num_tokens)


def _cell(fraction: float, cells: int, covered: float) -> int:
    """The cell of `cells` equal cells of [0, covered) that holds `fraction` (the last one for a fraction past them),
    where a fraction on a cell's edge (15 / 22) belongs to that cell though its float product with `cells` falls just
    below the edge (14.999999999999998)."""
    return min(int(fraction * cells / covered + 1e-9), cells - 1)


def _check_queries(queries: Optional[Sequence[Any]]) -> Optional[List[Query]]:
    """`queries` as ints (token indices: Python, NumPy or one-element tensor integers, as `np.argsort` gives them)
    and (y, x) float pairs, before the model runs; a ValueError naming one that is neither or a point outside the
    image."""
    if queries is None:
        return None
    checked: List[Query] = []
    for query in queries:
        if not isinstance(query, bool):
            try:
                checked.append(operator.index(query))
                continue
            except TypeError:
                pass
        try:
            y, x = (float(side) for side in query)
        except (TypeError, ValueError):
            raise ValueError(f"query {query!r} is neither a token index nor a (y, x) point; expected an integer or "
                             f"a pair of fractions in [0, 1)") from None
        if not (0 <= y < 1 and 0 <= x < 1):
            raise ValueError(f"query point {query} is outside the image; expected fractions in [0, 1)")
        checked.append((y, x))
    return checked


def _resolve_queries(queries: Sequence[Query], num_prefix: int, grid: Grid, extent: Tuple[float, float],
                     num_tokens: int) -> Tensor:
    """(R,) the token index of each query on `grid`, which covers the `extent` share of the image."""
    resolved = []
    for query in queries:
        if isinstance(query, int):
            if not 0 <= query < num_tokens:
                raise ValueError(f"query token {query} is outside the {num_tokens} tokens of the layer")
            resolved.append(query)
        else:
            y, x = query
            resolved.append(num_prefix + _cell(y, grid[0], extent[0]) * grid[1] + _cell(x, grid[1], extent[1]))
    return torch.tensor(resolved, dtype=torch.long)


class AttentionRecord:
    """What `record_attention` yields: `rec[name]` (or `rec[i]`) forms a layer's `LayerAttention` from the
    last forward; iterating gives the recorded layer names."""

    def __init__(self, layers: Dict[str, GroupedAttention], queries: Optional[Sequence[Query]],
                 strides: Dict[str, int]):
        self.layers = layers
        self.queries = _check_queries(queries)
        self.strides = strides
        self._image: Optional[Grid] = None
        self._captures: Dict[str, _Capture] = {name: _Capture() for name in layers}

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: Union[str, int]) -> LayerAttention:
        names = list(self.layers)
        if isinstance(layer, int) and not -len(names) <= layer < len(names):
            raise IndexError(f"layer {layer} was not recorded; expected an index from {-len(names)} to "
                             f"{len(names) - 1} of the {len(names)} recorded: {', '.join(names)}")
        name = names[layer] if isinstance(layer, int) else layer
        if name not in self.layers:
            raise KeyError(f"layer {name!r} was not recorded; recorded: {', '.join(self.layers)}")
        capture = self._captures[name]
        if not capture.calls:
            raise RuntimeError(f"layer {name!r} has not run since recording began (a model compiled before the "
                               f"recording began runs without its hooks: record the model itself)")
        return self._form(name, self.layers[name], capture)

    def _on_model(self, module: nn.Module, args: Tuple) -> None:
        """Keep the (H, W) of the (B, C, H, W) images the model is called on (a layer run on its own takes tokens)."""
        self._image = tuple(args[0].shape[-2:]) if args and isinstance(args[0], Tensor) and args[0].dim() == 4 \
            else None

    def _hooks(self, name: str, layer: GroupedAttention) -> List[Any]:
        capture = self._captures[name]

        def on_layer(module: nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> None:
            x = args[0]
            capture.batch, capture.tokens = x.shape[:2]
            capture.size = tuple(args[1] if len(args) > 1 else kwargs['size'])
            capture.image = self._image
            capture.calls = []

        def on_mixer(branch: int):
            def hook(module: nn.Module, args: Tuple) -> None:
                q, k, v, ctx = (t.detach() if isinstance(t, Tensor) else t for t in args)
                capture.calls.append(_Call(branch, q, k, v, ctx))
            return hook

        handles = [layer.register_forward_pre_hook(on_layer, with_kwargs=True)]
        handles += [mixer.register_forward_pre_hook(on_mixer(i)) for i, mixer, _ in _mixers(layer)]
        return handles

    def _form(self, name: str, layer: GroupedAttention, capture: _Capture) -> LayerAttention:
        B, N, size = capture.batch, capture.tokens, capture.size
        num_prefix = N - size[0] * size[1]
        mixers = _mixers(layer)
        attention = mixers[0][1].attention_name
        pooling = pools_tokens(type(mixers[0][1]))
        # a cell's side in pixels and the image's (H, W); without them (a layer run on its own) the grid tiles the
        # image, one pixel per cell
        stride, image = (self.strides[name], capture.image) if name in self.strides and capture.image else (1, size)
        extent = (size[0] * stride / image[0], size[1] * stride / image[1])
        key_grid, key_extent = size, extent
        if isinstance(layer, SpatialReductionAttention) and layer.pool_size is not None:
            key_grid = (layer.pool_size, layer.pool_size)
        elif isinstance(layer, SpatialReductionAttention) and layer.sr_ratio > 1:
            key_grid = (size[0] // layer.sr_ratio, size[1] // layer.sr_ratio)
            key_extent = (key_grid[0] * layer.sr_ratio * stride / image[0],
                          key_grid[1] * layer.sr_ratio * stride / image[1])
        M = num_prefix + key_grid[0] * key_grid[1]
        device = capture.calls[0].q.device
        work = torch.promote_types(capture.calls[0].q.dtype, torch.float32)
        queries = None
        if not pooling:
            queries = torch.arange(N) if self.queries is None else \
                _resolve_queries(self.queries, num_prefix, size, extent, N)
            queries = queries.to(device)
        C, heads = layer.dim, layer.num_heads
        q_full = torch.zeros(B, N, C, dtype=work, device=device)
        v_full = torch.zeros(B, M, C, dtype=work, device=device)
        local: Optional[Tensor] = None
        extras: Dict[str, Tensor] = {}
        parts: List[Tuple[int, Tensor]] = []  # (first head, rows) per call
        origins = [_origin(layer, mixers[call.branch][2], size, N).to(device) for call in capture.calls]
        # the pools of every head on as many rows: CSwin's branches on a non-square grid have unequal group counts
        groups = max(origin.shape[0] for origin in origins)
        for call, origin in zip(capture.calls, origins):
            _, mixer, branch = mixers[call.branch]
            reduced = call.k.shape[1] != call.q.shape[1]
            key_origin = torch.arange(call.k.shape[1], device=device)[None] if reduced else origin
            G, n = origin.shape
            h = mixer.num_heads
            channels = slice(call.branch * mixer.dim, (call.branch + 1) * mixer.dim)
            q_full[:, :, channels] = _ungroup(call.q.to(work), origin, B, N)
            v_full[:, :, channels] = _ungroup(call.v.to(work), key_origin, B, M)
            whole = self.queries is None or pooling
            # all rows at once, or none: the local term and extras of every group without a row of weights
            result = mixer_weights(mixer, call.q, call.k, call.v, call.ctx,
                                   None if whole else torch.zeros(0, dtype=torch.long, device=device))
            if (result.pools if pooling else result.weights) is None:
                registered = 'with pools=True, but returns no pools' if pooling else \
                    'without pools=True, but returns pools'
                raise ValueError(f"the attention matrix function of {type(mixer).__name__} is registered "
                                 f"{registered}; expected attention_matrix(..., pools=True) for a function that "
                                 f"returns pools (B', heads, 2, n), else one that returns weights (B', heads, r, m)")
            if pooling:
                pools = result.pools.view(B, G, h, 2, n)
                # a last column for the padding's positions, dropped with it
                rows = torch.zeros(B, h, 2 * groups, N + 1, dtype=work, device=device)
                for g in range(G):
                    rows[:, :, g, origin[g]] = pools[:, g, :, 0]
                    rows[:, :, groups + g, origin[g]] = pools[:, g, :, 1]
                rows = rows[..., :N]
            else:
                # a last row and column for the padding's positions, dropped with them
                rows = torch.zeros(B, h, len(queries) + 1, M + 1, dtype=work, device=device)
                for g in range(G):
                    keys = key_origin[g].unsqueeze(0)
                    if whole:
                        rows[:, :, origin[g].unsqueeze(1), keys] = result.weights.view(B, G, h, n, -1)[:, g]
                        continue
                    hit = (queries.unsqueeze(1) == origin[g].unsqueeze(0)).nonzero()
                    if len(hit):
                        picked = torch.arange(g, B * G, G, device=device)
                        weights = mixer_weights(mixer, call.q[picked], call.k[picked], call.v[picked],
                                                _group_context(call.ctx, picked, g), hit[:, 1]).weights
                        rows[:, :, hit[:, 0].unsqueeze(1), keys] = weights
                rows = rows[:, :, :-1, :-1]
            parts.append((call.branch * h, rows))
            call_local = _with_lepe(result.local, branch, call)
            if call_local is not None:
                local = torch.zeros(B, N, C, dtype=work, device=device) if local is None else local
                local[:, :, channels] += _ungroup(call_local.to(work), origin, B, N)
            for key, value in result.extras.items():
                # over the query tokens, or over the keys where they come from a reduced map (SimA's 'k_norm')
                tokens, where = (M, key_origin) if reduced and value.shape[-1] == call.k.shape[1] else (N, origin)
                extras.setdefault(key, torch.zeros(B, heads, tokens, dtype=work, device=device))
                extras[key][:, call.branch * h:(call.branch + 1) * h] = _ungroup(
                    value.transpose(1, 2), where, B, tokens).transpose(1, 2)
        weights = torch.cat([rows for _, rows in sorted(parts, key=lambda part: part[0])], dim=1)
        query_vectors = None if pooling else split_heads(q_full, heads)[:, :, queries]
        return LayerAttention(name, attention, size, key_grid, num_prefix, queries, weights, query_vectors,
                              split_heads(v_full, heads), local, extras, extent, key_extent)


def _ungroup(x: Tensor, origin: Tensor, batch: int, num_tokens: int) -> Tensor:
    """(B·G, n, C) grouped tokens -> (B, num_tokens, C) in the order `origin` (G, n) gives, the padding's
    positions (`num_tokens` in `origin`) dropped."""
    G, n = origin.shape
    out = x.new_zeros(batch, num_tokens + 1, x.shape[-1])
    out[:, origin.reshape(-1)] = x.reshape(batch, G * n, -1)
    return out[:, :num_tokens]


def _group_context(ctx: MixContext, picked: Tensor, group: int) -> MixContext:
    """The context of group `group` of every image (the groups `picked` of the call)."""
    mask = None if ctx.mask is None else ctx.mask[group % ctx.mask.shape[0]].unsqueeze(0)
    tokens = None if ctx.tokens is None else ctx.tokens[picked]
    return ctx._replace(mask=mask, tokens=tokens)


def _with_lepe(local: Optional[Tensor], branch: Optional[StripeBranch], call: _Call) -> Optional[Tensor]:
    """The mixer's local term plus CSwin's LePE (the branch's depthwise `get_v` of V in each stripe), (B', n, C')."""
    if branch is None:
        return local
    conv = branch.get_v
    v = call.v.to(torch.promote_types(call.v.dtype, torch.float32))
    lepe = image_to_tokens(F.conv2d(tokens_to_image(v, call.ctx.grid), conv.weight.to(v.dtype), conv.bias.to(v.dtype),
                                    padding=conv.padding, groups=conv.groups))
    return lepe if local is None else local + lepe


@contextlib.contextmanager
def record_attention(model: nn.Module, layers: Optional[Sequence[Union[str, int]]] = None,
                     queries: Optional[Sequence[Query]] = None) -> Iterator[AttentionRecord]:
    """Record the attention of `layers` (module names or indices into `attention_layers(model)`; None: all) for
    `queries` (token indices or image points; None: every token) while the block runs. Call the model itself on the
    images, `model(images)`: their size places a padded grid on them (`LayerAttention.extent`).

        with record_attention(model, layers=[-1], queries=[0]) as rec:
            model(images)
        row = rec[-1].weights  # (B, heads, 1, M): the class token's attention in the last layer
    """
    chosen = _select_layers(model, layers)
    record = AttentionRecord(chosen, queries, _strides(model, list(chosen)))
    handles = [model.register_forward_pre_hook(record._on_model)]
    handles += [handle for name, layer in record.layers.items() for handle in record._hooks(name, layer)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()
