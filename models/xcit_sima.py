"""SimA's XCiT-style vision transformers: XCiT's body with SimA attention in the patch-token blocks.

The architecture of the SimA paper's models (arXiv:2206.08898): a convolutional patch embedding (3×3 stride-2
convolutions with BatchNorm, four for patch 16, three for patch 8), a Fourier positional encoding computed for
any grid and projected by a 1×1 convolution (`pos_embeder.token_projection`), `depth` blocks of attention, local
patch interaction (LPI: two depthwise 3×3 convolutions) and MLP with LayerScale, then a class token refined by two
class-attention blocks (SimA's own softmax-free class attention) and the final `norm`. The patch-token blocks take
their attention from the registry (SimA by default, any other with `attn_type=...`); the class attention is part
of the architecture, not a registry attention. Stochastic depth is uniform over the patch-token blocks (XCiT's
convention) and absent from the class-attention blocks.

The key names are the official ones (`cls_token`, `patch_embed.proj.{i}.{0,1}`, `blocks.{i}.{gamma1,gamma2,gamma3,
norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2,norm3,local_mp.conv1,local_mp.bn,local_mp.conv2}`,
`cls_attn_blocks.{j}.{gamma1,gamma2,norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `norm`, `head`,
`pos_embeder.token_projection`), so state dicts of the official code load strictly. Registered: the official
names `sima_{nano,tiny,small}_12_p{16,8}` and `sima_{tiny,small,medium,large}_24_p{16,8}`.

The model takes any input whose sides are multiples of the patch size (the positional encoding has no table).
`forward_features` returns the normalised tokens (B, 1 + H*W, C), class token first; `forward_intermediates` the
outputs of the patch-token blocks. Deliberate difference from the official code: in training mode the model
returns plain logits, not the pair `(logits, logits)` of DeiT's distillation interface, which the zoo's training
loop does not use.
"""
import math
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from timm.layers import DropPath, Mlp, register_notrace_module, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs

from .attention import build_attention, check_attn_kwargs, stage_attentions
from .attention.layout import Grid, image_to_tokens, tokens_to_image
from .checkpoint import filter_checkpoint
from .attention.sima import l1_normalize_tokens
from .family import (
    ZooModel, check_arguments, check_output_fmt, create_variant, format_intermediate, imagenet_cfg, init_weights,
    register_variants, split_drop_rates, take_feature_indices,
)

__all__ = ['SimAXCiT', 'ConvPatchEmbed', 'FourierPositionalEncoding', 'LPI', 'ClassAttention', 'SimABlock',
           'ClassAttentionBlock', 'checkpoint_filter_fn']

# Stride-2 convolution stages of the patch embedding per patch size.
_EMBED_STAGES = {16: 4, 8: 3}


class ConvPatchEmbed(nn.Module):
    """Patch embedding by 3×3 stride-2 convolutions without bias, each followed by a BatchNorm, with GELU between
    stages; widths rise C/2^(s-1), ..., C/2, C over the s stages.

    (B, in_chans, H, W) -> (B, C, H / patch, W / patch).
    """

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        if patch_size not in _EMBED_STAGES:
            raise ValueError(f"patch_size {patch_size} is not supported; expected 8 or 16")
        stages = _EMBED_STAGES[patch_size]
        layers: List[nn.Module] = []
        chans = in_chans
        for s in range(stages):
            width = embed_dim // 2 ** (stages - 1 - s)
            if s:
                layers.append(nn.GELU())
            layers.append(nn.Sequential(nn.Conv2d(chans, width, 3, stride=2, padding=1, bias=False),
                                        nn.BatchNorm2d(width)))
            chans = width
        self.proj = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


