"""CSwin Transformer (cross-shaped stripes with LePE) with the attention of every block taken from the registry.

State-dict names are those of the original CSwin code, which the papers' checkpoints keep: the convolutional stem
`stage1_conv_embed.{0,2}`, blocks `stage{s}.{j}.{qkv,norm1,proj,attns.k.*,mlp.*,norm2}`, `merge{1,2,3}.{conv,norm}`,
a final `norm`, mean pooling over tokens and a `head` Linear.

The stages are `stages.{i}` modules (the stem or the merge from the previous stage as `embed`, then the blocks),
which TorchScript loops over; `OfficialKeys` gives the state dict the official names (`stages.0.embed` is
`stage1_conv_embed`, `stages.{i}.embed` `merge{i}`, `stages.{i}.blocks` `stage{i+1}`). Each block holds the stripes
grouping as `attn` (it owns `qkv`, `attns` and `proj`); state-dict hooks move those names to the block level,
where the official checkpoints keep them, on saving and loading. Stripes: the
score-forming stages use `split_size`, the others `la_split_size` (None: the whole grid, one global branch, as
the official linear stages at their trained resolution), and the last stage is always one global branch. The
attention gets the un-normalised block input as the tokens that mixers needing them summarise, as the official
linear-attention CSwin does.

`forward_features` returns the last stage's normed map as (B, H, W, C) (`output_fmt` 'NHWC'), as timm's Swin does.
Another input size: stripes that do not tile a grid are padded with zeros below or right. With
`dynamic_img_size=True` every input size runs on the built weights: stripes keep their width and span the grid,
global branches stay global, and FLatten's positional encodings are resampled bicubically to the stripe or grid;
`set_input_size` makes such a size the model's own.

Registered: every attention of the registry at the CSwin sizes (`{attention}_cswin_{tiny,small,base,base_384}`,
the original's architecture), except that the names of the official models (`_OFFICIAL`) are theirs.
"""
import re
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from timm.layers import DropPath, Mlp, calculate_drop_path_rates, to_2tuple
from timm.models import generate_default_cfgs

from .attention import build_attention, check_attn_kwargs, forms_score_matrix, list_attentions, stage_attentions
from .attention.layout import Grid, image_to_tokens, tokens_to_image
from .checkpoint import filter_checkpoint, rename_loaded_keys
from .family import (
    FLATTEN_META, INLINE_META, BlockStack, OfficialKeys, ZooModel, check_arguments, create_variant, imagenet_cfg,
    init_weights, register_variants, split_drop_rates, tag_weights, tsinghua_url,
)

__all__ = ['CSWinTransformer', 'checkpoint_filter_fn']

NUM_STAGES = 4
# Block-level names of the official checkpoints, in their order; qkv, proj and attns live in `attn` here.
_BLOCK_KEYS = ('qkv', 'norm1', 'proj', 'attns', 'mlp', 'norm2')
_ATTN_KEYS = ('qkv.', 'proj.', 'attns.')


