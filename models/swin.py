"""Swin Transformer (shifted windows) with the attention of every block taken from the registry by name.

The layout and state-dict names are those of the original Swin code, which the InLine and FLatten checkpoints
keep: `patch_embed.{proj,norm}`, `layers.{i}.blocks.{j}.{norm1,attn,norm2,mlp}`, patch merging
`layers.{i}.downsample.{norm,reduction}` at the END of stages 0-2, a final `norm`, mean pooling over tokens and a
`head` Linear. The attention windows itself: score-forming attentions get windows of `window_size` with a relative
position bias, shifted by half a window on odd blocks of a stage; linear attentions get `la_window_size` windows
(None: global, as the official linear blocks are at their trained resolution). A window as large as the grid
means global attention without shift, as in Swin.

Variants: `inline_swin_*` and `flatten_swin_*` (official InLine / FLatten models), `softmax_swin_*` (the original
Swin), and `multimax_swin_*`, `sima_swin_*`, `additive_swin_*` (the original's architecture with that attention).
"""
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from timm.layers import PatchEmbed, calculate_drop_path_rates, global_pool_nlc, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from .checkpoint import (
    check_state_dict, checkpoint_state_dict, drop_derived_buffers, resize_grid_embedding,
    resize_rel_pos_bias_table,
)
from ._common import (
    FLATTEN_META, INLINE_META, Block, check_global_pool, check_img_size, check_output_fmt, imagenet_cfg,
    init_weights, new_classifier, run_blocks, tsinghua_url,
)
from .attention import build_attention, is_linear_attention, method_kwargs, stage_attentions
from .attention.base import Grid, tokens_to_image

__all__ = ['SwinTransformer', 'checkpoint_filter_fn', 'resize_attention_tables']

GLOBAL_POOLS = ('avg', '')


def resize_attention_tables(
        state_dict: Dict[str, Tensor],
        model: nn.Module,
        module_name: Callable[[str], str] = lambda prefix: prefix,
) -> Dict[str, Tensor]:
    """Bicubically resize relative position bias tables and FLatten positional encodings whose shape differs
    from the model's (another img_size or window), as the official fine-tuning loader does.

    `module_name` maps the key prefix of a table to the name of the attention module that owns it.
    """
    own = model.state_dict()
    for key, value in state_dict.items():
        if key not in own or own[key].shape == value.shape:
            continue
        prefix, leaf = key.rsplit('.', 1)
        if leaf == 'relative_position_bias_table' and value.shape[1] == own[key].shape[1]:
            state_dict[key] = resize_rel_pos_bias_table(value, model.get_submodule(module_name(prefix)).bias_window)
        elif leaf == 'positional_encoding' and value.shape[-1] == own[key].shape[-1]:
            attn = model.get_submodule(module_name(prefix))
            state_dict[key] = resize_grid_embedding(value, attn.window or attn.grid_size)
    return state_dict


class PatchMerging(nn.Module):
    """2x2 neighbourhood concatenation, LayerNorm(4C), Linear(4C, 2C) without bias: (B, H*W, C) -> (B, H*W/4, 2C)."""

    def __init__(self, dim: int, grid_size: Grid):
        super().__init__()
        self.grid_size = grid_size
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        H, W = self.grid_size
        x = x.view(B, H, W, C)
        # Channel order of the original: (row, col) offsets (0, 0), (1, 0), (0, 1), (1, 1).
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class SwinStage(nn.Module):
    """The blocks of one resolution, then (stages 0 to n-2) the patch merging to the next."""

    def __init__(
            self,
            dim: int,
            grid_size: Grid,
            num_heads: int,
            attn_names: Sequence[str],
            window_size: int,
            la_window_size: Optional[int],
            mlp_ratio: float,
            qkv_bias: bool,
            drop: float,
            attn_drop: float,
            drop_path: Sequence[float],
            downsample: bool,
            attn_options: Dict[str, Any],
    ):
        super().__init__()
        self.grid_size = grid_size
        self.grad_checkpointing = False
        blocks = []
        for j, name in enumerate(attn_names):
            window = la_window_size if is_linear_attention(name) else window_size
            shift = window // 2 if window is not None and j % 2 else 0
            attn = build_attention(
                name, dim, num_heads, grid_size, qkv_bias, window_size=window, shift_size=shift, rel_pos_bias=True,
                attn_drop=attn_drop, proj_drop=drop, **method_kwargs(name, **attn_options))
            blocks.append(Block(dim, attn, mlp_ratio=mlp_ratio, drop=drop, drop_path=drop_path[j]))
        self.blocks = nn.ModuleList(blocks)
        self.downsample = PatchMerging(dim, grid_size) if downsample else None

    def forward_blocks(self, x: Tensor) -> Tensor:
        return run_blocks(self.blocks, x, self.grid_size, grad_checkpointing=self.grad_checkpointing)

    def forward(self, x: Tensor) -> Tensor:
        x = self.forward_blocks(x)
        return x if self.downsample is None else self.downsample(x)


