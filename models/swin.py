"""Swin Transformer (shifted windows) with the attention of every block taken from the registry by name.

The layout and state-dict names are those of the original Swin code, which the papers' checkpoints keep:
`patch_embed.{proj,norm}`, `layers.{i}.blocks.{j}.{norm1,attn,norm2,mlp}`, patch merging
`layers.{i}.downsample.{norm,reduction}` at the END of stages 0-2, a final `norm`, mean pooling over tokens and a
`head` Linear. Every block uses the window grouping: score-forming attentions get windows of `window_size` with a
relative position bias, shifted by half a window on odd blocks of a stage; the others get `la_window_size`
windows (None: global, as the official linear blocks are at their trained resolution). A window as large as the
grid means global attention without shift, as in Swin.

`forward_features` returns the last stage's normed map as (B, H, W, C) (`output_fmt` 'NHWC'), as timm's Swin does.
Another input size: sides must be multiples of `patch_size`; grids that do not divide into windows, or odd grids
before a patch merging, are padded with zeros below and right, as Swin does at other resolutions. With
`dynamic_img_size=True` every input size runs on the built weights: windows keep their size and shift (masks made
for the grid), global attentions stay global with their bias tables and FLatten's positional encodings
resampled bicubically; `set_input_size` makes such a size the model's own.

Registered: every attention of the registry at the Swin sizes (`{attention}_swin_{tiny,small,base,base_384}`, the
original's windows), except that the names of the official models (`_OFFICIAL`) are theirs.
"""
import re
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import PatchEmbed, calculate_drop_path_rates, to_2tuple
from timm.models import generate_default_cfgs

from .attention import build_attention, check_attn_kwargs, forms_score_matrix, list_attentions, stage_attentions
from .attention.layout import Grid
from .checkpoint import filter_checkpoint
from .family import (
    FLATTEN_META, INLINE_META, Block, BlockStack, ZooModel, check_arguments, create_variant, imagenet_cfg,
    init_weights, register_variants, split_drop_rates, tag_weights, tsinghua_url,
)

__all__ = ['SwinTransformer', 'checkpoint_filter_fn']


