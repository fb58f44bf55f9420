"""CSwin Transformer (cross-shaped stripes with LePE) with the attention of every block taken from the registry.

State-dict names are those of the original CSwin code, which the InLine and FLatten checkpoints keep: the
convolutional stem `stage1_conv_embed.{0,2}`, blocks `stage{s}.{j}.{qkv,norm1,proj,attns.k.*,mlp.*,norm2}`,
`merge{1,2,3}.{conv,norm}`, a final `norm`, mean pooling over tokens and a `head` Linear.

Each block holds a `CrossShapedAttention` as `attn` (it owns `qkv`, `attns` and `proj`); state-dict hooks move
those names to the block level, where the official checkpoints keep them, on saving and loading. Stripes: the
score-forming stages use `split_size`, the linear ones `la_split_size` (None: the whole grid, one global branch,
as the official linear stages at their trained resolution), and the last stage is always one global branch.

Variants: `inline_cswin_*` and `flatten_cswin_*` (official InLine / FLatten models), `softmax_cswin_*` (the
original CSwin), and `multimax_cswin_*`, `sima_cswin_*`, `additive_cswin_*` (the original's architecture with
that attention).
"""
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from timm.layers import DropPath, Mlp, calculate_drop_path_rates, global_pool_nlc, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from .checkpoint import check_state_dict, checkpoint_state_dict, drop_derived_buffers
from ._common import (
    FLATTEN_META, INLINE_META, check_global_pool, check_img_size, check_output_fmt, imagenet_cfg, init_weights,
    new_classifier, run_blocks, tsinghua_url,
)
from .attention import build_attention, is_linear_attention, method_kwargs, stage_attentions
from .attention.base import Grid, image_to_tokens, tokens_to_image
from .swin import resize_attention_tables

__all__ = ['CSWinTransformer', 'checkpoint_filter_fn']

NUM_STAGES = 4
GLOBAL_POOLS = ('avg', '')
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
    for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):].startswith(_ATTN_KEYS)]:
        state_dict[prefix + 'attn.' + key[len(prefix):]] = state_dict.pop(key)


def _official_to_module_name(prefix: str) -> str:
    """Official key prefix -> module name: 'stage1.0.attns.0' -> 'stage1.0.attn.attns.0'."""
    parts = prefix.split('.')
    if len(parts) > 2 and parts[0].startswith('stage') and f'{parts[2]}.' in _ATTN_KEYS:
        parts.insert(2, 'attn')
    return '.'.join(parts)


class Tokens(nn.Module):
    """(B, C, H, W) -> (B, H*W, C)."""

    def forward(self, x: Tensor) -> Tensor:
        return image_to_tokens(x)