class SwinTransformer(nn.Module):
    """Swin Transformer with a swappable attention per block (original Swin layout and key names).

    Args:
        img_size: input size (int or (H, W)); the model takes only this size.
        patch_size: patch size of the stem; the token grid img_size / patch_size must halve evenly per stage.
        in_chans, num_classes: input channels and classes (0: no head).
        global_pool: 'avg' (mean over tokens) or '' (no pooling).
        embed_dim: channels of stage 0, doubled by every patch merging.
        depths, num_heads: blocks and heads per stage.
        window_size: window of the score-forming attentions (softmax, MultiMax), with relative position bias.
        la_window_size: window of the linear attentions; None for the whole grid.
        mlp_ratio, qkv_bias: MLP hidden ratio and query/key/value bias.
        attn_type: an attention name, one name per stage, or an official pattern ('IIIS', 'LLSS', 'IIMS2', ...).
        mixed_linear: the linear attention of an 'M' stage when the pattern has no I or L stage.
        focusing_factor, kernel_size: FLatten options, given only to attentions that take them.
        drop_rate: dropout after the stem, in the MLPs and after the attention projection (as the original).
        attn_drop_rate: dropout on attention weights; drop_path_rate: stochastic depth, linear over all blocks.
    """

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 4,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dim: int = 96,
            depths: Sequence[int] = (2, 2, 6, 2),
            num_heads: Sequence[int] = (3, 6, 12, 24),
            window_size: int = 7,
            la_window_size: Optional[int] = None,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: Union[str, Sequence[str]] = 'softmax',
            mixed_linear: str = 'inline',
            focusing_factor: float = 3,
            kernel_size: int = 5,
            drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.1,
    ):
        super().__init__()
        self.img_size: Grid = to_2tuple(img_size)
        num_stages = len(depths)
        if len(num_heads) != num_stages:
            raise ValueError(f"num_heads {list(num_heads)} must give one value per stage of depths {list(depths)}")
        if any(s % patch_size for s in self.img_size):
            raise ValueError(f"img_size {self.img_size} must be a multiple of patch_size {patch_size}")
        grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        if any(g % 2 ** (num_stages - 1) for g in grid):
            raise ValueError(f"img_size {self.img_size} gives a {grid[0]}x{grid[1]} token grid that {num_stages - 1} "
                             f"patch mergings cannot halve evenly; expected a multiple of "
                             f"{patch_size * 2 ** (num_stages - 1)}")
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool, GLOBAL_POOLS)
        self.num_features = self.head_hidden_size = int(embed_dim * 2 ** (num_stages - 1))
        self.attn_names = stage_attentions(attn_type, depths, mixed_linear)
        attn_options = dict(focusing_factor=focusing_factor, kernel_size=kernel_size)

        self.patch_embed = PatchEmbed(self.img_size, patch_size, in_chans, embed_dim, norm_layer=nn.LayerNorm)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = calculate_drop_path_rates(drop_path_rate, sum(depths))
        self.layers = nn.ModuleList()
        self.feature_info = []
        for i in range(num_stages):
            dim = embed_dim * 2 ** i
            stage_grid = (grid[0] // 2 ** i, grid[1] // 2 ** i)
            self.layers.append(SwinStage(
                dim, stage_grid, num_heads[i], self.attn_names[i], window_size, la_window_size, mlp_ratio, qkv_bias,
                drop_rate, attn_drop_rate, dpr[sum(depths[:i]):sum(depths[:i + 1])], i < num_stages - 1,
                attn_options))
            self.feature_info.append(dict(num_chs=dim, reduction=patch_size * 2 ** i, module=f'layers.{i}'))
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {n for n, _ in self.named_parameters() if n.endswith('relative_position_bias_table')}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^patch_embed',
            blocks=r'^layers\.(\d+)' if coarse else [
                (r'^layers\.(\d+)\.downsample', (99999,)),
                (r'^layers\.(\d+)\.\w+\.(\d+)', None),
                (r'^norm', (99999,)),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.layers:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new `num_classes`-way head (Identity for 0), initialised as the official code does, on the model's
        device and dtype; optionally a new pooling."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool, GLOBAL_POOLS)
        self.head = new_classifier(self, self.num_features, num_classes)
        self.head.apply(init_weights)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) -> (B, H*W / patch^2 / 4^(stages-1), num_features) normalised tokens."""
        check_img_size(x, self.img_size)
        x = self.pos_drop(self.patch_embed(x))
        for stage in self.layers:
            x = stage(x)
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = global_pool_nlc(x, self.global_pool, num_prefix_tokens=0)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
            self,
            x: Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """Stage outputs (before patch merging) as (B, C, H, W) ('NCHW') or (B, H*W, C) ('NLC').

        `indices`: the last n stages (int), the given stages (list) or all (None). `norm` applies the final norm
        to the last stage's output. Returns the intermediates, or (final features, intermediates).
        """
        check_output_fmt(output_fmt)
        check_img_size(x, self.img_size)
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        stages = self.layers[:max_index + 1] if stop_early else self.layers
        last = len(self.layers) - 1
        intermediates = []
        x = self.pos_drop(self.patch_embed(x))
        for i, stage in enumerate(stages):
            x = stage.forward_blocks(x)
            if i in take_indices:
                out = self.norm(x) if norm and i == last else x
                intermediates.append(tokens_to_image(out, stage.grid_size) if output_fmt == 'NCHW' else out)
            if stage.downsample is not None and i < len(stages) - 1:
                x = stage.downsample(x)
        if intermediates_only:
            return intermediates
        return (self.norm(x) if len(stages) == len(self.layers) else x), intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages after the last wanted one (and its patch merging), optionally the norm and head."""
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        prune_end = max_index < len(self.layers) - 1
        self.layers = self.layers[:max_index + 1]
        self.layers[-1].downsample = None
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: SwinTransformer) -> Dict[str, Tensor]:
    """An official Swin / InLine-Swin / FLatten-Swin state dict (same key names) made ready for `model`.

    Unwraps 'model'/'state_dict', drops the saved relative position indices and shift masks (recomputed here),
    resizes bias tables and FLatten positional encodings to the model's windows, and raises `CheckpointError`
    listing the keys when the checkpoint belongs to another model.
    """
    state_dict = drop_derived_buffers(checkpoint_state_dict(state_dict))
    state_dict = resize_attention_tables(state_dict, model)
    check_state_dict(model, state_dict, 'checkpoint', free_shape_prefixes=('head.',))
    return state_dict


