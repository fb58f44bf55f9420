"""DeiT: a plain vision transformer with a class token, every block's attention taken from the registry by name.

The softmax models are DeiT-Ti/S/B with the original key names (`patch_embed.proj`, `cls_token`, `pos_embed`,
`blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `norm`, `head`), so DeiT checkpoints load strictly.
InLine-DeiT (`inline_deit_*`) is the official InLine model: InLine attention in every block, its own widths and
input sizes. Each attention sees the class token as a prefix token and the patch grid as `size` = (H, W).

The model runs only at the input size it was built for (the patch grid is part of `pos_embed`); a checkpoint of
another size is adapted on loading by resizing `pos_embed` bicubically, the class token's row kept.
"""
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

from timm.layers import PatchEmbed, calculate_drop_path_rates, global_pool_nlc, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from .checkpoint import (
    CheckpointError, check_state_dict, checkpoint_state_dict, drop_derived_buffers, resize_grid_embedding,
)
from ._common import (
    INLINE_META, Block, check_global_pool, check_img_size, check_output_fmt, imagenet_cfg, init_weights,
    new_classifier, run_blocks, tsinghua_url,
)
from .attention import build_attention, stage_attentions
from .attention.base import Grid, tokens_to_image

__all__ = ['DeiT', 'checkpoint_filter_fn']

GLOBAL_POOLS = ('token', 'avg', '')


class DeiT(nn.Module):
    """Vision transformer with a class token and learned absolute position embedding (DeiT, InLine-DeiT).

    Args:
        img_size: input image size the model is built for (int or (H, W)); other sizes raise ValueError.
        patch_size: side of the square patches.
        in_chans: input image channels.
        num_classes: classifier outputs; 0 for none.
        global_pool: 'token' (class token), 'avg' (mean of the patch tokens) or '' (no pooling).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: transformer width, blocks, heads, MLP ratio, qkv bias.
        attn_type: the attention of every block: a registered name, a one-element list of names, or a one-letter
            pattern ('I', 'L', 'S'; 'M' with a block count gives that many InLine blocks, then softmax).
        drop_rate: dropout after the position embedding, the attention projection and the MLP layers.
        attn_drop_rate: dropout on attention weights (score-forming attentions).
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
    """

    def __init__(
            self,
            img_size: Union[int, Grid] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'token',
            embed_dim: int = 192,
            depth: int = 12,
            num_heads: int = 3,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: Union[str, Sequence[str]] = 'softmax',
            drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
    ):
        super().__init__()
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool, GLOBAL_POOLS)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False
        self.img_size: Grid = to_2tuple(img_size)
        if self.img_size[0] % patch_size or self.img_size[1] % patch_size:
            raise ValueError(f"img_size {self.img_size} must be a multiple of patch_size {patch_size}")
        norm_layer = partial(nn.LayerNorm, eps=1e-6)

        self.patch_embed = PatchEmbed(self.img_size, patch_size, in_chans, embed_dim, strict_img_size=False)
        self.grid_size: Grid = tuple(self.patch_embed.grid_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.patch_embed.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)

        names = stage_attentions(attn_type, [depth])[0]
        rates = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList([
            Block(
                embed_dim,
                build_attention(name, embed_dim, num_heads, self.grid_size, qkv_bias,
                                attn_drop=attn_drop_rate, proj_drop=drop_rate),
                mlp_ratio=mlp_ratio, drop=drop_rate, drop_path=rate, norm_layer=norm_layer)
            for name, rate in zip(names, rates)])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [
            dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=patch_size) for i in range(depth)]

        trunc_normal_(self.pos_embed, std=.02)
        trunc_normal_(self.cls_token, std=.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {'pos_embed', 'cls_token'}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^cls_token|^pos_embed|^patch_embed',
                    blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new `num_classes`-way head (Identity for 0) on the model's device and dtype; optionally a new pooling."""
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool, GLOBAL_POOLS)
        self.num_classes = num_classes
        self.head = new_classifier(self, self.embed_dim, num_classes)

    def _embed(self, x: Tensor) -> Tensor:
        check_img_size(x, self.img_size)
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def _run_blocks(self, blocks: Sequence[Block], x: Tensor) -> Tensor:
        return run_blocks(blocks, x, self.grid_size, grad_checkpointing=self.grad_checkpointing)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) images -> (B, 1 + H*W/patch², C) normalised tokens, class token first."""
        return self.norm(self._run_blocks(self.blocks, self._embed(x)))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool the tokens of `forward_features` (class token or mean of the patch tokens), then classify."""
        x = global_pool_nlc(x, self.global_pool, self.num_prefix_tokens)
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
        """Outputs of the blocks in `indices` (last n for an int, all for None) without the class token.

        Returns the intermediates ((B, C, H, W) for 'NCHW', (B, H*W, C) for 'NLC'), after the final norm when
        `norm`, and unless `intermediates_only` the final features of `forward_features` first.
        """
        check_output_fmt(output_fmt)
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        x = self._embed(x)
        intermediates = []
        for i, block in enumerate(blocks):
            x = self._run_blocks([block], x)
            if i in take_indices:
                y = (self.norm(x) if norm else x)[:, self.num_prefix_tokens:]
                intermediates.append(tokens_to_image(y, self.grid_size) if output_fmt == 'NCHW' else y)
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the blocks after the last of `indices` (and the final norm / head); returns the kept indices."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: DeiT) -> Dict[str, Tensor]:
    """Adapt a DeiT / InLine-DeiT checkpoint to `model`: unwrap, resize `pos_embed` to its grid, check the keys."""
    state_dict = drop_derived_buffers(checkpoint_state_dict(state_dict))
    if 'pos_embed' in state_dict:
        try:
            state_dict['pos_embed'] = resize_grid_embedding(state_dict['pos_embed'], model.grid_size, 1)
        except CheckpointError:
            pass  # not a square grid after one class token: the key check below names it as mis-shaped
    check_state_dict(model, state_dict, 'checkpoint', free_shape_prefixes=('head.',))
    return state_dict


