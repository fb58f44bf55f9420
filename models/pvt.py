"""PVT v1: a four-stage pyramid of patch embeddings, learned position embeddings and pre-norm blocks.

Every block takes its attention from the registry with separate `q` / `kv` projections. Score-forming attentions
reduce their keys and values spatially by `sr_ratios` (keys `attn.sr`, `attn.norm`); linear attentions use
`la_sr_ratios` (1 in every stage by default, i.e. global attention over the stage), as the official InLine /
FLatten code does.

Two heads exist, both with the original key names (`patch_embed{i}.proj/norm`, `pos_embed{i}`,
`block{i}.{j}.{norm1,attn.*,norm2,mlp.*}`, `head`):
- the original PVT (`class_token=True`): a class token joins the last stage (its `pos_embed4` has one more row),
  a final LayerNorm `norm`, class-token pooling;
- InLine-PVT and FLatten-PVT (`class_token=False`): no class token, no final norm, the mean of the last stage's
  tokens. FLatten-PVT's official model holds a final LayerNorm `norm` that its forward never uses; the
  `flatten_pvt_*` models keep it, frozen (`keep_unused_norm`), so that their state dict and parameter count are
  the official ones and data-parallel training sees no parameter without a gradient. Other models without a
  final norm drop a checkpoint's `norm.*` on loading.

Another input size: like the official model, each stage's position embedding is resized at run time (bilinear,
the class token's row kept), which at the built size is the identity. The image sides must be multiples of the
total stride (`patch_size` · 8), so every stage and every spatial reduction tiles its map exactly; attentions with
parameters tied to the grid (FLatten's `positional_encoding`) refuse another grid with a ValueError.
"""
import re
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import PatchEmbed, calculate_drop_path_rates, global_pool_nlc, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from .checkpoint import (
    CheckpointError, check_state_dict, checkpoint_state_dict, drop_derived_buffers, resize_grid_embedding,
)
from ._common import (
    FLATTEN_META, INLINE_META, Block, check_global_pool, check_output_fmt, imagenet_cfg, init_weights,
    new_classifier, run_blocks, tsinghua_url,
)
from .attention import build_attention, is_linear_attention, method_kwargs, stage_attentions
from .attention.base import Grid, tokens_to_image

__all__ = ['PyramidVisionTransformer', 'checkpoint_filter_fn']

NUM_STAGES = 4
GLOBAL_POOLS = ('token', 'avg', '')


