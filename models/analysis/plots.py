"""Figures of recorded attention, with matplotlib (Agg backend): a query's map per head over the image,
attention rollout, Grad-CAM (pytorch-grad-cam), SimA's token norms, MultiMax's σ per layer, the 2-simplex of
MultiMax against softmax, SparseMax and EntMax-1.5, and per-layer curves of the statistics.

Needs the `analysis` extra: `pip install -e '.[analysis]'`.
"""
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import matplotlib
import matplotlib.lines
import matplotlib.ticker
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from entmax import entmax15, sparsemax  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from .._files import atomic_write  # noqa: E402
from ..attention.multimax import MultiMaxMixer, multimax_modulation  # noqa: E402
from .record import LayerAttention, attention_layers, cell_centres  # noqa: E402

__all__ = [
    'grid_map', 'plot_query_maps', 'rollout_problem', 'attention_rollout', 'plot_heat_map', 'grad_cam',
    'plot_token_norms', 'plot_multimax_sigma', 'simplex_logits', 'simplex_points', 'plot_simplex', 'plot_layer_curves',
]

SIMPLEX_TEMPERATURES = (0.5, 1.0, 2.0)


def _save(fig: plt.Figure, path: str) -> None:
    """Write `fig` to `path` in the format its extension names, whole or not at all (a figure interrupted half-way
    leaves the previous file), then free it."""
    fmt = os.path.splitext(path)[1][1:].lower() or None
    try:
        atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=100))
    finally:
        plt.close(fig)


def grid_map(layer: LayerAttention, row: int, image: int = 0) -> Tensor:
    """(heads, h, w) the weights of `row` over the key grid (prefix keys left out)."""
    weights = layer.weights[image, :, row, layer.num_prefix_tokens:]
    return weights.reshape(weights.shape[0], *layer.key_grid).float().cpu()


def _show_image(ax: plt.Axes, image: np.ndarray) -> None:
    ax.imshow(image, cmap='gray' if image.ndim == 2 else None, extent=(0, image.shape[1], image.shape[0], 0))
    ax.set_xticks([])
    ax.set_yticks([])


def _overlay(ax: plt.Axes, image: np.ndarray, values: np.ndarray, signed: bool,
             covered: Tuple[float, float] = (1.0, 1.0)) -> matplotlib.image.AxesImage:
    """`values` (h, w) stretched over the `covered` share (height, width) of `image` from its top left corner, cut
    at the image's edges where it covers more (a padded grid): signed values on a diverging scale centred at zero."""
    _show_image(ax, image)
    extent = (0, image.shape[1] * covered[1], image.shape[0] * covered[0], 0)
    if signed:
        bound = float(np.abs(values).max()) or 1.0
        shown = ax.imshow(values, cmap='RdBu_r', vmin=-bound, vmax=bound, alpha=0.6, extent=extent,
                          interpolation='nearest')
    else:
        shown = ax.imshow(values, cmap='inferno', alpha=0.6, extent=extent, interpolation='nearest')
    # a map past the image widened the axes to it
    ax.set_xlim(0, image.shape[1])
    ax.set_ylim(image.shape[0], 0)
    return shown