def _to_official_names(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of a block: `attn.qkv.*` -> `qkv.*` etc., entries in the official order."""
    entries = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix):]
        entries[prefix + name[len('attn.'):] if name.startswith('attn.') else key] = state_dict.pop(key)
    rank = {name: i for i, name in enumerate(_BLOCK_KEYS)}
    for key in sorted(entries, key=lambda k: rank.get(k[len(prefix):].split('.', 1)[0], len(rank))):
        state_dict[key] = entries[key]


def _from_official_names(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook of a block: `qkv.*`, `proj.*`, `attns.*` -> `attn.qkv.*` etc."""
    rename_loaded_keys(module, state_dict, {key: prefix + 'attn.' + key[len(prefix):] for key in state_dict
                                            if key.startswith(prefix) and key[len(prefix):].startswith(_ATTN_KEYS)})


_STAGE_KEY = re.compile(r'^stages\.(\d+)\.(embed|blocks)(?=\.|$)')
_OFFICIAL_STAGE_KEY = re.compile(r'^(?:(stage1_conv_embed)|merge(\d+)|stage(\d+))(?=\.|$)')


def _stage_key_to_official(key: str) -> str:
    """'stages.0.embed.0.weight' -> 'stage1_conv_embed.0.weight', 'stages.2.embed.conv.weight' ->
    'merge2.conv.weight', 'stages.2.blocks.1.qkv.weight' -> 'stage3.1.qkv.weight'."""
    def stage(match: 're.Match') -> str:
        i = int(match.group(1))
        if match.group(2) == 'blocks':
            return f'stage{i + 1}'
        return f'merge{i}' if i else 'stage1_conv_embed'
    return _STAGE_KEY.sub(stage, key)


def _official_key_to_module(key: str) -> str:
    """The inverse of `_stage_key_to_official`; other keys unchanged."""
    def stage(match: 're.Match') -> str:
        if match.group(1):
            return 'stages.0.embed'
        if match.group(2):
            return f'stages.{match.group(2)}.embed'
        return f'stages.{int(match.group(3)) - 1}.blocks'
    return _OFFICIAL_STAGE_KEY.sub(stage, key)


class Tokens(nn.Module):
    """(B, C, H, W) -> (B, H*W, C)."""

    def forward(self, x: Tensor) -> Tensor:
        return image_to_tokens(x)


class ConvStem(nn.Sequential):
    """Conv 7x7 stride 4, then LayerNorm on the tokens: (B, C_in, H, W) images -> (B, h*w, C) and the grid
    (h, w). A Sequential, so its keys stay the official `stage1_conv_embed.{0,2}`."""

    def __init__(self, in_chans: int, dim: int):
        super().__init__(nn.Conv2d(in_chans, dim, 7, 4, 2), Tokens(), nn.LayerNorm(dim))

    def forward(self, x: Tensor, grid: Grid) -> Tuple[Tensor, Grid]:
        for layer in self:
            x = layer(x)
        return x, stem_grid(grid)


def stem_grid(img_size: Grid) -> Grid:
    """The token grid of the stride-4 stem (kernel 7, padding 2) on images of `img_size`."""
    return ((img_size[0] - 3) // 4 + 1, (img_size[1] - 3) // 4 + 1)


def merged_grid(grid: Grid) -> Grid:
    """The token grid after a stride-2 merge of `grid`."""
    return ((grid[0] - 1) // 2 + 1, (grid[1] - 1) // 2 + 1)


class MergeBlock(nn.Module):
    """Conv 3x3 stride 2 then LayerNorm: (B, H*W, C) on the (H, W) grid -> (B, ceil(H/2)*ceil(W/2), dim_out) and
    that grid."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim_out, 3, 2, 1)
        self.norm = nn.LayerNorm(dim_out)

    def forward(self, x: Tensor, grid: Grid) -> Tuple[Tensor, Grid]:
        return self.norm(image_to_tokens(self.conv(tokens_to_image(x, grid)))), merged_grid(grid)


class CSWinStage(nn.Module):
    """The stem (stage 0) or the merge from the previous stage, then the blocks: (B, C_in, H, W) images or
    (B, h*w, C_in) tokens on `grid` -> (B, h'*w', C) tokens on the grid (h', w') it returns."""

    def __init__(self, embed: Union[ConvStem, MergeBlock], blocks: List[nn.Module]):
        super().__init__()
        self.embed = embed
        self.blocks = BlockStack(*blocks)

    def forward(self, x: Tensor, grid: Grid, grad_checkpointing: bool = False) -> Tuple[Tensor, Grid]:
        x, grid = self.embed(x, grid)
        return self.blocks(x, grid, grad_checkpointing), grid


class CSWinBlock(nn.Module):
    """x + proj(cross-shaped attention(norm1 x)), then x + mlp(norm2 x), on a (B, H*W, C) token map.

    The attention also gets the un-normalised block input, for the mixers that summarise their tokens.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            grid_size: Grid,
            attn_name: str,
            split_size: int,
            mlp_ratio: float,
            qkv_bias: bool,
            drop: float,
            attn_drop: float,
            drop_path: float,
            attn_kwargs: Dict[str, Any],
    ):
        super().__init__()
        self.grid_size = grid_size
        self.norm1 = nn.LayerNorm(dim)
        # The official block applies no dropout after `proj`, hence no proj_drop.
        self.attn = build_attention(attn_name, dim, num_heads, grid_size, qkv_bias, grouping='stripes',
                                    split_size=split_size, attn_kwargs=attn_kwargs, attn_drop=attn_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.norm2 = nn.LayerNorm(dim)
        self.register_state_dict_post_hook(_to_official_names)
        self.register_load_state_dict_pre_hook(_from_official_names)

    def __getattr__(self, name: str) -> Any:
        """`attn`'s `qkv`, `proj` and `attns` also under their state-dict names, as `MixerHost.__getattr__`."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name + '.' not in _ATTN_KEYS:
                raise
            return getattr(self.attn, name)

    def _fqn_modifiers(self) -> Dict[str, str]:
        """The state-dict names that skip the `attn` module (`qkv.*` for `attn.qkv.*`), for
        torch.distributed.checkpoint, as `MixerHost._fqn_modifiers`."""
        return {name.rstrip('.'): 'attn' for name in _ATTN_KEYS}

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, H*W, C) on the grid `size` = (H, W) -> (B, H*W, C)."""
        x = x + self.drop_path(self.attn(self.norm1(x), size, block_input=x))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def _parse_split(value: Union[str, Sequence[int]], what: str) -> List[int]:
    parts = value.split('-') if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or not all(str(part).isdigit() for part in parts):
        parts = []
    sizes = [int(part) for part in parts]
    if len(sizes) != NUM_STAGES or min(sizes) < 1:
        raise ValueError(f"{what} {value!r} must give {NUM_STAGES} positive stripe widths, e.g. '56-28-14-7'")
    return sizes


class CSWinTransformer(ZooModel):
    """CSwin Transformer with a swappable attention per block (original CSwin layout and key names).

    Args:
        img_size: input size (int or (H, W)), sides multiples of 4; the model takes only this size unless
            `dynamic_img_size`. Stage grids: the stem's stride-4 output, then halved (rounding up) by every merge.
        patch_size: must be 4, the stride of the convolutional stem (accepted for the official signature).
        in_chans, num_classes: input channels and classes (0: no head).
        global_pool: 'avg', 'max' or 'avgmax' (mean, maximum or their average over tokens) or '' (no pooling).
        embed_dim: channels of stage 1, doubled by every merge.
        depth, num_heads: blocks and heads of the four stages.
        split_size: stripe width per stage for score-forming attentions (the last stage is always global).
        la_split_size: stripe width per stage for attentions that form no score matrix, as a list or a
            '56-28-14-7' string;
            None for one global branch in every stage.
        mlp_ratio, qkv_bias: MLP hidden ratio and query/key/value bias.
        attn_type: an attention name, one name per stage, or an official pattern ('IISS', 'LLSS', ...).
        mixed_linear: the linear attention of an 'M' stage when the pattern has no I or L stage.
        attn_kwargs: method options of the attentions (`models.attention.list_attention_options()`).
        drop_rate: dropout in the MLPs; proj_drop_rate: timm's name for it, `drop_rate` unless given;
        attn_drop_rate: on attention weights; drop_path_rate: stochastic depth,
            linear over all blocks.
        dynamic_img_size: take any input size whose sides are multiples of 4.
        split_img_size: the input size whose stage grids decide which branches are global (a stripe as wide as its
            grid, a linear stage without `la_split_size`, the last stage), None for `img_size`. `set_input_size`
            keeps a model's branches and records the size they were decided at here, so that a model saved after it
            is rebuilt with the same branches.
    """

    official_head_init = True

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 4,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dim: int = 64,
            depth: Sequence[int] = (1, 2, 21, 1),
            num_heads: Sequence[int] = (2, 4, 8, 16),
            split_size: Sequence[int] = (1, 2, 7, 7),
            la_split_size: Optional[Union[str, Sequence[int]]] = None,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: Union[str, Sequence[str]] = 'softmax',
            mixed_linear: Optional[str] = None,
            attn_kwargs: Optional[Dict[str, Any]] = None,
            drop_rate: float = 0.,
            proj_drop_rate: Optional[float] = None,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            dynamic_img_size: bool = False,
            split_img_size: Optional[Union[int, Tuple[int, int]]] = None,
    ):
        super().__init__()
        check_arguments(
            sizes=dict(img_size=img_size, in_chans=in_chans, embed_dim=embed_dim, num_heads=num_heads,
                       split_img_size=split_img_size),
            counts=dict(num_classes=num_classes, depth=depth), ratios=dict(mlp_ratio=mlp_ratio),
            rates=dict(drop_rate=drop_rate, proj_drop_rate=proj_drop_rate, attn_drop_rate=attn_drop_rate,
                       drop_path_rate=drop_path_rate),
            flags=dict(qkv_bias=qkv_bias, dynamic_img_size=dynamic_img_size),
            per_stage=('depth', 'num_heads'))
        if patch_size != 4:
            raise ValueError(f"patch_size {patch_size} is not supported: the CSwin stem has stride 4 (expected 4)")
        if len(depth) != NUM_STAGES or len(num_heads) != NUM_STAGES:
            raise ValueError(f"depth {list(depth)} and num_heads {list(num_heads)} must give {NUM_STAGES} values")
        split_size = _parse_split(split_size, 'split_size')
        la_split = None if la_split_size is None else _parse_split(la_split_size, 'la_split_size')
        self.img_size: Grid = tuple(to_2tuple(img_size))
        self.img_divisor = 4  # the stem's stride
        self.split_img_size: Grid = self.img_size if split_img_size is None else tuple(to_2tuple(split_img_size))
        self._init_input_size(dynamic_img_size)
        self._check_size(self.img_size, 'img_size')
        self._check_size(self.split_img_size, 'split_img_size')
        self.grid_sizes = self._stage_grids(self.split_img_size)
        self._init_output_fmt('NHWC')
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_prefix_tokens = 0
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.num_stages = NUM_STAGES
        self.num_features = self.head_hidden_size = embed_dim * 2 ** (NUM_STAGES - 1)
        self.attn_names = stage_attentions(attn_type, depth, mixed_linear)
        attn_kwargs = check_attn_kwargs([name for stage in self.attn_names for name in stage], attn_kwargs)
        self.grad_checkpointing = False

        proj_drop_rate = split_drop_rates(drop_rate, proj_drop_rate=proj_drop_rate)[1]
        dpr = calculate_drop_path_rates(drop_path_rate, sum(depth))
        self.stages = nn.ModuleList()
        self.feature_info = []
        for i in range(NUM_STAGES):
            dim, stage_grid = embed_dim * 2 ** i, self.grid_sizes[i]
            embed = MergeBlock(dim // 2, dim) if i else ConvStem(in_chans, dim)
            blocks = []
            for j, name in enumerate(self.attn_names[i]):
                if i == NUM_STAGES - 1:
                    split = max(stage_grid)
                elif forms_score_matrix(name):
                    split = split_size[i]
                else:
                    split = max(stage_grid) if la_split is None else la_split[i]
                blocks.append(CSWinBlock(
                    dim, num_heads[i], stage_grid, name, split, mlp_ratio, qkv_bias, proj_drop_rate, attn_drop_rate,
                    dpr[sum(depth[:i]) + j], attn_kwargs))
            self.stages.append(CSWinStage(embed, blocks))
            self.feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** i, module=f'stages.{i}'))
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        OfficialKeys(_stage_key_to_official, _official_key_to_module).register(self)
        self.apply(init_weights)
        if self.split_img_size != self.img_size:  # the branches of that size, on this size's grids
            self._set_grids(self.img_size)

    def _resize_args(self) -> Dict[str, Any]:
        return dict(split_img_size=self.split_img_size)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        # The official optimiser exempts only 1-D parameters and biases (its name list matches nothing).
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^stages\.0\.embed',
            blocks=r'^stages\.(\d+)' if coarse else [
                (r'^stages\.(\d+)\.embed', (0,)),
                (r'^stages\.(\d+)\.blocks\.(\d+)', None),
                (r'^norm', (99999,)),
            ],
        )

    @staticmethod
    def _stage_grids(img_size: Grid) -> List[Grid]:
        """The token grid of every stage for images of `img_size`."""
        grids = [stem_grid(img_size)]
        for _ in range(NUM_STAGES - 1):
            grids.append(merged_grid(grids[-1]))
        return grids

    def _set_grids(self, img_size: Grid) -> None:
        self.grid_sizes = self._stage_grids(img_size)
        for stage, grid in zip(self.stages, self.grid_sizes):
            for block in stage.blocks:
                block.grid_size = grid
                block.attn.set_grid(grid)

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """The stem, then per stage the merge from the previous one and the blocks: (B, h*w, C_i) tokens."""
        grid = self._input_grid(x)
        kept: Dict[int, Tuple[Tensor, Grid]] = {}
        for i, stage in enumerate(self.stages):
            if i < num_stages:
                x, grid = stage(x, grid, self.grad_checkpointing)
                if i in keep:
                    kept[i] = (x, grid)
        return x, grid, kept

    def _prune_stages(self, num_stages: int) -> None:
        self.stages = self.stages[:num_stages]


