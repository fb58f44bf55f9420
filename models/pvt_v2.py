"""PVT v2: a four-stage pyramid of overlapping patch embeddings, pre-norm blocks whose MLP holds a depthwise
convolution, and a LayerNorm closing every stage.

Every block takes its attention from the registry in the spatial-reduction grouping (separate `q` / `kv`
projections): score-forming attentions reduce their keys and values by `sr_ratios` (a strided convolution
`attn.sr` and LayerNorm `attn.norm`), or with `linear=True` by average pooling to 7 × 7 (then a 1×1 `attn.sr`,
`attn.norm` and GELU), the others by `la_sr_ratios` (1 in every stage by default, i.e. global attention over the
stage), as FLatten-PVTv2 does. There is no absolute position embedding:
the overlapping patch embeddings and the MLP's depthwise convolution carry the position.

The stages are `stages.{i}` modules (patch embedding, blocks, norm), which TorchScript loops over; the state dict
keeps the official key names (`patch_embed{i}.proj/norm`, `block{i}.{j}.{norm1,attn.*,norm2,mlp.fc1,
mlp.dwconv.dwconv,mlp.fc2}`, `norm{i}`, `head`) through `OfficialKeys`, so checkpoints of the official PVT v2 and
FLatten-PVTv2 code load strictly; timm's own `pvt_v2_b*` layout (also `stages.{i}.…`, but with the downsampling
at the stage's start and `patch_embed` as the stem) is renamed to the official keys on loading.

`forward_features` returns the last stage's normed map as (B, C, H, W) (`output_fmt` 'NCHW'), as timm's PVT v2
does. The model runs at the input size it was built for; with `dynamic_img_size=True` at any size (stage grids
ceil(H / 4), then halved with rounding up, as the overlapping convolutions give them), FLatten's positional
encodings resampled on the fly, and `set_input_size` makes such a size the model's own.

Registered: every attention of the registry at the PVT v2 sizes (`{attention}_pvt_v2_b{0..5}`, heads 1-2-5-8) and
as PVT v2-B2-Linear (`{attention}_pvt_v2_b2_li`: keys and values of score-forming attentions pooled to 7 × 7 in
every stage, PVT v2's `linear=True`), except that the names of the official FLatten-PVTv2 models (`_OFFICIAL`)
carry their pattern and release.
"""
import math
import re
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

from timm.layers import DropPath, calculate_drop_path_rates, to_2tuple
from timm.models import generate_default_cfgs

from .attention import build_attention, check_attn_kwargs, forms_score_matrix, list_attentions, stage_attentions
from .attention.layout import Grid, image_to_tokens, tokens_to_image
from .checkpoint import filter_checkpoint
from .onednn import fuses_in_inference, onednn_conv2d_gelu
from .family import (
    FLATTEN_META, BlockStack, NumberedStageKeys, OfficialKeys, ZooModel, check_arguments, create_variant, imagenet_cfg,
    init_weights, refuse_causal, register_variants, split_drop_rates, tag_weights, tsinghua_url,
)
from .pvt import NUM_STAGES, PER_STAGE_ARGUMENTS, check_stage_lists, key_reduction, smallest_side

__all__ = ['PyramidVisionTransformerV2', 'PvtV2Stage', 'OverlapPatchEmbed', 'DepthwiseConvMlp', 'PvtV2Block',
           'checkpoint_filter_fn']


