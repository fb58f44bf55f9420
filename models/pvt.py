"""PVT v1: a four-stage pyramid of patch embeddings, learned position embeddings and pre-norm blocks.

Every block takes its attention from the registry in the spatial-reduction grouping (separate `q` / `kv`
projections). Score-forming attentions reduce their keys and values spatially by `sr_ratios` (keys `attn.sr`,
`attn.norm`); the others use `la_sr_ratios` (1 in every stage by default, i.e. global attention over the stage),
as the official linear-attention models do.

The stages are `stages.{i}` modules (patch embedding, position embedding, blocks), which TorchScript loops over;
the state dict keeps the original key names (`patch_embed{i}.proj/norm`, `pos_embed{i}`,
`block{i}.{j}.{norm1,attn.*,norm2,mlp.*}`, `head`) through `OfficialKeys`. Two heads exist:
- the original PVT (`class_token=True`): a class token joins the last stage (its `pos_embed4` has one more row),
  a final LayerNorm `norm`, class-token pooling;
- the papers' linear-attention PVTs (`class_token=False`): no class token, no final norm, the mean of the last
  stage's tokens. One official model holds a final LayerNorm `norm` that its forward never uses: a parameter no
  forward uses is no parameter here, so its checkpoints' `norm.*` is dropped on loading and the parameter
  count is the official code's less those 2 × 512.

`forward_features` returns the last stage's normed map as (B, C, H, W) (`output_fmt` 'NCHW'), as timm's PVT v2
does, for the papers' PVTs; the original PVT's classifier reads the class token, so its `forward_features` keeps the
tokens (B, 1 + H*W, C), class token first, as timm's PiT and CoaT do.

Another input size: with `dynamic_img_size=True` the model takes images whose sides are multiples of the total
stride (`patch_size` · 8), so every stage and every spatial reduction tiles its map exactly. Like the official
model, each stage's position embedding is then resized at run time (bilinear, the class token's row kept), and
FLatten's positional encodings bicubically; `set_input_size` makes such a size the model's own.

Registered: every attention of the registry at the PVT sizes (`{attention}_pvt_{tiny,small,medium,large}`, the
original's heads and head), except that the names of the official models (`_OFFICIAL`) are theirs.
"""
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

from timm.layers import PatchEmbed, calculate_drop_path_rates, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs

from .attention import build_attention, check_attn_kwargs, forms_score_matrix, list_attentions, stage_attentions
from .attention.layout import Grid, tokens_to_image
from .checkpoint import CheckpointError, filter_checkpoint, resample_grid_embedding, resize_grid_embedding
from .family import (
    FLATTEN_META, INLINE_META, Block, BlockStack, NumberedStageKeys, OfficialKeys, ZooModel, check_arguments,
    create_variant, imagenet_cfg, init_weights, refuse_causal, register_variants, split_drop_rates, tag_weights,
    tsinghua_url,
)

__all__ = ['PyramidVisionTransformer', 'PvtStage', 'check_stage_lists', 'checkpoint_filter_fn', 'key_reduction',
           'smallest_side']

NUM_STAGES = 4
# The constructor arguments of both PVTs that take a list with a value per stage.
PER_STAGE_ARGUMENTS = ('embed_dims', 'num_heads', 'mlp_ratios', 'depths', 'sr_ratios')


def check_stage_lists(la_sr_ratios: Union[str, Sequence[int]], **per_stage: Sequence[Any]) -> List[int]:
    """A ValueError unless every per-stage list (and `la_sr_ratios`) has one entry per stage and `la_sr_ratios`
    holds non-negative integers ('1111' or ints); returns `la_sr_ratios` as ints."""
    for what, values in {**per_stage, 'la_sr_ratios': la_sr_ratios}.items():
        if len(values) != NUM_STAGES:
            raise ValueError(f"{what} {values!r} must have {NUM_STAGES} entries, one per stage")
    if not all(str(r).isdigit() for r in la_sr_ratios):
        raise ValueError(f"la_sr_ratios {la_sr_ratios!r} must be {NUM_STAGES} non-negative integers, e.g. '1111'")
    return [int(r) for r in la_sr_ratios]


def key_reduction(name: str, sr_ratio: int, la_sr_ratio: int) -> int:
    """The spatial reduction of the keys of attention `name` in a stage: `sr_ratio` for an attention that forms
    scores, `la_sr_ratio` for one that forms none."""
    return sr_ratio if forms_score_matrix(name) else la_sr_ratio