def merged_grid(grid: Grid) -> Grid:
    """The grid after a patch merging of `grid` (odd sides padded by one)."""
    return ((grid[0] + 1) // 2, (grid[1] + 1) // 2)


class PatchMerging(nn.Module):
    """2x2 neighbourhood concatenation, LayerNorm(4C), Linear(4C, 2C) without bias: (B, H*W, C) on the (H, W) grid
    -> (B, ceil(H/2)*ceil(W/2), 2C), an odd side padded with zeros."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor, grid: Grid) -> Tensor:
        B, N, C = x.shape
        H, W = grid
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        # Channel order of the original: (row, col) offsets (0, 0), (1, 0), (0, 1), (1, 1).
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.flatten(1, 2)))


class SwinStage(nn.Module):
    """The blocks of one resolution and (stages 0 to n-2) the patch merging to the next, which the model applies
    after taking the stage's output."""

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
            attn_kwargs: Dict[str, Any],
    ):
        super().__init__()
        blocks = []
        for j, name in enumerate(attn_names):
            window = window_size if forms_score_matrix(name) else la_window_size
            attn = build_attention(
                name, dim, num_heads, grid_size, qkv_bias, grouping='window', attn_kwargs=attn_kwargs,
                window_size=grid_size if window is None else window,
                shift_size=window // 2 if window is not None and j % 2 else 0, attn_drop=attn_drop, proj_drop=drop)
            blocks.append(Block(dim, attn, mlp_ratio=mlp_ratio, drop=drop, drop_path=drop_path[j]))
        self.blocks = BlockStack(*blocks)
        self.downsample = PatchMerging(dim) if downsample else None

    def set_grid(self, grid: Grid) -> None:
        for block in self.blocks:
            block.attn.set_grid(grid)


class SwinTransformer(ZooModel):
    """Swin Transformer with a swappable attention per block (original Swin layout and key names).

    Args:
        img_size: input size (int or (H, W)), sides multiples of `patch_size`; the model takes only this size
            unless `dynamic_img_size`.
        patch_size: patch size of the stem.
        in_chans, num_classes: input channels and classes (0: no head).
        global_pool: 'avg', 'max' or 'avgmax' (mean, maximum or their average over tokens) or '' (no pooling).
        embed_dim: channels of stage 0, doubled by every patch merging.
        depths, num_heads: blocks and heads per stage.
        window_size: window of the attentions that form scores, with a relative position bias.
        la_window_size: window of the attentions that form no score matrix; None for the whole grid.
        mlp_ratio, qkv_bias: MLP hidden ratio and query/key/value bias.
        attn_type: an attention name, one name per stage, or an official pattern ('IIIS', 'LLSS', 'IIMS2', ...).
        mixed_linear: the linear attention of an 'M' stage when the pattern has no I or L stage.
        attn_kwargs: method options of the attentions (`models.attention.list_attention_options()`).
        drop_rate: dropout after the stem, in the MLPs and after the attention projection (as the original).
        pos_drop_rate, proj_drop_rate: timm's names for the first and for the other two of these, each
            `drop_rate` unless given.
        attn_drop_rate: dropout on attention weights; drop_path_rate: stochastic depth, linear over all blocks.
        dynamic_img_size: take any input size whose sides are multiples of `patch_size`.
        window_img_size: the input size whose stage grids decide the windows (a window covering its grid makes
            the stage global), None for `img_size`. `set_input_size` keeps a model's windows and records the size
            they were decided at here, so that a model saved after it is rebuilt with the same windows.
    """

    official_head_init = True
    narrows_imagenet22k_classifier = True

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
            mixed_linear: Optional[str] = None,
            attn_kwargs: Optional[Dict[str, Any]] = None,
            drop_rate: float = 0.,
            pos_drop_rate: Optional[float] = None,
            proj_drop_rate: Optional[float] = None,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.1,
            dynamic_img_size: bool = False,
            window_img_size: Optional[Union[int, Tuple[int, int]]] = None,
    ):
        super().__init__()
        check_arguments(
            sizes=dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                       num_heads=num_heads, window_size=window_size, la_window_size=la_window_size,
                       window_img_size=window_img_size),
            counts=dict(num_classes=num_classes, depths=depths), ratios=dict(mlp_ratio=mlp_ratio),
            rates=dict(drop_rate=drop_rate, pos_drop_rate=pos_drop_rate, proj_drop_rate=proj_drop_rate,
                       attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate),
            flags=dict(qkv_bias=qkv_bias, dynamic_img_size=dynamic_img_size),
            per_stage=('depths', 'num_heads'))
        self.img_size: Grid = tuple(to_2tuple(img_size))
        self.img_divisor = patch_size
        self.window_img_size: Grid = self.img_size if window_img_size is None else tuple(to_2tuple(window_img_size))
        self._init_input_size(dynamic_img_size)
        num_stages = len(depths)
        if len(num_heads) != num_stages:
            raise ValueError(f"num_heads {list(num_heads)} must give one value per stage of depths {list(depths)}")
        self._check_size(self.img_size, 'img_size')
        self._check_size(self.window_img_size, 'window_img_size')
        self._init_output_fmt('NHWC')
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_prefix_tokens = 0
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.num_stages = num_stages
        self.grad_checkpointing = False
        self.num_features = self.head_hidden_size = int(embed_dim * 2 ** (num_stages - 1))
        self.attn_names = stage_attentions(attn_type, depths, mixed_linear)
        attn_kwargs = check_attn_kwargs([name for stage in self.attn_names for name in stage], attn_kwargs)

        self.patch_embed = PatchEmbed(self.window_img_size, patch_size, in_chans, embed_dim, norm_layer=nn.LayerNorm,
                                      strict_img_size=False)
        pos_drop_rate, proj_drop_rate = split_drop_rates(drop_rate, pos_drop_rate, proj_drop_rate)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dpr = calculate_drop_path_rates(drop_path_rate, sum(depths))
        self.layers = nn.ModuleList()
        self.feature_info = []
        for i, stage_grid in enumerate(self._stage_grids(self.window_img_size)):
            dim = embed_dim * 2 ** i
            self.layers.append(SwinStage(
                dim, stage_grid, num_heads[i], self.attn_names[i], window_size, la_window_size, mlp_ratio, qkv_bias,
                proj_drop_rate, attn_drop_rate, dpr[sum(depths[:i]):sum(depths[:i + 1])], i < num_stages - 1,
                attn_kwargs))
            self.feature_info.append(dict(num_chs=dim, reduction=patch_size * 2 ** i, module=f'layers.{i}'))
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(init_weights)
        if self.window_img_size != self.img_size:  # the windows of that size, on this size's grids
            self._set_grids(self.img_size)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {n for n, _ in self.named_parameters() if n.endswith('relative_position_bias_table')}

    def _resize_args(self) -> Dict[str, Any]:
        return dict(window_img_size=self.window_img_size)

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

    def _stage_grids(self, img_size: Grid) -> List[Grid]:
        """The token grid of every stage for images of `img_size`."""
        patch = self.img_divisor
        grids = [(img_size[0] // patch, img_size[1] // patch)]
        for _ in range(1, self.num_stages):
            grids.append(merged_grid(grids[-1]))
        return grids

    def _set_grids(self, img_size: Grid) -> None:
        self.patch_embed.set_input_size(img_size=img_size)
        for stage, grid in zip(self.layers, self._stage_grids(img_size)):
            stage.set_grid(grid)

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """The embedded images through each stage's blocks; a stage's output is taken before its own patch
        merging, which the next stage's input goes through."""
        image = self._input_grid(x)
        x = self.pos_drop(self.patch_embed(x))
        grid = (image[0] // self.img_divisor, image[1] // self.img_divisor)
        kept: Dict[int, Tuple[Tensor, Grid]] = {}
        for i, stage in enumerate(self.layers):
            if i < num_stages:
                x = stage.blocks(x, grid, self.grad_checkpointing)
                if i in keep:
                    kept[i] = (x, grid)
                if i + 1 < num_stages and stage.downsample is not None:
                    x = stage.downsample(x, grid)
                    grid = merged_grid(grid)
        return x, grid, kept

    def official_key_names(self, keys: Sequence[str]) -> Dict[str, str]:
        return _official_names_of_timm_keys(keys)

    def _prune_stages(self, num_stages: int) -> None:
        self.layers = self.layers[:num_stages]
        self.layers[-1].downsample = None


_TIMM_DOWNSAMPLE = re.compile(r'^layers\.(\d+)\.downsample\.')


def _official_names_of_timm_keys(keys: Sequence[str]) -> Dict[str, str]:
    """The official names of the keys of timm's `swin_*` layout: its patch merging opens stage i + 1 where Swin's
    closes stage i, and its classifier is `head.fc`. The merging's weights are the same (timm renames, never
    permutes). Empty for keys of the official layout."""
    stages = {int(m.group(1)) for m in map(_TIMM_DOWNSAMPLE.match, keys) if m}
    if 0 in stages or not (stages or any(k.startswith('head.fc.') for k in keys)):
        return {}

    def official(key: str) -> str:
        key = _TIMM_DOWNSAMPLE.sub(lambda m: f'layers.{int(m.group(1)) - 1}.downsample.', key)
        return 'head.' + key[len('head.fc.'):] if key.startswith('head.fc.') else key

    names = {key: official(key) for key in keys}
    return {key: name for key, name in names.items() if name != key}


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: SwinTransformer,
                         strict: bool = True) -> Dict[str, Tensor]:
    """A Swin state dict (any attention; the official layout, which the papers keep, or timm's `swin_*`) made ready
    for `model`.

    Unwraps the weights (`PRETRAINED_KEYS`), drops the saved relative position indices and shift masks
    (recomputed here), renames timm's keys to the official ones, resizes grid- and window-sized tensors to the
    model's, and raises `CheckpointError` listing the keys when the checkpoint belongs to another model.
    """
    return filter_checkpoint(state_dict, model, strict=strict)


def _create_swin(variant: str, pretrained: bool, model_args: Dict[str, Any],
                 kwargs: Dict[str, Any]) -> SwinTransformer:
    """Build a Swin variant; the official linear-attention models take `window_size` as their constructors do."""
    model_args = dict(model_args)
    softmax_window = model_args.pop('softmax_window_rule', None)
    if softmax_window is not None and 'window_size' in kwargs:
        linear_window = kwargs.pop('window_size')
        check_arguments(sizes=dict(window_size=linear_window))
        kwargs.setdefault('la_window_size', linear_window)
        model_args['window_size'] = softmax_window(linear_window)
    # every stage by default, as many as the model has (timm's Swin takes them from `depths` too)
    depths = kwargs.get('depths', model_args.get('depths', (2, 2, 6, 2)))
    stages = len(depths) if isinstance(depths, (list, tuple)) else 0  # not a list: the constructor names it
    return create_variant(SwinTransformer, variant, pretrained, model_args, kwargs,
                          pretrained_filter_fn=checkpoint_filter_fn,
                          feature_cfg=dict(feature_cls='getter', out_indices=tuple(range(stages))))


def _eighth_but_at_least_7(linear_window: int) -> int:
    return max(7, linear_window // 8)


def _7_up_to_56_else_12(linear_window: int) -> int:
    return 7 if linear_window <= 56 else 12


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='patch_embed.proj', pool_size=(7, 7))

_SIZES: Dict[str, Dict[str, Any]] = {
    'tiny': dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7),
    'small': dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=7),
    'base': dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=7),
    'base_384': dict(img_size=384, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=12),
    'large': dict(embed_dim=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), window_size=7),
    'large_384': dict(img_size=384, embed_dim=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), window_size=12),
}
# The sizes of the official linear-attention models (the papers train no Swin-L).
_PAPER_SIZES = ('tiny', 'small', 'base', 'base_384')
_WINDOW_DOC = ('`window_size` has the official constructor\'s meaning: the window of the linear blocks, from which the '
               'softmax window derives; by default the linear blocks are global at any img_size and the softmax '
               'window is the trained one. `la_window_size` overrides the linear window alone.')