def plot_query_maps(image: np.ndarray, layer: LayerAttention, row: int, path: str, image_index: int = 0) -> None:
    """One panel per head: the row `row` of `layer` over `image` (H, W) or (H, W, 3), the query marked.

    For additive attention `row` is a pooling distribution (rows [0, G) query pools, [G, 2G) key pools)."""
    maps = grid_map(layer, row, image_index).numpy()
    heads = maps.shape[0]
    signed = bool((maps < 0).any())
    # the layer's name on a line of its own: one head's panel is narrower than the title on one line
    fig, axes = plt.subplots(1, heads, figsize=(max(2.6 * heads, 3.2), 3.0), squeeze=False)
    if layer.is_pooling:
        G = layer.weights.shape[2] // 2
        title = f"{layer.attention}: {'query' if row < G else 'key'} pooling\n{layer.name}"
    else:
        token = int(layer.queries[row])
        title = f"{layer.attention}: query token {token}\n{layer.name}"
    for head, ax in enumerate(axes[0]):
        shown = _overlay(ax, image, maps[head], signed, layer.key_extent)
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(f'head {head}', fontsize=9)
        if not layer.is_pooling and token >= layer.num_prefix_tokens:
            y, x = cell_centres(layer.grid, layer.extent, image.shape[:2])[token - layer.num_prefix_tokens].tolist()
            ax.plot([x], [y], marker='x', color='cyan', markersize=8, mew=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def rollout_problem(layers: Sequence[LayerAttention]) -> Optional[str]:
    """Why `attention_rollout` is not defined on `layers`, or None: it needs every layer's weights of every token
    over the same tokens, a class token among them (not so in PVT's stages, XCiT's channel attention or pooling
    layers)."""
    for layer in layers:
        tokens = layer.weights.shape[-1]
        if (layer.is_pooling or layer.num_prefix_tokens == 0 or layer.weights.shape[-2] != tokens
                or tokens != layers[0].weights.shape[-1]):
            return (f"rollout needs every token's row over the same tokens, a class token among them; layer "
                    f"{layer.name!r} ({layer.attention}) has weights of shape {tuple(layer.weights.shape)}")
    return None


def attention_rollout(layers: Sequence[LayerAttention]) -> Tensor:
    """(B, H, W) attention rollout of the first prefix token (the class token) over the grid.

    Each layer's full N×N matrix, averaged over the heads, plus the identity for the residual connection and
    renormalised by its row sums, multiplied in forward order; every layer must be recorded for every token
    (`rollout_problem` says why not).
    """
    problem = rollout_problem(layers)
    if problem is not None:
        raise ValueError(problem)
    joint: Optional[Tensor] = None
    for layer in layers:
        mixed = layer.weights.mean(dim=1) + torch.eye(layer.weights.shape[-1], dtype=layer.weights.dtype,
                                                      device=layer.weights.device)
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        joint = mixed if joint is None else mixed @ joint
    last = layers[-1]
    return joint[:, 0, last.num_prefix_tokens:].reshape(-1, *last.grid).float().cpu()


def plot_heat_map(image: np.ndarray, values: np.ndarray, title: str, path: str) -> None:
    """`values` (h, w) over `image`, one panel."""
    fig, ax = plt.subplots(figsize=(3.2, 3.2))
    shown = _overlay(ax, image, values, bool((values < 0).any()))
    fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def grad_cam(model: nn.Module, images: Tensor, targets: Optional[Sequence[int]] = None) -> np.ndarray:
    """(B, H, W) Grad-CAM of `images` (B, 3, H, W) for the classes `targets` (default: the predicted ones), on
    the input of the last attention layer (its block's `norm1`), grid tokens reshaped to the layer's grid.

    The input, not the output: a class-token model reads its last block's patch tokens only through that
    attention, so the gradient at its output is zero on the patches."""
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    name, layer = list(attention_layers(model).items())[-1]
    norm = model.get_submodule(name.rsplit('.', 1)[0]).norm1
    size: Dict[str, Tuple[int, int]] = {}

    def keep_size(module: nn.Module, args: Tuple, kwargs: Mapping) -> None:
        size['grid'] = tuple(args[1] if len(args) > 1 else kwargs['size'])

    # the grid is known once the layer has run, after `norm1`'s output is reshaped: one forward pass finds it
    handle = layer.register_forward_pre_hook(keep_size, with_kwargs=True)
    try:
        with torch.no_grad():
            model(images[:1])
    finally:
        handle.remove()

    def reshape(tokens: Tensor) -> Tensor:
        H, W = size['grid']
        return tokens[:, tokens.shape[1] - H * W:].reshape(tokens.shape[0], H, W, -1).permute(0, 3, 1, 2)

    with GradCAM(model=model, target_layers=[norm], reshape_transform=reshape) as cam:
        wanted = None if targets is None else [ClassifierOutputTarget(t) for t in targets]
        return cam(input_tensor=images, targets=wanted)


def plot_token_norms(image: np.ndarray, layer: LayerAttention, path: str, image_index: int = 0) -> None:
    """SimA's ‖q̂‖ of every grid query and ‖k̂‖ of every grid key (on the reduced map where keys are reduced) over
    `image`, averaged over the heads."""
    prefix = layer.num_prefix_tokens
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 3.2))
    for ax, key, grid, covered in zip(axes, ('q_norm', 'k_norm'), (layer.grid, layer.key_grid),
                                      (layer.extent, layer.key_extent)):
        values = layer.extras[key][image_index, :, prefix:].mean(dim=0).reshape(grid).float().cpu().numpy()
        shown = _overlay(ax, image, values, signed=False, covered=covered)
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(f"‖{key[0]}̂‖, {layer.name}", fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_multimax_sigma(model: nn.Module, path: str, span: float = 6.0) -> None:
    """MultiMax's learned σ(x) of every layer over [−span, span], beside the identity (softmax)."""
    x = torch.linspace(-span, span, 241, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    ax.plot(x, x, color='grey', linestyle='--', label='identity (softmax)')
    for name, module in model.named_modules():
        if isinstance(module, MultiMaxMixer):
            sigma = multimax_modulation(x, module.ranges.detach().double(), module.ts.detach().double())
            ax.plot(x, sigma, label=name.rsplit('.mixer', 1)[0])
    ax.set_xlabel('score x')
    ax.set_ylabel('σ(x)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)


def simplex_logits(steps: int = 41, span: float = 3.0) -> Tensor:
    """(steps², 3) float64 logits (x₁, x₂, 0) on a square grid of side 2·span."""
    axis = torch.linspace(-span, span, steps, dtype=torch.float64)
    x1, x2 = torch.meshgrid(axis, axis, indexing='ij')
    return torch.stack([x1.flatten(), x2.flatten(), torch.zeros(steps * steps, dtype=torch.float64)], dim=-1)


def simplex_points(logits: Tensor, ranges: Optional[Tensor] = None, ts: Optional[Tensor] = None
                   ) -> Dict[str, Tensor]:
    """Each map's probabilities (P, 3) of `logits` (P, 3): softmax at `SIMPLEX_TEMPERATURES`, SparseMax,
    EntMax-1.5 and, given its `ranges` and `ts`, MultiMax (the softmax of σ(x))."""
    points = {f'softmax T={t:g}': (logits / t).softmax(dim=-1) for t in SIMPLEX_TEMPERATURES}
    points['sparsemax'] = sparsemax(logits, dim=-1)
    points['entmax-1.5'] = entmax15(logits, dim=-1)
    if ranges is not None:
        points['multimax'] = multimax_modulation(logits, ranges.double(), ts.double()).softmax(dim=-1)
    return points


def _barycentric(points: Tensor) -> np.ndarray:
    """(P, 3) points of the simplex -> (P, 2) positions in an equilateral triangle."""
    corners = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 3 ** 0.5 / 2]], dtype=points.dtype)
    return (points @ corners).numpy()