def smallest_side(strides: Sequence[int], names: Sequence[Sequence[str]], sr_ratios: Sequence[int],
                  la_sr_ratios: Sequence[int]) -> int:
    """The smallest image side whose stage grids (ceil(side / stride), stage after stage) hold the key reduction of
    each stage's attentions `names` (`key_reduction`), a strided convolution that needs a whole window: a grid of at
    least n after a stride s needs an input of s * (n - 1) + 1."""
    need = 1
    for i in reversed(range(len(strides))):
        reduction = max((key_reduction(name, sr_ratios[i], la_sr_ratios[i]) for name in names[i]), default=1)
        need = strides[i] * (max(need, reduction) - 1) + 1
    return need


class PvtStage(nn.Module):
    """One stage's modules: patch embedding, position embedding (1, prefix + h*w, C) over the stage's `grid_size`
    (with the class token's row in the original PVT's last stage), its dropout and the blocks; the model runs
    them, as the class token is the model's."""

    def __init__(self, patch_embed: nn.Module, grid_size: Grid, num_prefix_tokens: int, dim: int, drop_rate: float,
                 blocks: List[nn.Module]):
        super().__init__()
        self.grid_size = grid_size
        self.num_prefix_tokens = num_prefix_tokens
        self.patch_embed = patch_embed
        self.pos_embed = nn.Parameter(torch.zeros(1, num_prefix_tokens + grid_size[0] * grid_size[1], dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = BlockStack(*blocks)

    def position_embedding(self, grid: Grid) -> Tensor:
        """`pos_embed` on `grid`: its own, or resized bilinearly as the official model does."""
        if grid == self.grid_size:
            return self.pos_embed
        return resample_grid_embedding(self.pos_embed, self.grid_size, grid, self.num_prefix_tokens, 'bilinear')

    def set_grid(self, grid: Grid) -> None:
        """Make `grid` the stage's own: `pos_embed` resampled, the attentions' grid-sized tables too."""
        with torch.no_grad():
            resized = self.position_embedding(grid)
        self.pos_embed = nn.Parameter(resized, requires_grad=self.pos_embed.requires_grad)
        self.grid_size = grid
        for block in self.blocks:
            block.attn.set_grid(grid)

    def adapt_loaded_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """A checkpoint's `pos_embed` of another square grid, resized bilinearly as the model resizes it on the fly
        (the class token's row kept), so that loading at a size equals running at it."""
        if name == 'pos_embed':
            try:
                return resize_grid_embedding(tensor, self.grid_size, self.num_prefix_tokens, 'bilinear')
            except CheckpointError:
                pass  # not a square grid with this stage's prefix: the key check names it as mis-shaped
        return tensor


# `stages.{i}.blocks` is the official `block{i+1}`, and so on for every part of a stage
_STAGE_KEYS = NumberedStageKeys(
    {'patch_embed': 'patch_embed', 'pos_embed': 'pos_embed', 'pos_drop': 'pos_drop', 'blocks': 'block'})


def _official_rank(key: str) -> Tuple[int, int]:
    """The official order: the four position embeddings, the class token, then the modules as registered."""
    if key.startswith('pos_embed'):
        return 0, int(key[len('pos_embed'):])
    return (1, 0) if key == 'cls_token' else (2, 0)


class PyramidVisionTransformer(ZooModel):
    """PVT v1 with swappable attention.

    Args:
        img_size: input size the model is built for (int or (H, W)); sides must be multiples of `patch_size` · 8.
            The model takes only this size unless `dynamic_img_size`.
        patch_size: patch side of the first stage; later stages merge 2×2 tokens.
        in_chans: input image channels.
        num_classes: classifier outputs; 0 for none.
        embed_dims, num_heads, mlp_ratios, depths: per stage width, heads, MLP ratio and number of blocks.
        qkv_bias: bias of the `q` and `kv` projections.
        sr_ratios: spatial reduction of keys and values per stage for score-forming attentions.
        la_sr_ratios: the same for attentions that form no score matrix, a string of digits ('1111') or a
            sequence of ints.
        attn_type: a registered name for every block, a list of names per stage, or an official pattern ('IIIS').
        attn_kwargs: method options of the attentions (`models.attention.list_attention_options()`).
        class_token: the original PVT head (class token in the last stage, final norm, class-token pooling);
            False for the papers' linear-attention PVTs (mean of the last stage's tokens, no final norm).
        global_pool: 'token', 'avg', 'max' or 'avgmax' (mean, maximum or their average over the last stage's
            grid tokens) or ''; default 'token' with a class token, else 'avg'.
        drop_rate: dropout after the position embeddings, the attention projections and the MLP layers.
        pos_drop_rate, proj_drop_rate: timm's names for the first and for the other two of these, each
            `drop_rate` unless given.
        attn_drop_rate: dropout on attention weights (score-forming attentions).
        drop_path_rate: stochastic depth, rising linearly over all blocks to this rate.
        dynamic_img_size: take any input size whose sides are multiples of `patch_size` · 8.
    """

    global_pools = ('token', 'avg', 'max', 'avgmax', '')

    def __init__(
            self,
            img_size: Union[int, Grid] = 224,
            patch_size: int = 4,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dims: Sequence[int] = (64, 128, 320, 512),
            num_heads: Sequence[int] = (1, 2, 5, 8),
            mlp_ratios: Sequence[float] = (8, 8, 4, 4),
            qkv_bias: bool = True,
            depths: Sequence[int] = (2, 2, 2, 2),
            sr_ratios: Sequence[int] = (8, 4, 2, 1),
            la_sr_ratios: Union[str, Sequence[int]] = '1111',
            attn_type: Union[str, Sequence[str]] = 'softmax',
            class_token: bool = True,
            global_pool: Optional[str] = None,
            attn_kwargs: Optional[Dict[str, Any]] = None,
            drop_rate: float = 0.,
            pos_drop_rate: Optional[float] = None,
            proj_drop_rate: Optional[float] = None,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            dynamic_img_size: bool = False,
    ):
        super().__init__()
        check_arguments(
            sizes=dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dims=embed_dims,
                       num_heads=num_heads, sr_ratios=sr_ratios),
            counts=dict(num_classes=num_classes, depths=depths), ratios=dict(mlp_ratios=mlp_ratios),
            rates=dict(drop_rate=drop_rate, pos_drop_rate=pos_drop_rate, proj_drop_rate=proj_drop_rate,
                       attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate),
            flags=dict(qkv_bias=qkv_bias, class_token=class_token, dynamic_img_size=dynamic_img_size),
            per_stage=PER_STAGE_ARGUMENTS)
        la_sr_ratios = check_stage_lists(embed_dims=embed_dims, num_heads=num_heads, mlp_ratios=mlp_ratios,
                                         depths=depths, sr_ratios=sr_ratios, la_sr_ratios=la_sr_ratios)
        global_pool = ('token' if class_token else 'avg') if global_pool is None else global_pool
        names = stage_attentions(attn_type, depths)
        self.num_stages = NUM_STAGES
        self.img_divisor = patch_size * 2 ** (NUM_STAGES - 1)
        least = smallest_side((patch_size, 2, 2, 2), names, sr_ratios, la_sr_ratios)
        self.img_min_side = -(-least // self.img_divisor) * self.img_divisor  # the sides are multiples of it
        self._init_input_size(dynamic_img_size)
        self.img_size: Grid = tuple(to_2tuple(img_size))
        self._check_size(self.img_size, 'img_size')
        self._init_output_fmt('NLC' if class_token else 'NCHW')
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.num_prefix_tokens = 1 if class_token else 0
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.grad_checkpointing = False

        self.grid_sizes = self._stage_grids(self.img_size)
        attn_kwargs = check_attn_kwargs([name for stage in names for name in stage], attn_kwargs)
        refuse_causal(attn_kwargs, "PVT merges patches of the grid between its stages")
        pos_drop_rate, proj_drop_rate = split_drop_rates(drop_rate, pos_drop_rate, proj_drop_rate)
        rates = iter(calculate_drop_path_rates(drop_path_rate, sum(depths)))
        self.stages = nn.ModuleList()
        for i, grid in enumerate(self.grid_sizes):
            dim = embed_dims[i]
            prefix = self.num_prefix_tokens if i == NUM_STAGES - 1 else 0
            patch_embed = PatchEmbed(None, patch_size if i == 0 else 2, in_chans if i == 0 else embed_dims[i - 1], dim,
                                     norm_layer=nn.LayerNorm, strict_img_size=False)
            self.stages.append(PvtStage(patch_embed, grid, prefix, dim, pos_drop_rate, [
                Block(
                    dim,
                    build_attention(
                        name, dim, num_heads[i], grid, qkv_bias, grouping='reduction', attn_kwargs=attn_kwargs,
                        sr_ratio=key_reduction(name, sr_ratios[i], la_sr_ratios[i]),
                        attn_drop=attn_drop_rate, proj_drop=proj_drop_rate),
                    mlp_ratio=mlp_ratios[i], drop=proj_drop_rate, drop_path=next(rates),
                    norm_layer=partial(nn.LayerNorm, eps=1e-6))
                for name in names[i]]))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims[-1])) if class_token else None
        self.norm = nn.LayerNorm(embed_dims[-1], eps=1e-6) if class_token else nn.Identity()
        self.head = nn.Linear(embed_dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(module=f'stages.{i}', num_chs=embed_dims[i], reduction=patch_size * 2 ** i)
                             for i in range(NUM_STAGES)]
        OfficialKeys(_STAGE_KEYS.to_official, _STAGE_KEYS.to_module, _official_rank).register(self)
        if not class_token:
            self.register_load_state_dict_pre_hook(_skip_unused_norm)

        for stage in self.stages:
            trunc_normal_(stage.pos_embed, std=.02)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # The official model decays the position embeddings.
        return {'cls_token'}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        stem = r'^stages\.0\.(?:patch_embed|pos_embed)'
        if coarse:
            return dict(stem=stem, blocks=[(r'^stages\.(\d+)', None), (r'^cls_token|^norm', (99999,))])
        return dict(stem=stem, blocks=[(r'^stages\.(\d+)\.blocks\.(\d+)', None),
                                       (r'^stages\.(\d+)\.(?:patch_embed|pos_embed)', (0,)),
                                       (r'^cls_token|^norm', (99999,))])

    def _stage_grids(self, img_size: Grid) -> List[Grid]:
        """The token grid of every stage for images of `img_size`: the patch grid, halved by every stage."""
        patch = self.img_divisor // 2 ** (NUM_STAGES - 1)
        return [(img_size[0] // (patch * 2 ** i), img_size[1] // (patch * 2 ** i)) for i in range(NUM_STAGES)]

    def _set_grids(self, img_size: Grid) -> None:
        self.grid_sizes = self._stage_grids(img_size)
        for stage, grid in zip(self.stages, self.grid_sizes):
            stage.set_grid(grid)

    def _stage_prefix_tokens(self, i: int) -> int:
        return self.stages[i].num_prefix_tokens

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """Stage by stage: (B, [1 +] h*w, C_i) tokens, the class token joining the original PVT's last stage."""
        grid = self._input_grid(x)
        kept: Dict[int, Tuple[Tensor, Grid]] = {}
        for i, stage in enumerate(self.stages):
            if i < num_stages:
                if i:
                    x = tokens_to_image(x, grid)
                grid = (grid[0] // stage.patch_embed.patch_size[0], grid[1] // stage.patch_embed.patch_size[1])
                x = stage.patch_embed(x)
                if i == self.num_stages - 1 and self.cls_token is not None:
                    x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
                x = stage.pos_drop(x + stage.position_embedding(grid))
                x = stage.blocks(x, grid, self.grad_checkpointing)
                if i in keep:
                    kept[i] = (x, grid)
        return x, grid, kept

    def _prune_stages(self, num_stages: int) -> None:
        """Dropping the last stage drops the class token and the final norm with it."""
        self.stages = self.stages[:num_stages]
        self.cls_token = None
        self.num_prefix_tokens = 0
        self._init_output_fmt('NCHW')
        self.global_pool = 'avg' if self.global_pool == 'token' else self.global_pool


def _skip_unused_norm(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook of a model without a final norm: an official file's unused `norm.*` (one official model saves
    it) is skipped, so that `load_state_dict` of that file works as in the official code."""
    for key in [k for k in state_dict if k.startswith(f'{prefix}norm.')]:
        del state_dict[key]


def _drop_unused_norm(model: PyramidVisionTransformer) -> Any:
    """Without a final norm the model has no use for a checkpoint's `norm.*`, which one official model saves."""
    def prepare(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        if 'norm.weight' in model.state_dict():
            return state_dict
        state_dict = dict(state_dict)
        _skip_unused_norm(model, state_dict, '')
        return state_dict
    return prepare


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: PyramidVisionTransformer,
                         strict: bool = True) -> Dict[str, Tensor]:
    """Adapt a PVT checkpoint (any attention) to `model`: unwrap, drop derived buffers and an unused final
    `norm.*` when the model has no final norm, resize grid-sized tensors to the model's grids, check the keys."""
    return filter_checkpoint(state_dict, model, _drop_unused_norm(model), strict=strict)


def _create_pvt(variant: str, pretrained: bool, model_args: Dict[str, Any],
                kwargs: Dict[str, Any]) -> PyramidVisionTransformer:
    out_indices = kwargs.pop('out_indices', (0, 1, 2, 3))
    return create_variant(PyramidVisionTransformer, variant, pretrained, model_args, kwargs,
                          pretrained_filter_fn=checkpoint_filter_fn,
                          feature_cfg=dict(out_indices=out_indices, feature_cls='getter'))


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='patch_embed1.proj')

_SIZES = ('tiny', 'small', 'medium', 'large')
_DEPTHS = {'tiny': (2, 2, 2, 2), 'small': (3, 4, 6, 3), 'medium': (3, 4, 18, 3), 'large': (3, 8, 27, 3)}
_COMMON = dict(patch_size=4, embed_dims=(64, 128, 320, 512), mlp_ratios=(8, 8, 4, 4), qkv_bias=True,
               sr_ratios=(8, 4, 2, 1), la_sr_ratios='1111')
_ORIGINAL = dict(_COMMON, num_heads=(1, 2, 5, 8), class_token=True)
# The official models of the papers: attention pattern, heads, mean pooling without final norm.
_OFFICIAL_ARGS = {
    'inline_pvt': dict(_COMMON, attn_type='IIII', num_heads=(2, 4, 10, 16), class_token=False),
    'flatten_pvt': dict(_COMMON, attn_type='LLLL', num_heads=(1, 2, 5, 8), class_token=False),
}
_VARIANTS = {
    **{f'{attn}_pvt_{size}': (dict(_ORIGINAL, depths=_DEPTHS[size], attn_type=attn),
                              f'PVT-{size} (original heads 1-2-5-8, class token) with {attn} attention in every '
                              f'block.')
       for attn in list_attentions() for size in _SIZES},
    **{f'{prefix}_{size}': (dict(args, depths=_DEPTHS[size]),
                            f'The official {prefix} model at size {size} (pattern {args["attn_type"]}, mean pooling).')
       for prefix, args in _OFFICIAL_ARGS.items() for size in _SIZES},
}

_PVT_META = dict(paper_ids='arXiv:2102.12122', origin_url='https://github.com/whai362/PVT', license='apache-2.0')
_INLINE_FILES = {'tiny': '90ac52b1555b401eb5e6', 'small': '1ab953b2479d433080a3', 'medium': 'a72aec31e6084bc0a280',
                 'large': 'efd91318ba964f01b288'}

# The papers' PVTs pool the last stage's 7x7 map; the original's class token leaves no map to pool.
_POOL = {name: dict(pool_size=(7, 7)) if not args['class_token'] else {} for name, (args, _) in _VARIANTS.items()}

default_cfgs = generate_default_cfgs(tag_weights({
    **{name: _cfg(**_POOL[name]) for name in _VARIANTS},
    **{f'softmax_pvt_{size}': _cfg(f'https://github.com/whai362/PVT/releases/download/v2/pvt_{size}.pth',
                                   **_PVT_META)
       for size in _SIZES},
    **{f'inline_pvt_{size}': _cfg(tsinghua_url(_INLINE_FILES[size]), pool_size=(7, 7), **INLINE_META)
       for size in _SIZES},
    'flatten_pvt_tiny': _cfg(tsinghua_url('3ab1d773f19d45648690'), pool_size=(7, 7), **FLATTEN_META),
    **{f'flatten_pvt_{size}': _cfg(pool_size=(7, 7), **FLATTEN_META) for size in _SIZES[1:]},
}))

register_variants(__name__, _VARIANTS, _create_pvt)