class OverlapPatchEmbed(nn.Module):
    """Strided convolution with overlapping windows (kernel > stride, padding kernel // 2), then a LayerNorm.

    (B, C_in, H, W) -> (B, ceil(H / stride) * ceil(W / stride), C) tokens.
    """

    def __init__(self, patch_size: int, stride: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.stride = stride
        self.proj = nn.Conv2d(in_chans, embed_dim, self.patch_size, stride=stride,
                              padding=(self.patch_size[0] // 2, self.patch_size[1] // 2))
        self.norm = nn.LayerNorm(embed_dim)

    def output_grid(self, grid: Grid) -> Grid:
        """The token grid of images (or maps) of size `grid`."""
        return -(-grid[0] // self.stride), -(-grid[1] // self.stride)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(image_to_tokens(self.proj(x)))


class DepthwiseConv(nn.Module):
    """3×3 depthwise convolution (with bias) of tokens imaged on their grid: (B, H*W, C) -> (B, H*W, C)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, 1, 1, bias=True, groups=dim)

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        return image_to_tokens(self.dwconv(tokens_to_image(x, size)))


class DepthwiseConvMlp(nn.Module):
    """PVT v2's MLP: fc1 -> (ReLU, with `extra_relu`: the linear models) -> 3×3 depthwise convolution on the
    hidden map -> GELU -> fc2 (dropout after each).

    With `onednn` (set by `models.convert_to_onednn`), float32 CPU inference applies GELU inside the convolution
    (`onednn_conv2d_gelu`) instead of in a pass of its own over the hidden map: 1.88× the speed of the two at
    PVT v2-B1's first stage (512 channels, 56², batch 8), 1.26–1.30× at its later ones, one thread.
    """

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0., extra_relu: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.relu = nn.ReLU() if extra_relu else nn.Identity()
        self.dwconv = DepthwiseConv(hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)
        self.onednn = False

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, H*W, C) over the grid `size` -> (B, H*W, C)."""
        x = self.relu(self.fc1(x))
        if not torch.jit.is_scripting():
            conv = self.dwconv.dwconv
            if self.onednn and fuses_in_inference(x, conv.weight, conv.bias):
                image = onednn_conv2d_gelu(tokens_to_image(x, size), conv.weight, conv.bias, [1, 1], conv.groups,
                                           self.act.approximate)
                return self.drop(self.fc2(self.drop(image_to_tokens(image))))
        x = self.drop(self.act(self.dwconv(x, size)))
        return self.drop(self.fc2(x))


class PvtV2Block(nn.Module):
    """Pre-norm block around a given attention: x + attn(norm1(x)), then x + mlp(norm2(x)) with the depthwise
    convolution MLP."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4., drop: float = 0., drop_path: float = 0.,
                 extra_relu: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = DepthwiseConvMlp(dim, int(dim * mlp_ratio), drop=drop, extra_relu=extra_relu)

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, H*W, C) over the grid `size` = (H, W) -> (B, H*W, C)."""
        x = x + self.drop_path(self.attn(self.norm1(x), size))
        return x + self.drop_path(self.mlp(self.norm2(x), size))


class PvtV2Stage(nn.Module):
    """One stage: overlapping patch embedding, blocks, norm. (B, C_in, H, W) -> (B, h*w, C) tokens on the grid
    (h, w) it returns."""

    def __init__(self, patch_embed: OverlapPatchEmbed, blocks: List[nn.Module], dim: int):
        super().__init__()
        self.patch_embed = patch_embed
        self.blocks = BlockStack(*blocks)
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: Tensor, grid: Grid, grad_checkpointing: bool = False) -> Tuple[Tensor, Grid]:
        grid = self.patch_embed.output_grid(grid)
        x = self.blocks(self.patch_embed(x), grid, grad_checkpointing)
        return self.norm(x), grid


# `stages.{i}.blocks` is the official `block{i+1}`, and so on for every part of a stage
_STAGE_KEYS = NumberedStageKeys({'patch_embed': 'patch_embed', 'blocks': 'block', 'norm': 'norm'})


# The map size the linear spatial reduction pools keys and values to, in every stage.
_LINEAR_POOL = 7


def _key_reduction(name: str, sr_ratio: int, la_sr_ratio: int, linear: bool) -> Dict[str, int]:
    """The spatial-reduction keywords of attention `name` in a stage: pooled to `_LINEAR_POOL` for a score-forming
    attention of a `linear` model, else the stride `key_reduction` gives."""
    if linear and forms_score_matrix(name):
        return dict(pool_size=_LINEAR_POOL)
    return dict(sr_ratio=key_reduction(name, sr_ratio, la_sr_ratio))


def init_weights_pvt_v2(module: nn.Module) -> None:
    """The official initialisation: the families' Linear and LayerNorm init (`init_weights`), and Conv2d
    normal(0, sqrt(2 / fan_out)) with fan_out = k·k·out / groups, zero bias."""
    init_weights(module)
    if isinstance(module, nn.Conv2d) and not module.weight.is_meta:
        fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels // module.groups
        nn.init.normal_(module.weight, 0., math.sqrt(2. / fan_out))
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# The stride of each stage's overlapping patch embedding.
_STRIDES = (4, 2, 2, 2)


class PyramidVisionTransformerV2(ZooModel):
    """PVT v2 with swappable attention.

    Args:
        img_size: input size the model is built for (int or (H, W)); it sizes grid-tied attention parameters.
            The model takes only this size unless `dynamic_img_size`.
        in_chans: input image channels.
        num_classes: classifier outputs; 0 for none.
        embed_dims, num_heads, mlp_ratios, depths: per stage width, heads, MLP ratio and number of blocks.
        qkv_bias: bias of the `q` and `kv` projections.
        sr_ratios: spatial reduction of keys and values per stage for score-forming attentions.
        linear: PVT v2's linear spatial reduction (the `_li` models): score-forming attentions take their keys
            and values from the map average-pooled to 7 × 7 in every stage (then a 1×1 convolution, LayerNorm
            and GELU) instead of by `sr_ratios`, and the MLPs apply a ReLU before their depthwise convolution.
        la_sr_ratios: the same for attentions that form no score matrix, a string of digits ('1111') or a
            sequence of ints.
        attn_type: a registered name for every block, a list of names per stage, or an official pattern ('LLLL').
        attn_kwargs: method options of the attentions (`models.attention.list_attention_options()`).
        global_pool: 'avg', 'max' or 'avgmax' (mean, maximum or their average over the last stage's normalised
            tokens) or ''.
        drop_rate: dropout after the attention projections and the MLP layers; proj_drop_rate: timm's name for
            it, `drop_rate` unless given.
        attn_drop_rate: dropout on attention weights (score-forming attentions).
        drop_path_rate: stochastic depth, rising linearly over all blocks to this rate.
        dynamic_img_size: take any input size, the grids following it.
    """

    def __init__(
            self,
            img_size: Union[int, Grid] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dims: Sequence[int] = (64, 128, 320, 512),
            num_heads: Sequence[int] = (1, 2, 5, 8),
            mlp_ratios: Sequence[float] = (8, 8, 4, 4),
            qkv_bias: bool = True,
            depths: Sequence[int] = (3, 4, 6, 3),
            sr_ratios: Sequence[int] = (8, 4, 2, 1),
            linear: bool = False,
            la_sr_ratios: Union[str, Sequence[int]] = '1111',
            attn_type: Union[str, Sequence[str]] = 'softmax',
            attn_kwargs: Optional[Dict[str, Any]] = None,
            global_pool: str = 'avg',
            drop_rate: float = 0.,
            proj_drop_rate: Optional[float] = None,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            dynamic_img_size: bool = False,
    ):
        super().__init__()
        check_arguments(
            sizes=dict(img_size=img_size, in_chans=in_chans, embed_dims=embed_dims, num_heads=num_heads,
                       sr_ratios=sr_ratios),
            counts=dict(num_classes=num_classes, depths=depths), ratios=dict(mlp_ratios=mlp_ratios),
            rates=dict(drop_rate=drop_rate, proj_drop_rate=proj_drop_rate, attn_drop_rate=attn_drop_rate,
                       drop_path_rate=drop_path_rate),
            flags=dict(qkv_bias=qkv_bias, linear=linear, dynamic_img_size=dynamic_img_size),
            per_stage=PER_STAGE_ARGUMENTS)
        la_sr_ratios = check_stage_lists(embed_dims=embed_dims, num_heads=num_heads, mlp_ratios=mlp_ratios,
                                         depths=depths, sr_ratios=sr_ratios, la_sr_ratios=la_sr_ratios)
        names = stage_attentions(attn_type, depths)
        self.num_stages = NUM_STAGES
        self.img_divisor = 1
        # pooling to a fixed size takes a map of any size
        self.img_min_side = smallest_side(_STRIDES, names, [1] * NUM_STAGES if linear else sr_ratios, la_sr_ratios)
        self._init_input_size(dynamic_img_size)
        self.img_size: Grid = tuple(to_2tuple(img_size))
        self._check_size(self.img_size, 'img_size')
        self._init_output_fmt('NCHW')
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.num_prefix_tokens = 0
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.grad_checkpointing = False

        attn_kwargs = check_attn_kwargs([name for stage in names for name in stage], attn_kwargs)
        refuse_causal(attn_kwargs, "PVT v2 embeds overlapping patches of the grid between its stages and mixes "
                                   "neighbouring tokens in its MLPs' depthwise convolutions")
        proj_drop_rate = split_drop_rates(drop_rate, proj_drop_rate=proj_drop_rate)[1]
        rates = iter(calculate_drop_path_rates(drop_path_rate, sum(depths)))
        grid = self.img_size
        self.stages = nn.ModuleList()
        for i in range(NUM_STAGES):
            patch_size, stride = 7 if i == 0 else 3, _STRIDES[i]
            dim = embed_dims[i]
            patch_embed = OverlapPatchEmbed(patch_size, stride, in_chans if i == 0 else embed_dims[i - 1], dim)
            grid = patch_embed.output_grid(grid)
            self.stages.append(PvtV2Stage(patch_embed, [
                PvtV2Block(
                    dim,
                    build_attention(
                        name, dim, num_heads[i], grid, qkv_bias, grouping='reduction', attn_kwargs=attn_kwargs,
                        **_key_reduction(name, sr_ratios[i], la_sr_ratios[i], linear),
                        attn_drop=attn_drop_rate, proj_drop=proj_drop_rate),
                    mlp_ratio=mlp_ratios[i], drop=proj_drop_rate, drop_path=next(rates), extra_relu=linear)
                for name in names[i]], dim))
        self.head = nn.Linear(embed_dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(module=f'stages.{i}', num_chs=embed_dims[i], reduction=4 * 2 ** i)
                             for i in range(NUM_STAGES)]
        OfficialKeys(_STAGE_KEYS.to_official, _STAGE_KEYS.to_module).register(self)
        self.apply(init_weights_pvt_v2)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # The official model names position embeddings it does not have: every parameter is decayed.
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        stem = r'^stages\.0\.patch_embed'
        if coarse:
            return dict(stem=stem, blocks=r'^stages\.(\d+)')
        # a stage's patch embedding joins its first block, its norm (after the blocks) its last
        return dict(stem=stem, blocks=[(r'^stages\.(\d+)\.blocks\.(\d+)', None),
                                       (r'^stages\.(\d+)\.patch_embed', (0,)),
                                       (r'^stages\.(\d+)\.norm', (99999,))])

    def _set_grids(self, img_size: Grid) -> None:
        grid = img_size
        for stage in self.stages:
            grid = stage.patch_embed.output_grid(grid)
            for block in stage.blocks:
                block.attn.set_grid(grid)

    def _final_norm(self, x: Tensor) -> Tensor:
        # every stage ends in its own norm, the last one included
        return x

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """Stage by stage: (B, h*w, C_i) tokens after the stage's norm."""
        grid = self._input_grid(x)
        kept: Dict[int, Tuple[Tensor, Grid]] = {}
        for i, stage in enumerate(self.stages):
            if i < num_stages:
                if i:
                    x = tokens_to_image(x, grid)
                x, grid = stage(x, grid, self.grad_checkpointing)
                if i in keep:
                    kept[i] = (x, grid)
        return x, grid, kept

    def official_key_names(self, keys: Sequence[str]) -> Dict[str, str]:
        if 'patch_embed.proj.weight' not in keys:  # timm's stem; the official one is patch_embed1
            return {}
        official = {key: _timm_key_to_official(key) for key in keys}
        return {key: name for key, name in official.items() if name != key}

    def _prune_stages(self, num_stages: int) -> None:
        self.stages = self.stages[:num_stages]


_TIMM_STAGE_KEY = re.compile(r'^stages\.(\d+)\.(blocks|downsample|norm)')


def _timm_key_to_official(key: str) -> str:
    """A key of timm's `pvt_v2_b*` layout under its official name (timm's `stages.{i}` nesting undone)."""
    if key.startswith('patch_embed.'):
        return 'patch_embed1.' + key[len('patch_embed.'):]

    def stage(match: 're.Match') -> str:
        i, part = int(match.group(1)), match.group(2)
        return {'blocks': f'block{i + 1}', 'downsample': f'patch_embed{i + 1}', 'norm': f'norm{i + 1}'}[part]

    key = _TIMM_STAGE_KEY.sub(stage, key)
    return re.sub(r'\.mlp\.dwconv\.(weight|bias)$', r'.mlp.dwconv.dwconv.\1', key)


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: PyramidVisionTransformerV2,
                         strict: bool = True) -> Dict[str, Tensor]:
    """Adapt a PVT v2 checkpoint (any attention; the official layout or timm's `pvt_v2_b*`) to `model`: unwrap,
    rename timm's keys to the official ones, resize grid-sized tensors to the model's grids, check the keys."""
    return filter_checkpoint(state_dict, model, strict=strict)


def _create_pvt_v2(variant: str, pretrained: bool, model_args: Dict[str, Any],
                   kwargs: Dict[str, Any]) -> PyramidVisionTransformerV2:
    out_indices = kwargs.pop('out_indices', (0, 1, 2, 3))
    return create_variant(PyramidVisionTransformerV2, variant, pretrained, model_args, kwargs,
                          pretrained_filter_fn=checkpoint_filter_fn,
                          feature_cfg=dict(out_indices=out_indices, feature_cls='getter'))


_cfg = partial(imagenet_cfg, fixed_input_size=True, pool_size=(7, 7), first_conv='patch_embed1.proj')

_SIZES = ('b0', 'b1', 'b2', 'b3', 'b4', 'b5')
_WIDE = (64, 128, 320, 512)
_SIZE_ARGS: Dict[str, Dict[str, Any]] = {
    'b0': dict(embed_dims=(32, 64, 160, 256), depths=(2, 2, 2, 2)),
    'b1': dict(embed_dims=_WIDE, depths=(2, 2, 2, 2)),
    'b2': dict(embed_dims=_WIDE, depths=(3, 4, 6, 3)),
    'b3': dict(embed_dims=_WIDE, depths=(3, 4, 18, 3)),
    'b4': dict(embed_dims=_WIDE, depths=(3, 8, 27, 3)),
    'b5': dict(embed_dims=_WIDE, depths=(3, 6, 40, 3), mlp_ratios=(4, 4, 4, 4)),
}
_COMMON = dict(num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4), qkv_bias=True, sr_ratios=(8, 4, 2, 1),
               la_sr_ratios='1111')
# The FLatten-PVTv2 models as released (B0) or configured (B1-B4): focused linear attention in every stage.
_OFFICIAL: Dict[str, Tuple[Dict[str, Any], str]] = {
    f'flatten_pvt_v2_{size}': (dict(_COMMON, **_SIZE_ARGS[size], attn_type='LLLL'),
                               f'FLatten-PVTv2-{size.upper()}: focused linear attention in every stage (LLLL).')
    for size in _SIZES[:5]
}
_VARIANTS: Dict[str, Tuple[Dict[str, Any], str]] = {
    **{f'{attn}_pvt_v2_{size}': (dict(_COMMON, **_SIZE_ARGS[size], attn_type=attn),
                                 f'PVT v2-{size} with {attn} attention in every block.')
       for attn in list_attentions() for size in _SIZES},
    **{f'{attn}_pvt_v2_b2_li': (dict(_COMMON, **_SIZE_ARGS['b2'], linear=True, attn_type=attn),
                                f'PVT v2-b2-Linear (keys pooled to 7 × 7) with {attn} attention in every block.')
       for attn in list_attentions()},
    **_OFFICIAL,
}

_PVT_V2_META = dict(paper_ids='arXiv:2106.13797', origin_url='https://github.com/whai362/PVT', license='apache-2.0')

default_cfgs = generate_default_cfgs(tag_weights({
    **{name: _cfg() for name in _VARIANTS},
    **{f'softmax_pvt_v2_{size}': _cfg(f'https://github.com/whai362/PVT/releases/download/v2/pvt_v2_{size}.pth',
                                      **_PVT_V2_META)
       for size in (*_SIZES, 'b2_li')},
    'flatten_pvt_v2_b0': _cfg(tsinghua_url('5d1f01532b104da28e7b'), **FLATTEN_META),
    **{f'flatten_pvt_v2_{size}': _cfg(**FLATTEN_META) for size in _SIZES[1:5]},
}))

register_variants(__name__, _VARIANTS, _create_pvt_v2)
