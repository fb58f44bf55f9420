"""DeiT: a plain vision transformer with a class token, every block's attention taken from the registry by name.

The models keep the original key names (`patch_embed.proj`, `cls_token`, `pos_embed`,
`blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `norm`, `head`), so DeiT checkpoints load strictly.
Each attention sees the class token as a prefix token and the patch grid as `size` = (H, W). Registered: every
attention of the registry at the DeiT sizes (`{attention}_deit_{tiny,small,base}`), except that the names of the
official models with their own widths and input sizes (`_OFFICIAL`) and of the MultiMax models (`_MULTIMAX`) are
theirs.

The official MultiMax models (`multimax_deit_{tiny,small,base}`, the DeiT body of the MultiMax code) have no class
token (`pos_embed` of the patches only, the mean of the normalised tokens pooled), `qkv` without bias, and the
MultiMax σ on the class logits too, with the model's own `ranges` and `ts`; the class-token DeiT with MultiMax
blocks is `create_model('softmax_deit_small', attn_type='multimax')`, and the paper's softmax baseline, the same body
without σ, `create_model('multimax_deit_small', attn_type='softmax', multimax_logits=False)`.

`init_values` adds LayerScale to every block (`blocks.{i}.gamma1`, `blocks.{i}.gamma2`, per-channel scales of the
attention and MLP branches). The SimA paper's DeiT-S → SimA (`sima_deit_small_ls`) is DeiT-small with SimA in
every block and LayerScale initialised to 1, the value of the SimA code's 12-block models; `sima_deit_small` is
the same without LayerScale.

`forward_features` returns the tokens (B, 1 + H*W, C), class token first, as timm's DeiT does. The model runs at
the input size it was built for; with `dynamic_img_size=True` at any size whose sides are multiples of
`patch_size`, `pos_embed` resampled bicubically on the fly (the class token's row kept), and `set_input_size` makes
such a size the model's own. A checkpoint of another size is adapted on loading by the same resampling.
"""
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from timm.layers import PatchEmbed, calculate_drop_path_rates, global_pool_nlc, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs

from .attention import build_attention, check_attn_kwargs, list_attentions, stage_attentions
from .attention.layout import Grid
from .attention.multimax import multimax_modulation
from .checkpoint import CheckpointError, filter_checkpoint, resample_grid_embedding, resize_grid_embedding
from .family import (
    INLINE_META, Block, ZooModel, check_arguments, create_variant, imagenet_cfg, init_weights, register_variants,
    split_drop_rates, tag_weights, tsinghua_url,
)

__all__ = ['DeiT', 'LayerScaleBlock', 'checkpoint_filter_fn']