# reason: the encoding is built from the grid's sizes, which FX would see as proxies
@register_notrace_module
class FourierPositionalEncoding(nn.Module):
    """XCiT's sine-cosine encoding of the normalised row and column positions, projected to C channels.

    For an (H, W) grid, row i and column j become angles 2π(i+1)/(H+ε) and 2π(j+1)/(W+ε); each is divided by
    `temperature`^(2⌊k/2⌋/hidden_dim), k < hidden_dim, and passed through sin (even k) and cos (odd k),
    interleaved; rows then columns, 2·hidden_dim channels, go through the 1×1 convolution `token_projection`.
    """

    def __init__(self, dim: int, hidden_dim: int = 32, temperature: float = 10000.):
        super().__init__()
        self.token_projection = nn.Conv2d(hidden_dim * 2, dim, kernel_size=1)
        self.hidden_dim = hidden_dim
        self.temperature = temperature
        self.scale = 2 * math.pi
        self.eps = 1e-6

    def _embed(self, steps: int, dim_t: Tensor) -> Tensor:
        """(steps, hidden_dim): interleaved sin / cos of the angles of positions 1..steps."""
        pos = torch.arange(1, steps + 1, dtype=dim_t.dtype, device=dim_t.device)
        pos = (pos / (steps + self.eps) * self.scale)[:, None] / dim_t
        return torch.stack([pos[:, 0::2].sin(), pos[:, 1::2].cos()], dim=-1).flatten(1)

    def forward(self, grid: Grid) -> Tensor:
        """(H, W) -> the encoding of its tokens, (1, H*W, C), in the dtype of the projection."""
        weight = self.token_projection.weight
        # float32 at least, as the official code computes it, also for a half-precision model
        work = torch.promote_types(weight.dtype, torch.float32)
        k = torch.arange(self.hidden_dim, dtype=work, device=weight.device)
        dim_t = torch.pow(self.temperature, 2 * torch.div(k, 2, rounding_mode='floor') / self.hidden_dim)
        rows, cols = self._embed(grid[0], dim_t), self._embed(grid[1], dim_t)
        pos = torch.cat([rows[:, None, :].expand(-1, grid[1], -1), cols[None, :, :].expand(grid[0], -1, -1)], -1)
        pos = pos.permute(2, 0, 1).unsqueeze(0).to(weight.dtype)
        return image_to_tokens(self.token_projection(pos))


class LPI(nn.Module):
    """Local patch interaction: depthwise 3×3 convolution -> GELU -> BatchNorm -> depthwise 3×3 convolution on the
    tokens imaged on their grid. (B, H*W, C) -> (B, H*W, C)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.act = nn.GELU()
        self.bn = nn.BatchNorm2d(dim)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        x = self.conv2(self.bn(self.act(self.conv1(tokens_to_image(x, size)))))
        return image_to_tokens(x)


class SimABlock(nn.Module):
    """XCiT's block with LayerScale: x + γ1·attn(norm1 x), then x + γ3·LPI(norm3 x), then x + γ2·MLP(norm2 x).

    Args:
        dim: channels C.
        attn: a registry attention called as `attn(x, size)` on (B, H*W, C) tokens.
        mlp_ratio: hidden width of the MLP relative to `dim`.
        drop: dropout after the MLP layers.
        drop_path: stochastic depth of the three residual branches.
        eta: initial value of the LayerScale vectors γ1, γ2, γ3.
    """

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4., drop: float = 0., drop_path: float = 0.,
                 eta: float = 1.):
        super().__init__()
        self.gamma1 = nn.Parameter(torch.full((dim,), float(eta)))
        self.gamma2 = nn.Parameter(torch.full((dim,), float(eta)))
        self.gamma3 = nn.Parameter(torch.full((dim,), float(eta)))
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6)
        self.local_mp = LPI(dim)

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, H*W, C) over the grid `size` = (H, W) -> (B, H*W, C)."""
        x = x + self.drop_path(self.gamma1 * self.attn(self.norm1(x), size))
        x = x + self.drop_path(self.gamma3 * self.local_mp(self.norm3(x), size))
        return x + self.drop_path(self.gamma2 * self.mlp(self.norm2(x)))