class MergeBlock(nn.Module):
    """Conv 3x3 stride 2 then LayerNorm: (B, H*W, C) on `grid_size` -> (B, ceil(H/2)*ceil(W/2), dim_out)."""

    def __init__(self, dim: int, dim_out: int, grid_size: Grid):
        super().__init__()
        self.grid_size = grid_size
        self.conv = nn.Conv2d(dim, dim_out, 3, 2, 1)
        self.norm = nn.LayerNorm(dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(image_to_tokens(self.conv(tokens_to_image(x, self.grid_size))))


class CSWinBlock(nn.Module):
    """x + proj(cross-shaped attention(norm1 x)), then x + mlp(norm2 x), on a (B, H*W, C) token map.

    The attention also gets the un-normalised block input (InLine summarises it, as the official InLine-CSwin).
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
            attn_options: Dict[str, Any],
    ):
        super().__init__()
        self.grid_size = grid_size
        self.norm1 = nn.LayerNorm(dim)
        # The official block applies no dropout after `proj`, hence no proj_drop.
        self.attn = build_attention(attn_name, dim, num_heads, grid_size, qkv_bias, split_size=split_size,
                                    attn_drop=attn_drop, **method_kwargs(attn_name, **attn_options))
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.norm2 = nn.LayerNorm(dim)
        self.register_state_dict_post_hook(_to_official_names)
        self.register_load_state_dict_pre_hook(_from_official_names)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), self.grid_size, block_input=x))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def _parse_split(value: Union[str, Sequence[int]], what: str) -> List[int]:
    sizes = [int(s) for s in value.split('-')] if isinstance(value, str) else [int(s) for s in value]
    if len(sizes) != NUM_STAGES or min(sizes) < 1:
        raise ValueError(f"{what} {value!r} must give {NUM_STAGES} positive stripe widths, e.g. '56-28-14-7'")
    return sizes


class CSWinTransformer(nn.Module):
    """CSwin Transformer with a swappable attention per block (original CSwin layout and key names).

    Args:
        img_size: input size (int or (H, W)); the model takes only this size. Stage grids: the stem's
            stride-4 output, then halved (rounding up) by every merge.
        patch_size: must be 4, the stride of the convolutional stem (accepted for the official signature).
        in_chans, num_classes: input channels and classes (0: no head).
        global_pool: 'avg' (mean over tokens) or '' (no pooling).
        embed_dim: channels of stage 1, doubled by every merge.
        depth, num_heads: blocks and heads of the four stages.
        split_size: stripe width per stage for score-forming attentions (the last stage is always global).
        la_split_size: stripe width per stage for linear attentions, as a list or a '56-28-14-7' string;
            None for one global branch in every stage.
        mlp_ratio, qkv_bias: MLP hidden ratio and query/key/value bias.
        attn_type: an attention name, one name per stage, or an official pattern ('IISS', 'LLSS', ...).
        mixed_linear: the linear attention of an 'M' stage when the pattern has no I or L stage.
        focusing_factor, kernel_size: FLatten options, given only to attentions that take them.
        drop_rate: dropout in the MLPs; attn_drop_rate: on attention weights; drop_path_rate: stochastic depth,
            linear over all blocks.
    """

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
            mixed_linear: str = 'inline',
            focusing_factor: float = 3,
            kernel_size: int = 5,
            drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
    ):
        super().__init__()
        if patch_size != 4:
            raise ValueError(f"patch_size {patch_size} is not supported: the CSwin stem has stride 4 (expected 4)")
        if len(depth) != NUM_STAGES or len(num_heads) != NUM_STAGES:
            raise ValueError(f"depth {list(depth)} and num_heads {list(num_heads)} must give {NUM_STAGES} values")
        split_size = _parse_split(split_size, 'split_size')
        la_split = None if la_split_size is None else _parse_split(la_split_size, 'la_split_size')
        self.img_size: Grid = to_2tuple(img_size)
        if min(self.img_size) < 8:
            raise ValueError(f"img_size {self.img_size} is too small for the stride-4 stem; expected at least 8")
        grid = tuple((s + 2 * 2 - 7) // 4 + 1 for s in self.img_size)
        self.grid_sizes: List[Grid] = [grid]
        for _ in range(NUM_STAGES - 1):
            grid = tuple((g - 1) // 2 + 1 for g in grid)
            self.grid_sizes.append(grid)
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool, GLOBAL_POOLS)
        self.num_features = self.head_hidden_size = embed_dim * 2 ** (NUM_STAGES - 1)
        self.attn_names = stage_attentions(attn_type, depth, mixed_linear)
        attn_options = dict(focusing_factor=focusing_factor, kernel_size=kernel_size)
        self.grad_checkpointing = False

        self.stage1_conv_embed = nn.Sequential(
            nn.Conv2d(in_chans, embed_dim, 7, 4, 2), Tokens(), nn.LayerNorm(embed_dim))
        dpr = calculate_drop_path_rates(drop_path_rate, sum(depth))
        self.feature_info = []
        for i in range(NUM_STAGES):
            dim, stage_grid = embed_dim * 2 ** i, self.grid_sizes[i]
            if i:
                setattr(self, f'merge{i}', MergeBlock(dim // 2, dim, self.grid_sizes[i - 1]))
            blocks = []
            for j, name in enumerate(self.attn_names[i]):
                if i == NUM_STAGES - 1:
                    split = max(stage_grid)
                elif is_linear_attention(name):
                    split = max(stage_grid) if la_split is None else la_split[i]
                else:
                    split = split_size[i]
                blocks.append(CSWinBlock(
                    dim, num_heads[i], stage_grid, name, split, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                    dpr[sum(depth[:i]) + j], attn_options))
            setattr(self, f'stage{i + 1}', nn.ModuleList(blocks))
            self.feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** i, module=f'stage{i + 1}'))
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(init_weights)

    def _stages(self) -> List[Tuple[nn.Module, nn.ModuleList]]:
        """(entry, blocks) per stage: the stem for stage 1, the merge before each later stage."""
        return [(self.stage1_conv_embed if i == 0 else getattr(self, f'merge{i}'), getattr(self, f'stage{i + 1}'))
                for i in range(NUM_STAGES)]

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        # The official optimiser exempts only 1-D parameters and biases (its name list matches nothing).
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^stage1_conv_embed',
            blocks=r'^(?:stage|merge)(\d+)\.' if coarse else [
                (r'^merge(\d+)\.', (99999,)),
                (r'^stage(\d+)\.(\d+)\.', None),
                (r'^norm', (99999,)),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

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

    def _run_blocks(self, blocks: nn.ModuleList, x: Tensor) -> Tensor:
        return run_blocks(blocks, x, grad_checkpointing=self.grad_checkpointing)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) -> (B, tokens of stage 4, num_features) normalised tokens."""
        check_img_size(x, self.img_size)
        for entry, blocks in self._stages():
            x = self._run_blocks(blocks, entry(x))
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
        """Stage outputs as (B, C, H, W) ('NCHW') or (B, H*W, C) ('NLC').

        `indices`: the last n stages (int), the given stages (list) or all (None). `norm` applies the final norm
        to the last stage's output. Returns the intermediates, or (final features, intermediates).
        """
        check_output_fmt(output_fmt)
        check_img_size(x, self.img_size)
        take_indices, max_index = feature_take_indices(NUM_STAGES, indices)
        stages = self._stages()[:max_index + 1] if stop_early else self._stages()
        intermediates = []
        for i, (entry, blocks) in enumerate(stages):
            x = self._run_blocks(blocks, entry(x))
            if i in take_indices:
                out = self.norm(x) if norm and i == NUM_STAGES - 1 else x
                intermediates.append(tokens_to_image(out, self.grid_sizes[i]) if output_fmt == 'NCHW' else out)
        if intermediates_only:
            return intermediates
        return (self.norm(x) if len(stages) == NUM_STAGES else x), intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages (and merges) after the last wanted one, optionally the norm and head."""
        take_indices, max_index = feature_take_indices(NUM_STAGES, indices)
        for i in range(max_index + 1, NUM_STAGES):
            setattr(self, f'merge{i}', nn.Identity())
            setattr(self, f'stage{i + 1}', nn.ModuleList())
        if prune_norm or max_index < NUM_STAGES - 1:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices


def checkpoint_filter_fn(state_dict: Mapping[str, Tensor], model: CSWinTransformer) -> Dict[str, Tensor]:
    """An official CSwin / InLine-CSwin / FLatten-CSwin state dict (same key names) made ready for `model`.

    Unwraps 'model'/'state_dict', drops derived buffers, resizes FLatten positional encodings to the model's
    grids, and raises `CheckpointError` listing the keys when the checkpoint belongs to another model.
    """
    state_dict = drop_derived_buffers(checkpoint_state_dict(state_dict))
    state_dict = resize_attention_tables(state_dict, model, _official_to_module_name)
    check_state_dict(model, state_dict, 'checkpoint', free_shape_prefixes=('head.',))
    return state_dict


def _create_cswin(variant: str, pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    return build_model_with_cfg(
        CSWinTransformer, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls='getter', out_indices=(0, 1, 2, 3)),
        **kwargs)


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='stage1_conv_embed.0')

_SIZES = ('tiny', 'small', 'base', 'base_384')
_SPLIT_224, _SPLIT_384 = (1, 2, 7, 7), (1, 2, 12, 12)
_LA_SPLIT_224, _LA_SPLIT_384 = '56-28-14-7', '96-48-24-12'

# The original CSwin models; multimax, sima and additive share their architecture.
_ORIGINAL = {
    'tiny': dict(embed_dim=64, depth=(1, 2, 21, 1), num_heads=(2, 4, 8, 16), split_size=_SPLIT_224),
    'small': dict(embed_dim=64, depth=(2, 4, 32, 2), num_heads=(2, 4, 8, 16), split_size=_SPLIT_224),
    'base': dict(embed_dim=96, depth=(2, 4, 32, 2), num_heads=(4, 8, 16, 32), split_size=_SPLIT_224),
    'base_384': dict(img_size=384, embed_dim=96, depth=(2, 4, 32, 2), num_heads=(4, 8, 16, 32),
                     split_size=_SPLIT_384),
}
_INLINE = {
    'tiny': dict(embed_dim=64, depth=(2, 4, 18, 1), num_heads=(2, 4, 8, 16), split_size=_SPLIT_224,
                 la_split_size=_LA_SPLIT_224),
    'small': dict(embed_dim=64, depth=(3, 6, 29, 2), num_heads=(2, 4, 8, 16), split_size=_SPLIT_224,
                  la_split_size=_LA_SPLIT_224),
    'base': dict(embed_dim=96, depth=(3, 6, 29, 2), num_heads=(4, 8, 16, 32), split_size=_SPLIT_224,
                 la_split_size=_LA_SPLIT_224),
    'base_384': dict(img_size=384, embed_dim=96, depth=(3, 6, 29, 2), num_heads=(4, 8, 16, 32),
                     split_size=_SPLIT_384, la_split_size=_LA_SPLIT_384),
}
_FLATTEN = dict(_INLINE, small=dict(_INLINE['small'], depth=(2, 4, 32, 2)))

_CSWIN_META = dict(paper_ids='arXiv:2107.00652', origin_url='https://github.com/microsoft/CSWin-Transformer')
_META = {'inline': INLINE_META, 'flatten': FLATTEN_META, 'softmax': _CSWIN_META}
_CSWIN_URL = 'https://github.com/microsoft/CSWin-Transformer/releases/download/v0.1.0/{}.pth'
# Official release files; variants absent here have none.
_URLS = {
    'inline_cswin_tiny': tsinghua_url('49fa2ecc543647c4b970'),
    'inline_cswin_small': tsinghua_url('59f4e65f776f4052b93c'),
    'inline_cswin_base': tsinghua_url('91e17121df284ae38521'),
    'flatten_cswin_tiny': tsinghua_url('48ba765ba8b0451d9d5a'),
    'softmax_cswin_tiny': _CSWIN_URL.format('cswin_tiny_224'),
    'softmax_cswin_small': _CSWIN_URL.format('cswin_small_224'),
    'softmax_cswin_base': _CSWIN_URL.format('cswin_base_224'),
    'softmax_cswin_base_384': _CSWIN_URL.format('cswin_base_384'),
}


def _eval_cfg(flavour: str, size: str) -> Dict[str, Any]:
    """InLine / FLatten evaluate with a 256/224 resize then crop at every size; the original CSwin code's
    configuration uses crop_pct 0.9 at 224 and 1.0 at 384."""
    cfg = dict(input_size=(3, 384, 384)) if size == 'base_384' else {}
    if flavour not in ('inline', 'flatten'):
        cfg['crop_pct'] = 1.0 if size == 'base_384' else 0.9
    return cfg


default_cfgs = generate_default_cfgs({
    f'{flavour}_cswin_{size}': _cfg(_URLS.get(f'{flavour}_cswin_{size}', ''), **_META.get(flavour, {}),
                                    **_eval_cfg(flavour, size))
    for flavour in ('inline', 'flatten', 'softmax', 'multimax', 'sima', 'additive') for size in _SIZES
})


def _cswin(variant: str, pretrained: bool, **kwargs: Any) -> CSWinTransformer:
    """`{flavour}_cswin_{size}`: the official InLine / FLatten model, or the original CSwin's architecture with
    attention `flavour` in every block."""
    flavour, size = variant.split('_cswin_')
    if flavour == 'inline':
        model_args = dict(_INLINE[size], attn_type='IISS')
    elif flavour == 'flatten':
        model_args = dict(_FLATTEN[size], attn_type='LLSS', mixed_linear='flatten')
    else:
        model_args = dict(_ORIGINAL[size], attn_type=flavour)
    return _create_cswin(variant, pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def inline_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """InLine-CSwin-T (official configuration, pattern IISS)."""
    return _cswin('inline_cswin_tiny', pretrained, **kwargs)


@register_model
def inline_cswin_small(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """InLine-CSwin-S (official configuration, pattern IISS)."""
    return _cswin('inline_cswin_small', pretrained, **kwargs)


@register_model
def inline_cswin_base(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """InLine-CSwin-B (official configuration, pattern IISS)."""
    return _cswin('inline_cswin_base', pretrained, **kwargs)


@register_model
def inline_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """InLine-CSwin-B 384 (official configuration, pattern IISS)."""
    return _cswin('inline_cswin_base_384', pretrained, **kwargs)


@register_model
def flatten_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """FLatten-CSwin-T (official configuration, pattern LLSS)."""
    return _cswin('flatten_cswin_tiny', pretrained, **kwargs)


@register_model
def flatten_cswin_small(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """FLatten-CSwin-S (official configuration, pattern LLSS)."""
    return _cswin('flatten_cswin_small', pretrained, **kwargs)


@register_model
def flatten_cswin_base(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """FLatten-CSwin-B (official configuration, pattern LLSS)."""
    return _cswin('flatten_cswin_base', pretrained, **kwargs)


@register_model
def flatten_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """FLatten-CSwin-B 384 (official configuration, pattern LLSS)."""
    return _cswin('flatten_cswin_base_384', pretrained, **kwargs)


@register_model
def softmax_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-T, the original softmax model."""
    return _cswin('softmax_cswin_tiny', pretrained, **kwargs)


@register_model
def softmax_cswin_small(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-S, the original softmax model."""
    return _cswin('softmax_cswin_small', pretrained, **kwargs)


@register_model
def softmax_cswin_base(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B, the original softmax model."""
    return _cswin('softmax_cswin_base', pretrained, **kwargs)


@register_model
def softmax_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B 384, the original softmax model."""
    return _cswin('softmax_cswin_base_384', pretrained, **kwargs)


@register_model
def multimax_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-T with MultiMax attention in every block (in the original stripes)."""
    return _cswin('multimax_cswin_tiny', pretrained, **kwargs)


@register_model
def multimax_cswin_small(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-S with MultiMax attention in every block (in the original stripes)."""
    return _cswin('multimax_cswin_small', pretrained, **kwargs)


@register_model
def multimax_cswin_base(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B with MultiMax attention in every block (in the original stripes)."""
    return _cswin('multimax_cswin_base', pretrained, **kwargs)


@register_model
def multimax_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B 384 with MultiMax attention in every block (in the original stripes)."""
    return _cswin('multimax_cswin_base_384', pretrained, **kwargs)


@register_model
def sima_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-T with SimA attention in every block (one global branch per stage: it is linear)."""
    return _cswin('sima_cswin_tiny', pretrained, **kwargs)


@register_model
def sima_cswin_small(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-S with SimA attention in every block (one global branch per stage: it is linear)."""
    return _cswin('sima_cswin_small', pretrained, **kwargs)


@register_model
def sima_cswin_base(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B with SimA attention in every block (one global branch per stage: it is linear)."""
    return _cswin('sima_cswin_base', pretrained, **kwargs)


@register_model
def sima_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B 384 with SimA attention in every block (one global branch per stage: it is linear)."""
    return _cswin('sima_cswin_base_384', pretrained, **kwargs)


@register_model
def additive_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-T with additive (Fastformer) attention in every block (one global branch per stage: it is linear)."""
    return _cswin('additive_cswin_tiny', pretrained, **kwargs)


@register_model
def additive_cswin_small(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-S with additive (Fastformer) attention in every block (one global branch per stage: it is linear)."""
    return _cswin('additive_cswin_small', pretrained, **kwargs)


@register_model
def additive_cswin_base(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B with additive (Fastformer) attention in every block (one global branch per stage: it is linear)."""
    return _cswin('additive_cswin_base', pretrained, **kwargs)


@register_model
def additive_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> CSWinTransformer:
    """CSwin-B 384 with additive (Fastformer) attention in every block (one global branch per stage: it is linear)."""
    return _cswin('additive_cswin_base_384', pretrained, **kwargs)