def _official(size: str, attn_type: str, softmax_window_rule: Callable[[int], int], **extra: Any) -> Dict[str, Any]:
    """An official linear-attention Swin: its pattern, global linear blocks, the window rule.

    The official window_size (56, 96 at 384) is the stage-0 grid at the trained size, so its linear blocks are
    global; `la_window_size` None keeps them global at any img_size, where the released weights then load, and
    the softmax window is the rule's value at the trained size (7, 12 at 384).
    """
    return dict(_SIZES[size], attn_type=attn_type, softmax_window_rule=softmax_window_rule, **extra)


_OFFICIAL: Dict[str, Tuple[Dict[str, Any], str]] = {
    **{f'inline_swin_{size}': (_official(size, pattern, _eighth_but_at_least_7),
                               f'The official model, pattern {pattern}; softmax window max(7, window_size // 8). '
                               f'{_WINDOW_DOC}')
       for size, pattern in (('tiny', 'IIIS'), ('small', 'IISS'), ('base', 'IIMS2'), ('base_384', 'IIMS2'))},
    **{f'flatten_swin_{size}': (_official(size, 'LLSS', _7_up_to_56_else_12, mixed_linear='L'),
                                f'The official model, pattern LLSS; softmax window 7 if window_size <= 56 else 12. '
                                f'{_WINDOW_DOC}')
       for size in _PAPER_SIZES},
}
_VARIANTS: Dict[str, Tuple[Dict[str, Any], str]] = {
    **{f'{attn}_swin_{size}': (dict(args, attn_type=attn),
                               f'Swin-{size} with {attn} attention in every block (window {args["window_size"]} '
                               f'where it forms scores, else global).')
       for attn in list_attentions() for size, args in _SIZES.items()},
    **_OFFICIAL,
}