def plot_simplex(path: str, ranges: Optional[Tensor] = None, ts: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """The 2-simplex figure: where each map sends a grid of logits (x₁, x₂, 0), coloured by x₁ − x₂; returns
    the points drawn."""
    logits = simplex_logits()
    points = simplex_points(logits, ranges, ts)
    fig, axes = plt.subplots(1, len(points), figsize=(2.6 * len(points), 2.6))
    triangle = _barycentric(torch.eye(3, dtype=torch.float64))
    for ax, (name, p) in zip(axes, points.items()):
        ax.fill(triangle[:, 0], triangle[:, 1], facecolor='none', edgecolor='black', linewidth=0.8)
        xy = _barycentric(p)
        ax.scatter(xy[:, 0], xy[:, 1], c=(logits[:, 0] - logits[:, 1]).numpy(), cmap='coolwarm', s=3)
        ax.set_title(name, fontsize=9)
        ax.set_aspect('equal')
        ax.axis('off')
    fig.tight_layout()
    _save(fig, path)
    return points


def plot_layer_curves(rows: Sequence[Mapping[str, object]], statistics: Sequence[str], path: str,
                      label: Callable[[Mapping[str, object]], str] = lambda row: str(row['model'])) -> None:
    """One panel per statistic: its mean over the heads against the layer depth, one line per `label(row)`, in one
    colour per label on every panel (a statistic that does not apply to an attention leaves its line out), and one
    legend of every label below the panels."""
    fig, axes = plt.subplots(1, len(statistics), figsize=(3.6 * len(statistics), 3.6), squeeze=False)
    names = list(dict.fromkeys(label(row) for row in rows))
    cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
    colours = {name: cycle[i % len(cycle)] for i, name in enumerate(names)}
    for ax, statistic in zip(axes[0], statistics):
        series: Dict[str, Dict[int, List[float]]] = {}
        for row in rows:
            series.setdefault(label(row), {}).setdefault(int(row['depth']), []).append(float(row[statistic]))
        for name, by_depth in series.items():
            if all(np.isnan(by_depth[d]).all() for d in by_depth):
                continue
            depths = sorted(by_depth)
            ax.plot(depths, [np.nanmean(by_depth[d]) for d in depths], marker='o', color=colours[name])
        ax.set_xlabel('layer')
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title(statistic, fontsize=10)
    handles = [matplotlib.lines.Line2D([], [], color=colours[name], marker='o', label=name) for name in names]
    fig.legend(handles=handles, loc='lower center', ncol=min(len(names), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _save(fig, path)