class ClassAttention(nn.Module):
    """SimA's class attention: the class token's query against every key, softmax-free.

    q, k, v come from one `qkv` projection of all 1 + N tokens; q and k are ℓ1-normalised over the tokens per head
    and channel (clamped at 1e-6), the class token's weights are w_n = Σ_c q̂_0c k̂_nc over every token n, itself
    included, and its output Σ_n w_n v_n goes through `proj`. The other tokens are returned as they came in.
    (B, 1 + N, C) -> (B, 1 + N, C).
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.,
                 proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"class attention: dim {dim} must be a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.eps = 1e-6

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = l1_normalize_tokens(q, self.eps), l1_normalize_tokens(k, self.eps)
        weights = self.attn_drop((q[:, :, :1] * k).sum(-1))  # (B, heads, 1 + N)
        cls = (weights.unsqueeze(2) @ v).transpose(1, 2).reshape(B, 1, C)
        return torch.cat([self.proj_drop(self.proj(cls)), x[:, 1:]], dim=1)


class ClassAttentionBlock(nn.Module):
    """CaiT / XCiT class-attention block with LayerScale, as SimA runs it.

    x + γ1·CA(norm1 x); then `norm2` of every token (`tokens_norm`) or of the class token only; the class token
    gets γ2·MLP(class token) added, and the patch tokens are added to themselves (the doubling of the XCiT code,
    kept: it reaches the class token only through the next block's LayerNorm, but changes the numbers there).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4., qkv_bias: bool = True, drop: float = 0.,
                 attn_drop: float = 0., eta: float = 1., tokens_norm: bool = False):
        super().__init__()
        self.gamma1 = nn.Parameter(torch.full((dim,), float(eta)))
        self.gamma2 = nn.Parameter(torch.full((dim,), float(eta)))
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ClassAttention(dim, num_heads, qkv_bias, attn_drop, drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.tokens_norm = tokens_norm

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, 1 + N, C), class token first -> (B, 1 + N, C)."""
        x = x + self.gamma1 * self.attn(self.norm1(x))
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat([self.norm2(x[:, :1]), x[:, 1:]], dim=1)
        cls = self.gamma2 * self.mlp(x[:, :1])
        return x + torch.cat([cls, x[:, 1:]], dim=1)


class SimAXCiT(ZooModel):
    """SimA's XCiT-style vision transformer with swappable attention in the patch-token blocks.

    Args:
        img_size: the model's nominal input size (int or (H, W)): its pretrained cfg and the grid attentions with
            grid-tied parameters are built for. Any size whose sides are multiples of `patch_size` runs (the
            positional encoding is computed for the grid) unless `dynamic_img_size` is False.
        patch_size: 16 or 8 (four or three stride-2 convolutions).
        in_chans: input image channels.
        num_classes: classifier outputs; 0 for none.
        global_pool: 'token' (class token), 'avg', 'max' or 'avgmax' (mean, maximum or their average over the
            patch tokens) or '' (no pooling).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: width, patch-token blocks, heads (also of the class
            attention), MLP ratio, bias of the `qkv` projections.
        attn_type: the attention of every patch-token block: a registered name or a one-element list.
        attn_kwargs: method options of the attentions (`models.attention.list_attention_options()`).
        drop_rate: dropout after the positional encoding, attention projections and MLP layers.
        pos_drop_rate, proj_drop_rate: timm's names for the first and for the other two of these, each
            `drop_rate` unless given.
        attn_drop_rate: dropout on attention weights (the class attention's, and score-forming attentions').
        drop_path_rate: stochastic depth of every patch-token block (uniform, not rising).
        cls_attn_layers: class-attention blocks.
        eta: initial value of every LayerScale vector (1.0 for the 12-block models, 1e-5 for the 24-block ones).
        tokens_norm: the class-attention blocks' `norm2` normalises every token (True) or the class token only.
        dynamic_img_size: take any input size whose sides are multiples of `patch_size` (False: only `img_size`,
            every grid then fixed when the model is built).
    """

    global_pools = ('token', 'avg', 'max', 'avgmax', '')
    norm_follows_last_stage = False

    def __init__(
            self,
            img_size: Union[int, Grid] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'token',
            embed_dim: int = 384,
            depth: int = 12,
            num_heads: int = 8,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: Union[str, Sequence[str]] = 'sima',
            attn_kwargs: Optional[Dict[str, Any]] = None,
            drop_rate: float = 0.,
            pos_drop_rate: Optional[float] = None,
            proj_drop_rate: Optional[float] = None,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            cls_attn_layers: int = 2,
            eta: float = 1.,
            tokens_norm: bool = False,
            dynamic_img_size: bool = True,
    ):
        super().__init__()
        check_arguments(
            sizes=dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                       num_heads=num_heads),
            counts=dict(num_classes=num_classes, depth=depth, cls_attn_layers=cls_attn_layers),
            ratios=dict(mlp_ratio=mlp_ratio, eta=eta),
            rates=dict(drop_rate=drop_rate, pos_drop_rate=pos_drop_rate, proj_drop_rate=proj_drop_rate,
                       attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate),
            flags=dict(qkv_bias=qkv_bias, tokens_norm=tokens_norm, dynamic_img_size=dynamic_img_size))
        if patch_size in _EMBED_STAGES and embed_dim % 2 ** (_EMBED_STAGES[patch_size] - 1):
            raise ValueError(f"embed_dim {embed_dim} must be a multiple of {2 ** (_EMBED_STAGES[patch_size] - 1)} "
                             f"for patch_size {patch_size}")
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_prefix_tokens = 1
        self._init_output_fmt('NLC')
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.grad_checkpointing = False
        self.img_size: Grid = tuple(to_2tuple(img_size))
        self.img_divisor = patch_size
        self._init_input_size(dynamic_img_size)
        self._check_size(self.img_size, 'img_size')
        self.grid_size: Grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)

        self.patch_embed = ConvPatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        pos_drop_rate, proj_drop_rate = split_drop_rates(drop_rate, pos_drop_rate, proj_drop_rate)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        names = stage_attentions(attn_type, [depth])[0]
        attn_kwargs = check_attn_kwargs(names, attn_kwargs)
        self.num_stages = depth
        self.blocks = nn.ModuleList([
            SimABlock(
                embed_dim,
                build_attention(name, embed_dim, num_heads, self.grid_size, qkv_bias, attn_kwargs=attn_kwargs,
                                attn_drop=attn_drop_rate, proj_drop=proj_drop_rate),
                mlp_ratio=mlp_ratio, drop=proj_drop_rate, drop_path=drop_path_rate, eta=eta)
            for name in names])
        self.cls_attn_blocks = nn.ModuleList([
            ClassAttentionBlock(embed_dim, num_heads, mlp_ratio, qkv_bias, drop=proj_drop_rate,
                                attn_drop=attn_drop_rate, eta=eta, tokens_norm=tokens_norm)
            for _ in range(cls_attn_layers)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.pos_embeder = FourierPositionalEncoding(embed_dim)
        self.feature_info = [
            dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=patch_size) for i in range(depth)]

        trunc_normal_(self.cls_token, std=.02)
        # Linear and LayerNorm as the official init; convolutions and BatchNorm keep PyTorch's defaults
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # of the official list {'pos_embed', 'cls_token', 'dist_token'}, the one name this model has
        return {'cls_token'}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^cls_token|^pos_embeder|^patch_embed', blocks=r'^blocks\.(\d+)',
                    cls_attn_blocks=[(r'^cls_attn_blocks\.(\d+)', None), (r'^norm', (99999,))])

    def _set_grids(self, img_size: Grid) -> None:
        self.grid_size = (img_size[0] // self.img_divisor, img_size[1] // self.img_divisor)
        for block in self.blocks:
            block.attn.set_grid(self.grid_size)

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """Images -> the output of the first `num_stages` patch-token blocks (B, H*W, C) and its grid, with the
        outputs of the blocks in `keep`."""
        self._check_input(x)
        x = self.patch_embed(x)
        grid: Grid = (x.shape[-2], x.shape[-1]) if self.dynamic_img_size else self.grid_size
        x = self.pos_drop(image_to_tokens(x) + self.pos_embeder(grid))
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

    def _final_norm(self, x: Tensor) -> Tensor:
        """Patch tokens (B, N, C) -> the class token before them, refined by the class attention, and the final
        norm of all 1 + N tokens."""
        cls_token = self.cls_token
        if cls_token is not None:  # None once the head is pruned
            x = torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.cls_attn_blocks:
            x = block(x)
        return self.norm(x)

    def forward_intermediates(
            self,
            x: Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """Outputs of the patch-token blocks, as (B, C, H, W) ('NCHW'), (B, H, W, C) ('NHWC') or (B, H*W, C) ('NLC').

        `indices`: the last n blocks (int), the given blocks (list) or all (None); `norm` applies the final
        `norm` to each. Returns the intermediates, or (final features, intermediates), the final features those
        of `forward_features` computed from the last block run (the last of `indices` with `stop_early`).
        """
        check_output_fmt(output_fmt)
        take_indices, max_index = take_feature_indices(len(self.blocks), indices)
        num_stages = max_index + 1 if stop_early or intermediates_only else len(self.blocks)
        final, _, kept = self._run_stages(x, num_stages, take_indices)
        intermediates = []
        for i in sorted(set(take_indices)):  # in depth order, as timm's models return them
            y, grid = kept[i]
            y = self.norm(y) if norm else y
            intermediates.append(format_intermediate(y, grid, output_fmt))
        if intermediates_only:
            return intermediates
        return self._final_norm(final), intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the blocks after the last of `indices`, the final norm with `prune_norm`, and the class token and
        class attention with the head with `prune_head`; returns the kept indices."""
        take_indices, max_index = take_feature_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        self.num_stages = len(self.blocks)
        self.feature_info = self.feature_info[:self.num_stages]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.cls_attn_blocks = nn.ModuleList()
            self.cls_token = None
            self.num_prefix_tokens = 0
            self.reset_classifier(0, '')
        return take_indices