def _create_swin(variant: str, pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    return build_model_with_cfg(
        SwinTransformer, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls='getter', out_indices=(0, 1, 2, 3)),
        **kwargs)


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='patch_embed.proj')

_SIZES: Dict[str, Dict[str, Any]] = {
    'tiny': dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    'small': dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    'base': dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    'base_384': dict(img_size=384, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
}
# The official InLine / FLatten models: their attention pattern per size. Their constructors take `window_size` as
# the window of the linear blocks (by default the stage-0 grid: global) and derive the softmax window from it.
_OFFICIAL_ARGS: Dict[str, Dict[str, Dict[str, Any]]] = {
    'inline': {'tiny': dict(attn_type='IIIS'), 'small': dict(attn_type='IISS'), 'base': dict(attn_type='IIMS2'),
               'base_384': dict(attn_type='IIMS2')},
    'flatten': {size: dict(attn_type='LLSS', mixed_linear='flatten') for size in _SIZES},
}
_SOFTMAX_WINDOW: Dict[str, Callable[[int], int]] = {
    'inline': lambda window_size: max(7, window_size // 8),
    'flatten': lambda window_size: 7 if window_size <= 56 else 12,
}

_SWIN_META = dict(paper_ids='arXiv:2103.14030', origin_url='https://github.com/microsoft/Swin-Transformer')
_META = {'inline': INLINE_META, 'flatten': FLATTEN_META, 'softmax': _SWIN_META}
_SWIN_URL = 'https://github.com/SwinTransformer/storage/releases/download/v1.0.0/{}.pth'
# Official release files; variants absent here have none.
_URLS = {
    'inline_swin_tiny': tsinghua_url('32810869fcc34410966b'),
    'inline_swin_small': tsinghua_url('e9657fd247c04c7cb1a1'),
    'inline_swin_base': tsinghua_url('bf23564bb64c420aafe1'),
    'flatten_swin_tiny': tsinghua_url('e1518e76703e4e57a7f2'),
    'flatten_swin_small': tsinghua_url('94188e52af354bf4a88b'),
    'flatten_swin_base': tsinghua_url('7a9e5186bad04e7fb3a9'),
    'flatten_swin_base_384': tsinghua_url('0d0330cf2e5249f1abb6'),
    'softmax_swin_tiny': _SWIN_URL.format('swin_tiny_patch4_window7_224'),
    'softmax_swin_small': _SWIN_URL.format('swin_small_patch4_window7_224'),
    'softmax_swin_base': _SWIN_URL.format('swin_base_patch4_window7_224'),
    'softmax_swin_base_384': _SWIN_URL.format('swin_base_patch4_window12_384'),
}

default_cfgs = generate_default_cfgs({
    f'{flavour}_swin_{size}': _cfg(_URLS.get(f'{flavour}_swin_{size}', ''), **_META.get(flavour, {}),
                                   **(dict(input_size=(3, 384, 384), crop_pct=1.0) if size == 'base_384' else {}))
    for flavour in ('inline', 'flatten', 'softmax', 'multimax', 'sima', 'additive') for size in _SIZES
})


def _swin(variant: str, pretrained: bool, **kwargs: Any) -> SwinTransformer:
    """`{flavour}_swin_{size}`: the size's architecture with the official InLine / FLatten attention pattern, or
    with attention `flavour` in every block and the original Swin's window (7; 12 at 384)."""
    flavour, size = variant.split('_swin_')
    if flavour in _OFFICIAL_ARGS:
        linear_window = kwargs.pop('window_size', 96 if size == 'base_384' else 56)
        kwargs.setdefault('la_window_size', linear_window)
        model_args = dict(_OFFICIAL_ARGS[flavour][size], window_size=_SOFTMAX_WINDOW[flavour](linear_window))
    else:
        model_args = dict(attn_type=flavour, window_size=12 if size == 'base_384' else 7)
    return _create_swin(variant, pretrained=pretrained, **{**_SIZES[size], **model_args, **kwargs})


@register_model
def inline_swin_tiny(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """InLine-Swin-T (official configuration, pattern IIIS).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 56, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    max(7, window_size // 8). `la_window_size` overrides the linear window alone.
    """
    return _swin('inline_swin_tiny', pretrained, **kwargs)


@register_model
def inline_swin_small(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """InLine-Swin-S (official configuration, pattern IISS).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 56, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    max(7, window_size // 8). `la_window_size` overrides the linear window alone.
    """
    return _swin('inline_swin_small', pretrained, **kwargs)


@register_model
def inline_swin_base(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """InLine-Swin-B (official configuration, pattern IIMS2).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 56, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    max(7, window_size // 8). `la_window_size` overrides the linear window alone.
    """
    return _swin('inline_swin_base', pretrained, **kwargs)


@register_model
def inline_swin_base_384(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """InLine-Swin-B 384 (official configuration, pattern IIMS2).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 96, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    max(7, window_size // 8). `la_window_size` overrides the linear window alone.
    """
    return _swin('inline_swin_base_384', pretrained, **kwargs)


@register_model
def flatten_swin_tiny(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """FLatten-Swin-T (official configuration, pattern LLSS).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 56, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    7 if window_size <= 56 else 12. `la_window_size` overrides the linear window alone.
    """
    return _swin('flatten_swin_tiny', pretrained, **kwargs)


@register_model
def flatten_swin_small(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """FLatten-Swin-S (official configuration, pattern LLSS).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 56, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    7 if window_size <= 56 else 12. `la_window_size` overrides the linear window alone.
    """
    return _swin('flatten_swin_small', pretrained, **kwargs)


@register_model
def flatten_swin_base(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """FLatten-Swin-B (official configuration, pattern LLSS).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 56, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    7 if window_size <= 56 else 12. `la_window_size` overrides the linear window alone.
    """
    return _swin('flatten_swin_base', pretrained, **kwargs)


@register_model
def flatten_swin_base_384(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """FLatten-Swin-B 384 (official configuration, pattern LLSS).

    `window_size` has the official constructor's meaning: the window of the linear blocks (default 96, which
    covers every stage grid at this resolution: global). The softmax window derives from it:
    7 if window_size <= 56 else 12. `la_window_size` overrides the linear window alone.
    """
    return _swin('flatten_swin_base_384', pretrained, **kwargs)


@register_model
def softmax_swin_tiny(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-T, the original softmax model (window 7)."""
    return _swin('softmax_swin_tiny', pretrained, **kwargs)


@register_model
def softmax_swin_small(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-S, the original softmax model (window 7)."""
    return _swin('softmax_swin_small', pretrained, **kwargs)


@register_model
def softmax_swin_base(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B, the original softmax model (window 7)."""
    return _swin('softmax_swin_base', pretrained, **kwargs)


@register_model
def softmax_swin_base_384(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B 384, the original softmax model (window 12)."""
    return _swin('softmax_swin_base_384', pretrained, **kwargs)


@register_model
def multimax_swin_tiny(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-T with MultiMax attention in every block (in windows of 7 as the original)."""
    return _swin('multimax_swin_tiny', pretrained, **kwargs)


@register_model
def multimax_swin_small(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-S with MultiMax attention in every block (in windows of 7 as the original)."""
    return _swin('multimax_swin_small', pretrained, **kwargs)


@register_model
def multimax_swin_base(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B with MultiMax attention in every block (in windows of 7 as the original)."""
    return _swin('multimax_swin_base', pretrained, **kwargs)


@register_model
def multimax_swin_base_384(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B 384 with MultiMax attention in every block (in windows of 12 as the original)."""
    return _swin('multimax_swin_base_384', pretrained, **kwargs)


@register_model
def sima_swin_tiny(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-T with SimA attention in every block (global: it is linear)."""
    return _swin('sima_swin_tiny', pretrained, **kwargs)


@register_model
def sima_swin_small(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-S with SimA attention in every block (global: it is linear)."""
    return _swin('sima_swin_small', pretrained, **kwargs)


@register_model
def sima_swin_base(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B with SimA attention in every block (global: it is linear)."""
    return _swin('sima_swin_base', pretrained, **kwargs)


@register_model
def sima_swin_base_384(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B 384 with SimA attention in every block (global: it is linear)."""
    return _swin('sima_swin_base_384', pretrained, **kwargs)


@register_model
def additive_swin_tiny(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-T with additive (Fastformer) attention in every block (global: it is linear)."""
    return _swin('additive_swin_tiny', pretrained, **kwargs)


@register_model
def additive_swin_small(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-S with additive (Fastformer) attention in every block (global: it is linear)."""
    return _swin('additive_swin_small', pretrained, **kwargs)


@register_model
def additive_swin_base(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B with additive (Fastformer) attention in every block (global: it is linear)."""
    return _swin('additive_swin_base', pretrained, **kwargs)


@register_model
def additive_swin_base_384(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin-B 384 with additive (Fastformer) attention in every block (global: it is linear)."""
    return _swin('additive_swin_base_384', pretrained, **kwargs)