def checkpoint_filter_fn(state_dict: Mapping[str, Tensor], model: CSWinTransformer,
                         strict: bool = True) -> Dict[str, Tensor]:
    """An official CSwin state dict (any attention; the papers keep CSwin's key names) made ready for `model`.

    Unwraps the weights (the EMA weights of a file that holds both: the CSWin releases, whose code evaluates
    them), drops derived buffers, resizes grid-sized tensors to the model's grids, and
    raises `CheckpointError` listing the keys when the checkpoint belongs to another model.
    """
    return filter_checkpoint(state_dict, model, strict=strict)


def _create_cswin(variant: str, pretrained: bool, model_args: Dict[str, Any],
                  kwargs: Dict[str, Any]) -> CSWinTransformer:
    return create_variant(CSWinTransformer, variant, pretrained, model_args, kwargs,
                          pretrained_filter_fn=checkpoint_filter_fn,
                          feature_cfg=dict(feature_cls='getter', out_indices=(0, 1, 2, 3)))


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='stage1_conv_embed.0', pool_size=(7, 7))

# The sizes of the official linear-attention models (the papers train no CSwin-L).
_PAPER_SIZES = ('tiny', 'small', 'base', 'base_384')
_SPLIT_224, _SPLIT_384 = (1, 2, 7, 7), (1, 2, 12, 12)