class LayerScaleBlock(Block):
    """The pre-norm block with LayerScale: x + γ1·attn(norm1(x)), then x + γ2·mlp(norm2(x)), γ1 and γ2 learned
    per channel from `init_values`. Other arguments as `Block`'s."""

    def __init__(self, dim: int, attn: nn.Module, init_values: float, **kwargs: Any):
        super().__init__(dim, attn, **kwargs)
        self.gamma1 = nn.Parameter(torch.full((dim,), float(init_values)))
        self.gamma2 = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, N, C), the last H*W tokens forming the grid `size` = (H, W) -> (B, N, C)."""
        x = x + self.drop_path(self.gamma1 * self.attn(self.norm1(x), size))
        return x + self.drop_path(self.gamma2 * self.mlp(self.norm2(x)))


class DeiT(ZooModel):
    """Vision transformer with a learned absolute position embedding and (by default) a class token: DeiT and
    the papers' DeiT-style models.

    Args:
        img_size: input image size the model is built for (int or (H, W)); other sizes raise ValueError unless
            `dynamic_img_size`.
        patch_size: side of the square patches.
        in_chans: input image channels.
        num_classes: classifier outputs; 0 for none.
        global_pool: 'token' (class token), 'avg', 'max' or 'avgmax' (mean, maximum or their average over the
            patch tokens) or '' (no pooling); default 'token' with a class token, else 'avg'.
        fc_norm: the final norm after pooling (timm's `fc_norm` module) instead of on the tokens before it. None
            (the official DeiT's) is False at every `global_pool`, where timm's None is True for 'avg', 'max' and
            'avgmax'.
        class_token: a class token before the patch tokens (with its own `pos_embed` row).
        multimax_logits: the MultiMax σ on the class logits, with the model's own `ranges` and `ts` (4,) each;
            the logits are σ(head(pooled features)). σ belongs to the classifier: without one (`num_classes=0`)
            the model has no `ranges` and `ts`.
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: transformer width, blocks, heads, MLP ratio, qkv bias.
        attn_type: the attention of every block: a registered name, a one-element list of names, or a one-letter
            pattern ('I', 'L', 'S'; 'M' with a block count gives that many linear blocks, then softmax).
        attn_kwargs: method options of the attentions (`models.attention.list_attention_options()`).
        drop_rate: dropout after the position embedding, the attention projection and the MLP layers (the
            official DeiT's; none before the head).
        pos_drop_rate, proj_drop_rate: timm's names for the first and for the other two of these, each
            `drop_rate` unless given.
        attn_drop_rate: dropout on attention weights (score-forming attentions).
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
        dynamic_img_size: take any input size whose sides are multiples of `patch_size`.
        init_values: LayerScale in every block, its scales initialised to this value; None for none.
    """

    global_pools = ('token', 'avg', 'max', 'avgmax', '')
    norm_follows_last_stage = False

    def __init__(
            self,
            img_size: Union[int, Grid] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: Optional[str] = None,
            fc_norm: Optional[bool] = None,
            embed_dim: int = 192,
            depth: int = 12,
            num_heads: int = 3,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: Union[str, Sequence[str]] = 'softmax',
            attn_kwargs: Optional[Dict[str, Any]] = None,
            drop_rate: float = 0.,
            pos_drop_rate: Optional[float] = None,
            proj_drop_rate: Optional[float] = None,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            dynamic_img_size: bool = False,
            class_token: bool = True,
            multimax_logits: bool = False,
            init_values: Optional[float] = None,
    ):
        super().__init__()
        check_arguments(
            sizes=dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                       num_heads=num_heads),
            counts=dict(num_classes=num_classes, depth=depth),
            ratios=dict(mlp_ratio=mlp_ratio, init_values=init_values),
            rates=dict(drop_rate=drop_rate, pos_drop_rate=pos_drop_rate, proj_drop_rate=proj_drop_rate,
                       attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate),
            flags=dict(qkv_bias=qkv_bias, dynamic_img_size=dynamic_img_size, class_token=class_token,
                       multimax_logits=multimax_logits, fc_norm=fc_norm))
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_prefix_tokens = 1 if class_token else 0
        self._init_output_fmt('NLC')
        names = stage_attentions(attn_type, [depth])[0]
        attn_kwargs = check_attn_kwargs(names, attn_kwargs)
        self.causal = bool(attn_kwargs.get('causal'))
        # under causal attention the class token comes first and sees only itself: the patch tokens classify
        global_pool = ('token' if class_token and not self.causal else 'avg') if global_pool is None else global_pool
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.grad_checkpointing = False
        self.img_size: Grid = tuple(to_2tuple(img_size))
        self.img_divisor = patch_size
        self._init_input_size(dynamic_img_size)
        self._check_size(self.img_size, 'img_size')
        norm_layer = partial(nn.LayerNorm, eps=1e-6)

        self.patch_embed = PatchEmbed(self.img_size, patch_size, in_chans, embed_dim, strict_img_size=False)
        self.grid_size: Grid = tuple(self.patch_embed.grid_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + self.patch_embed.num_patches, embed_dim))
        self.multimax_logits = multimax_logits
        with_sigma = multimax_logits and num_classes > 0
        self.ranges = nn.Parameter(torch.zeros(4)) if with_sigma else None
        self.ts = nn.Parameter(torch.zeros(4)) if with_sigma else None
        pos_drop_rate, proj_drop_rate = split_drop_rates(drop_rate, pos_drop_rate, proj_drop_rate)
        self.pos_drop = nn.Dropout(pos_drop_rate)

        self.num_stages = depth
        rates = calculate_drop_path_rates(drop_path_rate, depth)
        block = Block if init_values is None else partial(LayerScaleBlock, init_values=init_values)
        self.blocks = nn.ModuleList([
            block(
                embed_dim,
                build_attention(name, embed_dim, num_heads, self.grid_size, qkv_bias, attn_kwargs=attn_kwargs,
                                attn_drop=attn_drop_rate, proj_drop=proj_drop_rate),
                mlp_ratio=mlp_ratio, drop=proj_drop_rate, drop_path=rate, norm_layer=norm_layer)
            for name, rate in zip(names, rates)])
        self.norm = nn.Identity() if fc_norm else norm_layer(embed_dim)
        self.fc_norm = norm_layer(embed_dim) if fc_norm else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [
            dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=patch_size) for i in range(depth)]

        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=.02)
        self.apply(init_weights)
        self._init_logit_sigma()

    def _check_pool(self, global_pool: str, num_classes: int) -> str:
        """As `ZooModel._check_pool`; under causal attention the class token comes first and sees only itself, so
        a classifier on it would give every image the same logits."""
        if global_pool == 'token' and num_classes and self.causal:
            raise ValueError(f"global_pool 'token' classifies from the class token, which under causal=True comes "
                             f"first and sees only itself; expected one of "
                             f"{', '.join(repr(p) for p in self.global_pools if p not in ('token', ''))}")
        return super()._check_pool(global_pool, num_classes)

    def _init_logit_sigma(self) -> None:
        if self.ranges is not None and self.ts is not None:
            trunc_normal_(self.ranges, std=.02)
            trunc_normal_(self.ts, std=.02)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {'pos_embed', 'cls_token'}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^cls_token|^pos_embed|^patch_embed',
                    blocks=[(r'^blocks\.(\d+)', None), (r'^norm|^ranges|^ts', (99999,))])

    def adapt_loaded_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """A checkpoint's `pos_embed` of another square grid, resized bicubically with its class-token row kept."""
        if name == 'pos_embed':
            try:
                return resize_grid_embedding(tensor, self.grid_size, self.num_prefix_tokens)
            except CheckpointError:
                pass  # not a square grid after the class token: the key check names it as mis-shaped
        return tensor

    def _position_embedding(self, grid: Grid) -> Tensor:
        """`pos_embed` on the patch `grid`: its own, or resampled bicubically."""
        if grid == self.grid_size:
            return self.pos_embed
        return resample_grid_embedding(self.pos_embed, self.grid_size, grid, self.num_prefix_tokens)

    def _set_grids(self, img_size: Grid) -> None:
        self.patch_embed.set_input_size(img_size=img_size)
        grid: Grid = tuple(self.patch_embed.grid_size)
        with torch.no_grad():
            resized = self._position_embedding(grid)
        self.pos_embed = nn.Parameter(resized, requires_grad=self.pos_embed.requires_grad)
        self.grid_size = grid
        for block in self.blocks:
            block.attn.set_grid(grid)

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new head as `ZooModel.reset_classifier`; with `multimax_logits` σ goes with the classifier (no
        parameter may go without a gradient under distributed training), a new one (official init) comes with a
        classifier after none, and a trained one stays, as it does not depend on the class count."""
        super().reset_classifier(num_classes, global_pool)
        if not self.multimax_logits:
            return
        if num_classes == 0:
            self.ranges = self.ts = None
        elif self.ranges is None or self.ts is None:
            ref = self.head.weight
            self.ranges, self.ts = (nn.Parameter(torch.zeros(4, device=ref.device, dtype=ref.dtype))
                                    for _ in range(2))
            self._init_logit_sigma()

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """The patch embedding with the class token and position embedding, then the first `num_stages` blocks
        (each a stage)."""
        image = self._input_grid(x)
        x = self.patch_embed(x)
        grid = (image[0] // self.img_divisor, image[1] // self.img_divisor)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self._position_embedding(grid))
        kept: Dict[int, Tuple[Tensor, Grid]] = {}
        for i, block in enumerate(self.blocks):
            if i < num_stages:
                if self.grad_checkpointing and not torch.jit.is_scripting():
                    x = checkpoint(block, x, grid, use_reentrant=False)
                else:
                    x = block(x, grid)
                if i in keep:
                    kept[i] = (x, grid)
        return x, grid, kept

    def _prune_stages(self, num_stages: int) -> None:
        self.blocks = self.blocks[:num_stages]

    def forward_intermediates(
            self,
            x: Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
            output_dict: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]], List[Tuple[Tensor, Tensor]], Dict[str, Any]]:
        """`ZooModel.forward_intermediates` with its arguments in the order of timm's `VisionTransformer`
        (`return_prefix_tokens` third), so that a call with positional arguments means what it means there."""
        return super().forward_intermediates(
            x, indices=indices, norm=norm, stop_early=stop_early, output_fmt=output_fmt,
            intermediates_only=intermediates_only, return_prefix_tokens=return_prefix_tokens, output_dict=output_dict)

    def _prune_head(self) -> None:
        """The classifier, and the head's `fc_norm` with it, as in timm."""
        super()._prune_head()
        self.fc_norm = nn.Identity()

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool the tokens of `forward_features` (class token, or mean, maximum or both of the patch tokens), with
        `fc_norm` norm the pooled features, then classify; with `multimax_logits` the logits pass through σ (in
        float32 at least: its squares overflow float16), returned in the dtype of the logits and σ's parameters
        together."""
        x = self.fc_norm(global_pool_nlc(x, self.global_pool, self.num_prefix_tokens))
        if pre_logits:
            return x
        x = self.head(x)
        if self.ranges is not None and self.ts is not None:
            # σ in float32 at least; the logits leave in the dtype of the logits and σ's parameters together, so a
            # bfloat16 model gives bfloat16 logits and float16 autocast float32 ones, which σ's squares may need
            out_dtype = torch.promote_types(x.dtype, self.ranges.dtype)
            work = torch.promote_types(out_dtype, torch.float32)
            x = multimax_modulation(x.to(work), self.ranges.to(work), self.ts.to(work)).to(out_dtype)
        return x


def _drop_unused_logit_sigma(model: DeiT) -> Callable[[Dict[str, Tensor]], Dict[str, Tensor]]:
    """A model without a classifier has no σ on the logits, so a classified checkpoint's `ranges` and `ts` go with
    its head."""
    def prepare(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        if not model.multimax_logits or model.ranges is not None:
            return state_dict
        return {k: v for k, v in state_dict.items() if k not in ('ranges', 'ts')}
    return prepare


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: DeiT, strict: bool = True) -> Dict[str, Tensor]:
    """Adapt a DeiT checkpoint (any attention) to `model`: unwrap, resize `pos_embed` to its grid, drop σ on the
    logits where the model has no classifier, check the keys."""
    return filter_checkpoint(state_dict, model, _drop_unused_logit_sigma(model), strict=strict)


def _create_deit(variant: str, pretrained: bool, model_args: Dict[str, Any], kwargs: Dict[str, Any]) -> DeiT:
    out_indices = kwargs.pop('out_indices', 3)
    return create_variant(DeiT, variant, pretrained, model_args, kwargs, pretrained_filter_fn=checkpoint_filter_fn,
                          feature_cfg=dict(out_indices=out_indices, feature_cls='getter'))


def _create_multimax_deit(variant: str, pretrained: bool, model_args: Dict[str, Any], kwargs: Dict[str, Any]) -> DeiT:
    """The MultiMax code hard-codes `qkv` without bias, taking the `qkv_bias=True` of DeiT's factory without
    effect; so do these entrypoints, so that the official constructor arguments build the official model."""
    kwargs.pop('qkv_bias', None)
    return _create_deit(variant, pretrained, model_args, kwargs)


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='patch_embed.proj')

_DEIT_META = dict(paper_ids='arXiv:2012.12877', origin_url='https://github.com/facebookresearch/deit',
                  license='apache-2.0')
_DEIT_URL = 'https://dl.fbaipublicfiles.com/deit/deit_{}_patch16_224-{}.pth'
_MULTIMAX_META = dict(paper_ids='arXiv:2406.01189', origin_url='https://github.com/ZhouYuxuanYX/MultiMax')

_SIMA_META = dict(paper_ids='arXiv:2206.08898', origin_url='https://github.com/UCDvision/sima', license='mit')

_COMMON = dict(patch_size=16, depth=12, mlp_ratio=4., qkv_bias=True)
_SIZES: Dict[str, Dict[str, Any]] = {
    'tiny': dict(embed_dim=192, num_heads=3, img_size=224),
    'small': dict(embed_dim=384, num_heads=6, img_size=224),
    'base': dict(embed_dim=768, num_heads=12, img_size=224),
}
# Official models with widths and input sizes of their own: (constructor arguments, description).
_OFFICIAL: Dict[str, Tuple[Dict[str, Any], str]] = {
    'inline_deit_tiny': (dict(_COMMON, embed_dim=192, num_heads=6, img_size=224, attn_type='I'),
                         'InLine-DeiT-T: 192 wide, 6 heads, 224.'),
    'inline_deit_small': (dict(_COMMON, embed_dim=320, num_heads=10, img_size=288, attn_type='I'),
                          'InLine-DeiT-S: 320 wide, 10 heads, 288.'),
    'inline_deit_base': (dict(_COMMON, embed_dim=384, num_heads=12, img_size=448, attn_type='I'),
                         'InLine-DeiT-B: 384 wide, 12 heads, 448.'),
}
_MULTIMAX: Dict[str, Tuple[Dict[str, Any], str]] = {
    f'multimax_deit_{size}': (
        dict(_COMMON, **args, qkv_bias=False, attn_type='multimax', class_token=False, multimax_logits=True),
        f'MultiMax-DeiT-{size} as the MultiMax code builds it: no class token, mean pooling after the final norm, '
        f'qkv without bias (a qkv_bias keyword has no effect, as there), σ in every block and on the logits.')
    for size, args in _SIZES.items()
}
# The SimA paper's DeiT-S -> SimA: the block its authors posted for it keeps LayerScale and drops LPI and the class
# attention of their XCiT-style models.
_SIMA_LS: Dict[str, Tuple[Dict[str, Any], str]] = {
    'sima_deit_small_ls': (dict(_COMMON, **_SIZES['small'], attn_type='sima', init_values=1.0),
                           'DeiT-S -> SimA of the SimA paper: DeiT-small with SimA in every block and LayerScale '
                           '(gamma1, gamma2) initialised to 1.'),
}
_VARIANTS: Dict[str, Tuple[Dict[str, Any], str]] = {
    **{f'{attn}_deit_{size}': (dict(_COMMON, **args, attn_type=attn),
                               f'DeiT-{size} ({args["embed_dim"]} wide, {args["num_heads"]} heads) with {attn} '
                               f'attention in every block.')
       for attn in list_attentions() for size, args in _SIZES.items()},
    **_OFFICIAL,
    **_MULTIMAX,
    **_SIMA_LS,
}

default_cfgs = generate_default_cfgs(tag_weights({
    **{name: _cfg() for name in _VARIANTS},
    'softmax_deit_tiny': _cfg(_DEIT_URL.format('tiny', 'a1311bcf'), **_DEIT_META),
    'softmax_deit_small': _cfg(_DEIT_URL.format('small', 'cd65a155'), **_DEIT_META),
    'softmax_deit_base': _cfg(_DEIT_URL.format('base', 'b5f2ef4d'), **_DEIT_META),
    **{f'multimax_deit_{size}': _cfg(**_MULTIMAX_META) for size in _SIZES},
    'sima_deit_small_ls': _cfg(**_SIMA_META),
    'inline_deit_tiny': _cfg(tsinghua_url('1d6b8191ad6d4114b291'), **INLINE_META),
    'inline_deit_small': _cfg(tsinghua_url('2f3898b07e9247f3beb3'), input_size=(3, 288, 288), **INLINE_META),
    'inline_deit_base': _cfg(tsinghua_url('10bdd726d4b0435eb34e'), input_size=(3, 448, 448), **INLINE_META),
}, {'softmax_deit_': 'fb_in1k'}))

register_variants(__name__, {name: v for name, v in _VARIANTS.items() if name not in _MULTIMAX}, _create_deit)
register_variants(__name__, _MULTIMAX, _create_multimax_deit)