_SWIN_META = dict(paper_ids='arXiv:2103.14030', origin_url='https://github.com/microsoft/Swin-Transformer',
                  license='mit')
_SWIN_URL = 'https://github.com/SwinTransformer/storage/releases/download/{}.pth'
# Swin evaluates at 384 without a crop: a square resize (TEST.CROP False), which timm calls 'squash'
_AT_384 = dict(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0, crop_mode='squash')
_IN22K_CLASSES = 21841
# Swin's releases by size: its file name and release version for ImageNet-1k training, ImageNet-22k pretraining
# and the ImageNet-1k fine-tuning of the latter; the papers compare with the ImageNet-1k weights, which stay a
# size's default where they exist (Swin-L has none).
_SWIN_RELEASES = {
    'tiny': ('swin_tiny_patch4_window7_224', 'v1.0.0', 'v1.0.8', '_22kto1k_finetune'),
    'small': ('swin_small_patch4_window7_224', 'v1.0.0', 'v1.0.8', '_22kto1k_finetune'),
    'base': ('swin_base_patch4_window7_224', 'v1.0.0', 'v1.0.0', '_22kto1k'),
    'base_384': ('swin_base_patch4_window12_384', 'v1.0.0', 'v1.0.0', '_22kto1k'),
    'large': ('swin_large_patch4_window7_224', None, 'v1.0.0', '_22kto1k'),
    'large_384': ('swin_large_patch4_window12_384', None, 'v1.0.0', '_22kto1k'),
}