def _create_deit(variant: str, pretrained: bool = False, **kwargs: Any) -> DeiT:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        DeiT, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs)


_cfg = partial(imagenet_cfg, fixed_input_size=True, first_conv='patch_embed.proj')


_DEIT_META = dict(paper_ids='arXiv:2012.12877', origin_url='https://github.com/facebookresearch/deit',
                  license='apache-2.0')
_DEIT_URL = 'https://dl.fbaipublicfiles.com/deit/deit_{}_patch16_224-{}.pth'

# (embed_dim, num_heads, img_size) of each size; InLine-DeiT has its own widths and input sizes.
_DEIT_SIZES = {'tiny': (192, 3, 224), 'small': (384, 6, 224), 'base': (768, 12, 224)}
_INLINE_SIZES = {'tiny': (192, 6, 224), 'small': (320, 10, 288), 'base': (384, 12, 448)}

default_cfgs = generate_default_cfgs({
    'softmax_deit_tiny': _cfg(_DEIT_URL.format('tiny', 'a1311bcf'), **_DEIT_META),
    'softmax_deit_small': _cfg(_DEIT_URL.format('small', 'cd65a155'), **_DEIT_META),
    'softmax_deit_base': _cfg(_DEIT_URL.format('base', 'b5f2ef4d'), **_DEIT_META),
    'inline_deit_tiny': _cfg(tsinghua_url('1d6b8191ad6d4114b291'), **INLINE_META),
    'inline_deit_small': _cfg(tsinghua_url('2f3898b07e9247f3beb3'), input_size=(3, 288, 288), **INLINE_META),
    'inline_deit_base': _cfg(tsinghua_url('10bdd726d4b0435eb34e'), input_size=(3, 448, 448), **INLINE_META),
    **{f'{attn}_deit_{size}': _cfg() for attn in ('multimax', 'sima', 'additive') for size in _DEIT_SIZES},
})


def _deit(variant: str, pretrained: bool, **kwargs: Any) -> DeiT:
    """`{flavour}_deit_{size}`: the size's widths (InLine-DeiT's own for 'inline') with attention `flavour`."""
    flavour, size = variant.split('_deit_')
    embed_dim, num_heads, img_size = (_INLINE_SIZES if flavour == 'inline' else _DEIT_SIZES)[size]
    model_args = dict(img_size=img_size, patch_size=16, embed_dim=embed_dim, depth=12, num_heads=num_heads,
                      mlp_ratio=4., qkv_bias=True, attn_type=flavour)
    return _create_deit(variant, pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def softmax_deit_tiny(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-Ti: 192 wide, 3 heads, softmax attention, 224."""
    return _deit('softmax_deit_tiny', pretrained, **kwargs)


@register_model
def softmax_deit_small(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-S: 384 wide, 6 heads, softmax attention, 224."""
    return _deit('softmax_deit_small', pretrained, **kwargs)


@register_model
def softmax_deit_base(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-B: 768 wide, 12 heads, softmax attention, 224."""
    return _deit('softmax_deit_base', pretrained, **kwargs)


@register_model
def inline_deit_tiny(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """InLine-DeiT-T: 192 wide, 6 heads, InLine attention in every block, 224."""
    return _deit('inline_deit_tiny', pretrained, **kwargs)


@register_model
def inline_deit_small(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """InLine-DeiT-S: 320 wide, 10 heads, InLine attention in every block, 288."""
    return _deit('inline_deit_small', pretrained, **kwargs)


@register_model
def inline_deit_base(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """InLine-DeiT-B: 384 wide, 12 heads, InLine attention in every block, 448."""
    return _deit('inline_deit_base', pretrained, **kwargs)


@register_model
def multimax_deit_tiny(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-Ti with MultiMax attention in every block."""
    return _deit('multimax_deit_tiny', pretrained, **kwargs)


@register_model
def multimax_deit_small(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-S with MultiMax attention in every block."""
    return _deit('multimax_deit_small', pretrained, **kwargs)


@register_model
def multimax_deit_base(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-B with MultiMax attention in every block."""
    return _deit('multimax_deit_base', pretrained, **kwargs)


@register_model
def sima_deit_tiny(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-Ti with SimA attention in every block."""
    return _deit('sima_deit_tiny', pretrained, **kwargs)


@register_model
def sima_deit_small(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-S with SimA attention in every block."""
    return _deit('sima_deit_small', pretrained, **kwargs)


@register_model
def sima_deit_base(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-B with SimA attention in every block."""
    return _deit('sima_deit_base', pretrained, **kwargs)


@register_model
def additive_deit_tiny(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-Ti with additive (Fastformer) attention in every block."""
    return _deit('additive_deit_tiny', pretrained, **kwargs)


@register_model
def additive_deit_small(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-S with additive (Fastformer) attention in every block."""
    return _deit('additive_deit_small', pretrained, **kwargs)


@register_model
def additive_deit_base(pretrained: bool = False, **kwargs: Any) -> DeiT:
    """DeiT-B with additive (Fastformer) attention in every block."""
    return _deit('additive_deit_base', pretrained, **kwargs)