def resize_position_embedding(embedding: Tensor, grid: Grid, new_grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """(1, prefix + H*W, C) embedding over `grid` -> (1, prefix + H'*W', C) over `new_grid`, bilinearly.

    The run-time resize of the official model (bilinear, corners not aligned, no antialias); identity at
    `new_grid` == `grid`.
    """
    if new_grid == grid:
        return embedding
    prefix, tokens = embedding[:, :num_prefix_tokens], embedding[:, num_prefix_tokens:]
    image = tokens.reshape(1, grid[0], grid[1], -1).permute(0, 3, 1, 2)
    image = F.interpolate(image, size=new_grid, mode='bilinear', align_corners=False)
    return torch.cat([prefix, image.flatten(2).transpose(1, 2)], dim=1)


class PyramidVisionTransformer(nn.Module):
    """PVT v1 with swappable attention.

    Args:
        img_size: input size the model is built for (int or (H, W)); sides must be multiples of `patch_size` · 8.
        patch_size: patch side of the first stage; later stages merge 2×2 tokens.
        in_chans: input image channels.
        num_classes: classifier outputs; 0 for none.
        embed_dims, num_heads, mlp_ratios, depths: per stage width, heads, MLP ratio and number of blocks.
        qkv_bias: bias of the `q` and `kv` projections.
        sr_ratios: spatial reduction of keys and values per stage for score-forming attentions.
        la_sr_ratios: the same for linear attentions, a string of digits ('1111') or a sequence of ints.
        attn_type: a registered name for every block, a list of names per stage, or an official pattern ('IIIS').
        class_token: the original PVT head (class token in the last stage, final norm, class-token pooling);
            False for InLine / FLatten PVT (mean of the last stage's tokens, no final norm).
        keep_unused_norm: without a class token, still hold the final LayerNorm `norm`, frozen and unused, as
            the official FLatten-PVT does.
        global_pool: 'token', 'avg' (mean of the last stage's grid tokens) or ''; default 'token' with a class
            token, else 'avg'.
        focusing_factor, kernel_size: FLatten's focusing power and DWC kernel, passed only to attentions taking them.
        drop_rate: dropout after the position embeddings, the attention projections and the MLP layers.
        attn_drop_rate: dropout on attention weights (score-forming attentions).
        drop_path_rate: stochastic depth, rising linearly over all blocks to this rate.
    """

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
            keep_unused_norm: bool = False,
            global_pool: Optional[str] = None,
            focusing_factor: float = 3,
            kernel_size: int = 5,
            drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
    ):
        super().__init__()
        for what, values in (('embed_dims', embed_dims), ('num_heads', num_heads), ('mlp_ratios', mlp_ratios),
                             ('depths', depths), ('sr_ratios', sr_ratios), ('la_sr_ratios', la_sr_ratios)):
            if len(values) != NUM_STAGES:
                raise ValueError(f"{what} {values!r} must have {NUM_STAGES} entries, one per stage")
        if not all(str(r).isdigit() for r in la_sr_ratios):
            raise ValueError(f"la_sr_ratios {la_sr_ratios!r} must be {NUM_STAGES} non-negative integers, e.g. '1111'")
        la_sr_ratios = [int(r) for r in la_sr_ratios]
        global_pool = ('token' if class_token else 'avg') if global_pool is None else global_pool
        self.num_stages = NUM_STAGES
        self.stride = patch_size * 2 ** (NUM_STAGES - 1)
        self.img_size: Grid = to_2tuple(img_size)
        self._check_size(self.img_size, 'img_size')
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.num_prefix_tokens = 1 if class_token else 0
        self.global_pool = self._check_pool(global_pool)
        self.grad_checkpointing = False

        grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.grid_sizes: List[Grid] = []
        names = stage_attentions(attn_type, depths)
        rates = iter(calculate_drop_path_rates(drop_path_rate, sum(depths)))
        for i in range(NUM_STAGES):
            if i:
                grid = (grid[0] // 2, grid[1] // 2)
            self.grid_sizes.append(grid)
            dim = embed_dims[i]
            prefix = self.num_prefix_tokens if i == NUM_STAGES - 1 else 0
            setattr(self, f'patch_embed{i + 1}', PatchEmbed(
                None, patch_size if i == 0 else 2, in_chans if i == 0 else embed_dims[i - 1], dim,
                norm_layer=nn.LayerNorm, strict_img_size=False))
            setattr(self, f'pos_embed{i + 1}', nn.Parameter(torch.zeros(1, prefix + grid[0] * grid[1], dim)))
            setattr(self, f'pos_drop{i + 1}', nn.Dropout(drop_rate))
            setattr(self, f'block{i + 1}', nn.ModuleList([
                Block(
                    dim,
                    build_attention(
                        name, dim, num_heads[i], grid, qkv_bias, qkv_layout='split',
                        sr_ratio=la_sr_ratios[i] if is_linear_attention(name) else sr_ratios[i],
                        attn_drop=attn_drop_rate, proj_drop=drop_rate,
                        **method_kwargs(name, focusing_factor=focusing_factor, kernel_size=kernel_size)),
                    mlp_ratio=mlp_ratios[i], drop=drop_rate, drop_path=next(rates),
                    norm_layer=partial(nn.LayerNorm, eps=1e-6))
                for name in names[i]]))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims[-1])) if class_token else None
        self.norm = nn.LayerNorm(embed_dims[-1], eps=1e-6) if class_token or keep_unused_norm else nn.Identity()
        self.norm_used = class_token
        self.head = nn.Linear(embed_dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(module=f'block{i + 1}', num_chs=embed_dims[i], reduction=patch_size * 2 ** i)
                             for i in range(NUM_STAGES)]

        for i in range(NUM_STAGES):
            trunc_normal_(getattr(self, f'pos_embed{i + 1}'), std=.02)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=.02)
        self.apply(init_weights)
        if not self.norm_used:
            self.norm.requires_grad_(False)

    def _check_size(self, size: Grid, what: str) -> None:
        if size[0] % self.stride or size[1] % self.stride or min(size) <= 0:
            raise ValueError(f"{what} {size[0]}x{size[1]} must have sides that are positive multiples of "
                             f"{self.stride} (patch_size x 8), e.g. {self.img_size[0]}x{self.img_size[1]}")

    def _check_pool(self, global_pool: str) -> str:
        if check_global_pool(global_pool, GLOBAL_POOLS) == 'token' and not self.num_prefix_tokens:
            raise ValueError("global_pool 'token' needs the class token (class_token=True); use 'avg'")
        return global_pool

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # The official model decays the position embeddings.
        return {'cls_token'}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        stem = r'^patch_embed1\.|^pos_embed1$'
        if coarse:
            return dict(stem=stem, blocks=[(r'^(?:block|patch_embed|pos_embed)(\d+)', None),
                                           (r'^cls_token|^norm', (99999,))])
        return dict(stem=stem, blocks=[(r'^block(\d+)\.(\d+)', None), (r'^(?:patch_embed|pos_embed)(\d+)', (0,)),
                                       (r'^cls_token|^norm', (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new `num_classes`-way head (Identity for 0) on the model's device and dtype; optionally a new pooling."""
        if global_pool is not None:
            self.global_pool = self._check_pool(global_pool)
        self.num_classes = num_classes
        self.head = new_classifier(self, self.num_features, num_classes)

    def _run_stages(self, x: Tensor, num_stages: int) -> Iterator[Tuple[Tensor, Grid]]:
        """Run the first `num_stages` stages on images (B, C, H, W); yield each stage's tokens and grid.

        The tokens are (B, [1 +] h*w, C_i), the class token first in the last stage of the original PVT.
        """
        if x.ndim != 4:
            raise ValueError(f"expected images (B, C, H, W), got a tensor of shape {tuple(x.shape)}")
        self._check_size(tuple(x.shape[-2:]), 'input image size')
        B = x.shape[0]
        grid = tuple(x.shape[-2:])
        for i in range(num_stages):
            if i:
                x = tokens_to_image(x, grid)
            patch_embed = getattr(self, f'patch_embed{i + 1}')
            grid = (x.shape[-2] // patch_embed.patch_size[0], x.shape[-1] // patch_embed.patch_size[1])
            x = patch_embed(x)
            prefix = 0
            if i == NUM_STAGES - 1 and self.cls_token is not None:
                x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
                prefix = 1
            pos_embed = resize_position_embedding(getattr(self, f'pos_embed{i + 1}'), self.grid_sizes[i], grid, prefix)
            x = getattr(self, f'pos_drop{i + 1}')(x + pos_embed)
            x = run_blocks(getattr(self, f'block{i + 1}'), x, grid, grad_checkpointing=self.grad_checkpointing)
            yield x, grid

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) images -> (B, [1 +] h*w, C) tokens of the last stage, after the final norm."""
        for x, _ in self._run_stages(x, self.num_stages):
            pass
        return self._final_norm(x)

    def _final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_used else x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool the tokens of `forward_features` (class token or mean of the grid tokens), then classify."""
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
        """Outputs of the stages in `indices` (last n for an int, all for None), without the class token.

        Returns the intermediates ((B, C_i, h, w) for 'NCHW', (B, h*w, C_i) for 'NLC'; the last stage after the
        final norm when `norm`), and unless `intermediates_only` the final features of `forward_features` first.
        """
        check_output_fmt(output_fmt)
        take_indices, max_index = feature_take_indices(self.num_stages, indices)
        num_stages = max_index + 1 if stop_early or intermediates_only else self.num_stages
        intermediates = []
        for i, (x, grid) in enumerate(self._run_stages(x, num_stages)):
            if i in take_indices:
                y = self._final_norm(x) if norm and i == NUM_STAGES - 1 else x
                y = y[:, self.num_prefix_tokens if i == NUM_STAGES - 1 else 0:]
                intermediates.append(tokens_to_image(y, grid) if output_fmt == 'NCHW' else y)
        if intermediates_only:
            return intermediates
        return self._final_norm(x), intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages after the last of `indices` (and the final norm / head); returns the kept indices.

        Dropping the last stage drops the class token and the final norm with it.
        """
        take_indices, max_index = feature_take_indices(self.num_stages, indices)
        for i in range(max_index + 1, self.num_stages):
            for name in (f'patch_embed{i + 1}', f'pos_embed{i + 1}', f'pos_drop{i + 1}', f'block{i + 1}'):
                delattr(self, name)
        if max_index + 1 < NUM_STAGES:
            self.cls_token = None
            self.num_prefix_tokens = 0
            self.global_pool = 'avg' if self.global_pool == 'token' else self.global_pool
            prune_norm = True
            self.num_features = self.head_hidden_size = self.feature_info[max_index]['num_chs']
        self.num_stages = max_index + 1
        self.feature_info = self.feature_info[:self.num_stages]
        if prune_norm:
            self.norm = nn.Identity()
            self.norm_used = False
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: PyramidVisionTransformer) -> Dict[str, Tensor]:
    """Adapt a PVT / InLine-PVT / FLatten-PVT checkpoint to `model`.

    Unwraps it, drops derived buffers and FLatten-PVT's unused `norm.*` when the model has no final norm, resizes
    the position embeddings and FLatten's per-stage `positional_encoding` bicubically to the model's grids, and
    checks the keys.
    """
    state_dict = drop_derived_buffers(checkpoint_state_dict(state_dict))
    own = model.state_dict()
    if 'norm.weight' not in own:
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith('norm.')}
    for key, value in state_dict.items():
        match = re.match(r'(?:pos_embed(\d)|block(\d)\.\d+\.attn\.positional_encoding)$', key)
        if not match or key not in own or own[key].shape == value.shape:
            continue
        stage = int(match.group(1) or match.group(2)) - 1
        prefix = 1 if key == f'pos_embed{NUM_STAGES}' and model.cls_token is not None else 0
        try:
            state_dict[key] = resize_grid_embedding(value, model.grid_sizes[stage], num_prefix_tokens=prefix)
        except CheckpointError:
            pass  # not a square grid with this model's prefix: the key check below names it as mis-shaped
    check_state_dict(model, state_dict, 'checkpoint', free_shape_prefixes=('head.',))
    return state_dict


def _create_pvt(variant: str, pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    out_indices = kwargs.pop('out_indices', (0, 1, 2, 3))
    return build_model_with_cfg(
        PyramidVisionTransformer, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs)


_cfg = partial(imagenet_cfg, first_conv='patch_embed1.proj')

_SIZES = ('tiny', 'small', 'medium', 'large')
_DEPTHS = {'tiny': (2, 2, 2, 2), 'small': (3, 4, 6, 3), 'medium': (3, 4, 18, 3), 'large': (3, 8, 27, 3)}
_PVT_META = dict(paper_ids='arXiv:2102.12122', origin_url='https://github.com/whai362/PVT', license='apache-2.0')
_INLINE_FILES = {'tiny': '90ac52b1555b401eb5e6', 'small': '1ab953b2479d433080a3', 'medium': 'a72aec31e6084bc0a280',
                 'large': 'efd91318ba964f01b288'}

default_cfgs = generate_default_cfgs({
    **{f'softmax_pvt_{size}': _cfg(f'https://github.com/whai362/PVT/releases/download/v2/pvt_{size}.pth',
                                   **_PVT_META)
       for size in _SIZES},
    **{f'inline_pvt_{size}': _cfg(tsinghua_url(_INLINE_FILES[size]), **INLINE_META) for size in _SIZES},
    # FLatten's positional_encoding is sized to the 224 grids.
    'flatten_pvt_tiny': _cfg(tsinghua_url('3ab1d773f19d45648690'), fixed_input_size=True, **FLATTEN_META),
    **{f'flatten_pvt_{size}': _cfg(fixed_input_size=True, **FLATTEN_META) for size in _SIZES[1:]},
    **{f'{attn}_pvt_{size}': _cfg() for attn in ('multimax', 'sima', 'additive') for size in _SIZES},
})

# Per flavour: attention, heads per stage, the original class-token head, FLatten's unused final norm.
_FLAVOURS = {
    'softmax': ('softmax', (1, 2, 5, 8), True, False),
    'multimax': ('multimax', (1, 2, 5, 8), True, False),
    'sima': ('sima', (1, 2, 5, 8), True, False),
    'additive': ('additive', (1, 2, 5, 8), True, False),
    'inline': ('inline', (2, 4, 10, 16), False, False),
    'flatten': ('flatten', (1, 2, 5, 8), False, True),
}


def _pvt(variant: str, pretrained: bool, **kwargs: Any) -> PyramidVisionTransformer:
    """`{flavour}_pvt_{size}`: the size's depths with the flavour's attention, heads and head."""
    flavour, size = variant.split('_pvt_')
    attention, num_heads, class_token, keep_unused_norm = _FLAVOURS[flavour]
    model_args = dict(
        patch_size=4, embed_dims=(64, 128, 320, 512), num_heads=num_heads, mlp_ratios=(8, 8, 4, 4), qkv_bias=True,
        depths=_DEPTHS[size], sr_ratios=(8, 4, 2, 1), la_sr_ratios='1111', attn_type=attention,
        class_token=class_token, keep_unused_norm=keep_unused_norm)
    return _create_pvt(variant, pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def softmax_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-T (original): heads 1-2-5-8, spatial reduction 8-4-2-1, class token."""
    return _pvt('softmax_pvt_tiny', pretrained, **kwargs)


@register_model
def softmax_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-S (original): heads 1-2-5-8, spatial reduction 8-4-2-1, class token."""
    return _pvt('softmax_pvt_small', pretrained, **kwargs)


@register_model
def softmax_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-M (original): heads 1-2-5-8, spatial reduction 8-4-2-1, class token."""
    return _pvt('softmax_pvt_medium', pretrained, **kwargs)


@register_model
def softmax_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-L (original): heads 1-2-5-8, spatial reduction 8-4-2-1, class token."""
    return _pvt('softmax_pvt_large', pretrained, **kwargs)


@register_model
def inline_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """InLine-PVT-T: heads 2-4-10-16, InLine attention in every block, mean pooling."""
    return _pvt('inline_pvt_tiny', pretrained, **kwargs)


@register_model
def inline_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """InLine-PVT-S: heads 2-4-10-16, InLine attention in every block, mean pooling."""
    return _pvt('inline_pvt_small', pretrained, **kwargs)


@register_model
def inline_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """InLine-PVT-M: heads 2-4-10-16, InLine attention in every block, mean pooling."""
    return _pvt('inline_pvt_medium', pretrained, **kwargs)


@register_model
def inline_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """InLine-PVT-L: heads 2-4-10-16, InLine attention in every block, mean pooling."""
    return _pvt('inline_pvt_large', pretrained, **kwargs)


@register_model
def flatten_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """FLatten-PVT-T: heads 1-2-5-8, focused linear attention in every block, mean pooling."""
    return _pvt('flatten_pvt_tiny', pretrained, **kwargs)


@register_model
def flatten_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """FLatten-PVT-S: heads 1-2-5-8, focused linear attention in every block, mean pooling."""
    return _pvt('flatten_pvt_small', pretrained, **kwargs)


@register_model
def flatten_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """FLatten-PVT-M: heads 1-2-5-8, focused linear attention in every block, mean pooling."""
    return _pvt('flatten_pvt_medium', pretrained, **kwargs)


@register_model
def flatten_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """FLatten-PVT-L: heads 1-2-5-8, focused linear attention in every block, mean pooling."""
    return _pvt('flatten_pvt_large', pretrained, **kwargs)


@register_model
def multimax_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-T with MultiMax attention in every block (spatial reduction 8-4-2-1, class token)."""
    return _pvt('multimax_pvt_tiny', pretrained, **kwargs)


@register_model
def multimax_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-S with MultiMax attention in every block (spatial reduction 8-4-2-1, class token)."""
    return _pvt('multimax_pvt_small', pretrained, **kwargs)


@register_model
def multimax_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-M with MultiMax attention in every block (spatial reduction 8-4-2-1, class token)."""
    return _pvt('multimax_pvt_medium', pretrained, **kwargs)


@register_model
def multimax_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-L with MultiMax attention in every block (spatial reduction 8-4-2-1, class token)."""
    return _pvt('multimax_pvt_large', pretrained, **kwargs)


@register_model
def sima_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-T with SimA attention in every block (no spatial reduction, class token)."""
    return _pvt('sima_pvt_tiny', pretrained, **kwargs)


@register_model
def sima_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-S with SimA attention in every block (no spatial reduction, class token)."""
    return _pvt('sima_pvt_small', pretrained, **kwargs)


@register_model
def sima_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-M with SimA attention in every block (no spatial reduction, class token)."""
    return _pvt('sima_pvt_medium', pretrained, **kwargs)


@register_model
def sima_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-L with SimA attention in every block (no spatial reduction, class token)."""
    return _pvt('sima_pvt_large', pretrained, **kwargs)


@register_model
def additive_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-T with additive (Fastformer) attention in every block (no spatial reduction, class token)."""
    return _pvt('additive_pvt_tiny', pretrained, **kwargs)


@register_model
def additive_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-S with additive (Fastformer) attention in every block (no spatial reduction, class token)."""
    return _pvt('additive_pvt_small', pretrained, **kwargs)


@register_model
def additive_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-M with additive (Fastformer) attention in every block (no spatial reduction, class token)."""
    return _pvt('additive_pvt_medium', pretrained, **kwargs)


@register_model
def additive_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-L with additive (Fastformer) attention in every block (no spatial reduction, class token)."""
    return _pvt('additive_pvt_large', pretrained, **kwargs)