# The original CSwin models, which every attention of the registry takes.
_ORIGINAL = {
    'tiny': dict(embed_dim=64, depth=(1, 2, 21, 1), num_heads=(2, 4, 8, 16), split_size=_SPLIT_224),
    'small': dict(embed_dim=64, depth=(2, 4, 32, 2), num_heads=(2, 4, 8, 16), split_size=_SPLIT_224),
    'base': dict(embed_dim=96, depth=(2, 4, 32, 2), num_heads=(4, 8, 16, 32), split_size=_SPLIT_224),
    'base_384': dict(img_size=384, embed_dim=96, depth=(2, 4, 32, 2), num_heads=(4, 8, 16, 32),
                     split_size=_SPLIT_384),
    'large': dict(embed_dim=144, depth=(2, 4, 32, 2), num_heads=(6, 12, 24, 24), split_size=_SPLIT_224),
    'large_384': dict(img_size=384, embed_dim=144, depth=(2, 4, 32, 2), num_heads=(6, 12, 24, 24),
                      split_size=_SPLIT_384),
}
# The official linear-attention models: their own depths and linear stripes.
_PAPER_DEPTHS = {'tiny': (2, 4, 18, 1), 'small': (3, 6, 29, 2), 'base': (3, 6, 29, 2), 'base_384': (3, 6, 29, 2)}


