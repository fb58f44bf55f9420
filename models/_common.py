"""What the backbone families share: the pre-norm block, the official init, block running, head and input checks,
and the pieces of their pretrained cfgs."""
from typing import Any, Callable, Dict, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, trunc_normal_

from .attention.base import Grid

__all__ = [
    'Block', 'init_weights', 'run_blocks', 'new_classifier', 'check_global_pool', 'check_img_size',
    'check_output_fmt', 'imagenet_cfg', 'tsinghua_url', 'INLINE_META', 'FLATTEN_META',
]

# Pretrained-cfg entries of the InLine and FLatten releases, which several families ship. Their evaluation resizes
# the image to a square of int(S / crop_pct) before the centre crop, which is timm's 'squash' crop mode.
INLINE_META = dict(paper_ids='arXiv:2412.06590', origin_url='https://github.com/LeapLabTHU/InLine', crop_mode='squash')
FLATTEN_META = dict(paper_ids='arXiv:2308.00442', origin_url='https://github.com/LeapLabTHU/FLatten-Transformer',
                    crop_mode='squash')


class Block(nn.Module):
    """Pre-norm transformer block around a given attention: x + attn(norm1(x)), then x + mlp(norm2(x)).

    Args:
        dim: channels C.
        attn: an attention module called as `attn(x, size)` on (B, N, C) tokens.
        mlp_ratio: hidden width of the MLP relative to `dim`.
        drop: dropout after the MLP layers.
        drop_path: stochastic depth rate of both residual branches.
        norm_layer: normalisation of the attention and MLP inputs.
    """

    def __init__(
            self,
            dim: int,
            attn: nn.Module,
            mlp_ratio: float = 4.,
            drop: float = 0.,
            drop_path: float = 0.,
            norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, N, C), the last H*W tokens forming the grid `size` = (H, W) -> (B, N, C)."""
        x = x + self.drop_path(self.attn(self.norm1(x), size))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def init_weights(module: nn.Module) -> None:
    """The official initialisation: Linear trunc-normal(.02) with zero bias, LayerNorm 1 and 0."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, *args: Any, grad_checkpointing: bool = False) -> Tensor:
    """`x` through every block in turn as `block(x, *args)`; with `grad_checkpointing` each block's activations
    are recomputed in the backward pass instead of kept."""
    checkpointed = grad_checkpointing and not torch.jit.is_scripting()
    for block in blocks:
        x = checkpoint(block, x, *args, use_reentrant=False) if checkpointed else block(x, *args)
    return x


def new_classifier(model: nn.Module, num_features: int, num_classes: int) -> nn.Module:
    """A `num_classes`-way Linear head (Identity for 0) on `model`'s device and dtype, in its train / eval mode."""
    ref = next(model.parameters())
    head = (nn.Linear(num_features, num_classes, device=ref.device, dtype=ref.dtype)
            if num_classes > 0 else nn.Identity())
    return head.train(model.training)


def check_global_pool(global_pool: str, supported: Sequence[str]) -> str:
    """`global_pool` when it is one of `supported`, else a ValueError naming them."""
    if global_pool not in supported:
        raise ValueError(f"global_pool {global_pool!r} is not supported; expected one of "
                         f"{', '.join(map(repr, supported))}")
    return global_pool


def check_img_size(x: Tensor, img_size: Grid) -> None:
    """A ValueError unless the images `x` (B, C, H, W) have the (H, W) `img_size` the model was built for."""
    size = tuple(x.shape[-2:])
    if size != tuple(img_size):
        raise ValueError(f"input image size {size[0]}x{size[1]} does not match the model's img_size "
                         f"{img_size[0]}x{img_size[1]}; build the model with img_size={size} instead of "
                         f"{tuple(img_size)}")


def check_output_fmt(output_fmt: str) -> None:
    """A ValueError unless `output_fmt` is a layout `forward_intermediates` returns: 'NCHW' or 'NLC'."""
    if output_fmt not in ('NCHW', 'NLC'):
        raise ValueError(f"output_fmt {output_fmt!r} is not supported; expected 'NCHW' or 'NLC'")


def imagenet_cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    """Pretrained cfg of an ImageNet-1k classifier evaluated at 224 (resize, 0.875 centre crop, bicubic) with a
    `head` Linear; `kwargs` add to or override it."""
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None, 'crop_pct': 0.875,
        'interpolation': 'bicubic', 'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'classifier': 'head', **kwargs,
    }


def tsinghua_url(file_id: str) -> str:
    """Download address of an official InLine / FLatten release file."""
    return f'https://cloud.tsinghua.edu.cn/f/{file_id}/?dl=1'