def checkpoint_filter_fn(state_dict: Mapping[str, Any], model: SimAXCiT, strict: bool = True) -> Dict[str, Tensor]:
    """Adapt an official SimA checkpoint to `model`: its weights (under 'model', or 'model_ema' alone, or flat)
    unwrapped and the keys checked."""
    if 'model' not in state_dict and isinstance(state_dict.get('model_ema'), Mapping):
        state_dict = state_dict['model_ema']
    return filter_checkpoint(state_dict, model, strict=strict)


def _create_sima_xcit(variant: str, pretrained: bool, model_args: Dict[str, Any],
                      kwargs: Dict[str, Any]) -> SimAXCiT:
    out_indices = kwargs.pop('out_indices', 3)
    return create_variant(SimAXCiT, variant, pretrained, model_args, kwargs, pretrained_filter_fn=checkpoint_filter_fn,
                          feature_cfg=dict(out_indices=out_indices, feature_cls='getter'))


# The official code released no weights: the cfgs carry its evaluation (resize 256/224, centre crop, bicubic).
_cfg = partial(imagenet_cfg, fixed_input_size=False, first_conv='patch_embed.proj.0.0',
               paper_ids='arXiv:2206.08898', origin_url='https://github.com/UCDvision/sima', license='mit')

# name part -> (embed_dim, depth, num_heads, eta, tokens_norm), as the official factories build them
_SIZES: Dict[str, Tuple[int, int, int, float, bool]] = {
    'nano_12': (128, 12, 4, 1.0, False),
    'tiny_12': (192, 12, 4, 1.0, True),
    'small_12': (384, 12, 8, 1.0, True),
    'tiny_24': (192, 24, 4, 1e-5, True),
    'small_24': (384, 24, 8, 1e-5, True),
    'medium_24': (512, 24, 8, 1e-5, True),
    'large_24': (768, 24, 16, 1e-5, True),
}
_VARIANTS: Dict[str, Tuple[Dict[str, Any], str]] = {
    f'sima_{size}_p{patch}': (
        dict(patch_size=patch, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=4., qkv_bias=True, eta=eta,
             tokens_norm=tokens_norm, attn_type='sima'),
        f'SimA-XCiT {size.replace("_", "-")} patch {patch}: {dim} wide, {depth} blocks, {heads} heads, LayerScale '
        f'{eta:g}, class-attention norm of {"every token" if tokens_norm else "the class token"}.')
    for patch in (16, 8) for size, (dim, depth, heads, eta, tokens_norm) in _SIZES.items()
}

default_cfgs = generate_default_cfgs({name: _cfg() for name in _VARIANTS})

register_variants(__name__, _VARIANTS, _create_sima_xcit)