def _paper_args(size: str, depth: Tuple[int, ...], attn_type: str, **extra: Any) -> Dict[str, Any]:
    # The official la_split_size ('56-28-14-7', '96-48-24-12' at 384) is every stage's grid at the trained size:
    # one global branch. None keeps that branch global at any img_size, so the released weights load there too.
    return dict(_ORIGINAL[size], depth=depth, attn_type=attn_type, **extra)


_OFFICIAL: Dict[str, Tuple[Dict[str, Any], str]] = {
    **{f'inline_cswin_{size}': (_paper_args(size, _PAPER_DEPTHS[size], 'IISS'), 'The official model, pattern IISS.')
       for size in _PAPER_SIZES},
    **{f'flatten_cswin_{size}': (_paper_args(size, (2, 4, 32, 2) if size == 'small' else _PAPER_DEPTHS[size], 'LLSS',
                                             mixed_linear='L'), 'The official model, pattern LLSS.')
       for size in _PAPER_SIZES},
}
_VARIANTS: Dict[str, Tuple[Dict[str, Any], str]] = {
    **{f'{attn}_cswin_{size}': (dict(args, attn_type=attn),
                                f'CSwin-{size} (the original architecture) with {attn} attention in every block.')
       for attn in list_attentions() for size, args in _ORIGINAL.items()},
    **_OFFICIAL,
}