def _swin_releases() -> Dict[str, Dict[str, Any]]:
    """The pretrained cfgs of Swin's own weights, tagged as timm tags the same files."""
    cfgs = {}
    for size, (file, in1k, in22k, finetuned) in _SWIN_RELEASES.items():
        size_cfg = dict(_AT_384 if size.endswith('_384') else {}, **_SWIN_META)
        name = f'softmax_swin_{size}'
        if in1k:
            cfgs[f'{name}.ms_in1k'] = _cfg(_SWIN_URL.format(f'{in1k}/{file}'), **size_cfg)
        cfgs[f'{name}.ms_in22k_ft_in1k'] = _cfg(_SWIN_URL.format(f'{in22k}/{file}{finetuned}'), **size_cfg)
        cfgs[f'{name}.ms_in22k'] = _cfg(_SWIN_URL.format(f'{in22k}/{file}_22k'), num_classes=_IN22K_CLASSES,
                                        **size_cfg)
    return cfgs


default_cfgs = generate_default_cfgs(tag_weights({
    **{name: _cfg(**(_AT_384 if name.endswith('_384') else {})) for name in _VARIANTS},
    'inline_swin_tiny': _cfg(tsinghua_url('32810869fcc34410966b'), **INLINE_META),
    'inline_swin_small': _cfg(tsinghua_url('e9657fd247c04c7cb1a1'), **INLINE_META),
    'inline_swin_base': _cfg(tsinghua_url('bf23564bb64c420aafe1'), **INLINE_META),
    'inline_swin_base_384': _cfg(**dict(_AT_384, **INLINE_META)),
    'flatten_swin_tiny': _cfg(tsinghua_url('e1518e76703e4e57a7f2'), **FLATTEN_META),
    'flatten_swin_small': _cfg(tsinghua_url('94188e52af354bf4a88b'), **FLATTEN_META),
    'flatten_swin_base': _cfg(tsinghua_url('7a9e5186bad04e7fb3a9'), **FLATTEN_META),
    'flatten_swin_base_384': _cfg(tsinghua_url('0d0330cf2e5249f1abb6'), **dict(_AT_384, **FLATTEN_META)),
    **_swin_releases(),
}))

register_variants(__name__, _VARIANTS, _create_swin)