_CSWIN_META = dict(paper_ids='arXiv:2107.00652', origin_url='https://github.com/microsoft/CSWin-Transformer',
                  license='mit')
_CSWIN_URL = 'https://github.com/microsoft/CSWin-Transformer/releases/download/v0.1.0/{}.pth'
# The papers evaluate with a 256/224 resize then crop at every size; the original CSwin code's configuration
# uses crop_pct 0.9 at 224 and 1.0 at 384.
_ORIGINAL_EVAL = {size: dict(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0) if size.endswith('_384')
                  else dict(crop_pct=0.9)
                  for size in _ORIGINAL}
_PAPER_EVAL = {size: dict(input_size=(3, 384, 384), pool_size=(12, 12)) if size == 'base_384' else {}
               for size in _PAPER_SIZES}
# CSwin's releases: ImageNet-1k weights for T/S/B, and CSwin-L pretrained on ImageNet-22k (21841 classes) and
# fine-tuned on ImageNet-1k.
_CSWIN_RELEASES: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    'softmax_cswin_tiny.in1k': ('tiny', 'cswin_tiny_224', {}),
    'softmax_cswin_small.in1k': ('small', 'cswin_small_224', {}),
    'softmax_cswin_base.in1k': ('base', 'cswin_base_224', {}),
    'softmax_cswin_base_384.in1k': ('base_384', 'cswin_base_384', {}),
    'softmax_cswin_large.in22k_ft_in1k': ('large', 'cswin_large_224', {}),
    'softmax_cswin_large.in22k': ('large', 'cswin_large_22k_224', dict(num_classes=21841)),
    'softmax_cswin_large_384.in22k_ft_in1k': ('large_384', 'cswin_large_384', {}),
}

default_cfgs = generate_default_cfgs(tag_weights({
    **{f'{attn}_cswin_{size}': _cfg(**_ORIGINAL_EVAL[size]) for attn in list_attentions() for size in _ORIGINAL},
    **{f'{prefix}_cswin_{size}': _cfg(**_PAPER_EVAL[size], **meta)
       for prefix, meta in (('inline', INLINE_META), ('flatten', FLATTEN_META)) for size in _PAPER_SIZES},
    **{name: _cfg(_CSWIN_URL.format(file), **_ORIGINAL_EVAL[size], **extra, **_CSWIN_META)
       for name, (size, file, extra) in _CSWIN_RELEASES.items()},
    'inline_cswin_tiny': _cfg(tsinghua_url('49fa2ecc543647c4b970'), **INLINE_META),
    'inline_cswin_small': _cfg(tsinghua_url('59f4e65f776f4052b93c'), **INLINE_META),
    'inline_cswin_base': _cfg(tsinghua_url('91e17121df284ae38521'), **INLINE_META),
    'flatten_cswin_tiny': _cfg(tsinghua_url('48ba765ba8b0451d9d5a'), **FLATTEN_META),
}))

register_variants(__name__, _VARIANTS, _create_cswin)
