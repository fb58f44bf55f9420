"""Tensor layouts the groupings and mixers share: heads, token maps and images, windows, relative positions."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    'Grid', 'split_heads', 'merge_heads', 'tokens_to_image', 'image_to_tokens', 'window_partition',
    'window_reverse', 'roll_tokens', 'relative_position_index', 'shifted_window_mask', 'padded_grid', 'pad_tokens',
    'crop_tokens',
]

Grid = Tuple[int, int]


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, N, C) -> (B, heads, N, C // heads); channel c belongs to head c // (C // heads)."""
    B, N, C = x.shape
    return x.view(B, N, num_heads, C // num_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, heads, N, d) -> (B, N, heads * d)."""
    B, h, N, d = x.shape
    return x.transpose(1, 2).reshape(B, N, h * d)


def tokens_to_image(x: Tensor, grid: Grid) -> Tensor:
    """(B, H*W, C) in row-major token order -> (B, C, H, W), a view: channels-last for a contiguous x.

    Convolutions take a channels-last image as it is and return one, which `image_to_tokens` turns back into
    contiguous tokens without a copy. (A transpose then reshape gives a batch of one the batch stride C, which
    convolutions do not recognise as channels-last, and they copy the image to NCHW.)
    """
    B, N, C = x.shape
    return x.view(B, grid[0], grid[1], C).permute(0, 3, 1, 2)


def image_to_tokens(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H*W, C)."""
    return x.flatten(2).transpose(1, 2)


def window_partition(x: Tensor, grid: Grid, window: Grid) -> Tensor:
    """(B, H*W, C) -> (B * nW, wh*ww, C): windows in row-major order, tokens row-major inside each window."""
    B, N, C = x.shape
    (H, W), (wh, ww) = grid, window
    x = x.view(B, H // wh, wh, W // ww, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wh * ww, C)


def window_reverse(x: Tensor, grid: Grid, window: Grid) -> Tensor:
    """Inverse of `window_partition`: (B * nW, wh*ww, C) -> (B, H*W, C)."""
    (H, W), (wh, ww) = grid, window
    C = x.shape[-1]
    x = x.view(-1, H // wh, W // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, H * W, C)


def padded_grid(grid: Grid, window: Grid) -> Grid:
    """`grid` rounded up to whole windows."""
    return (-(-grid[0] // window[0]) * window[0], -(-grid[1] // window[1]) * window[1])


def pad_tokens(x: Tensor, grid: Grid, padded: Grid) -> Tensor:
    """(B, H*W, C) on `grid` -> (B, H'*W', C) on the larger `padded` grid, zeros below and right of the map."""
    B, N, C = x.shape
    x = F.pad(x.view(B, grid[0], grid[1], C), (0, 0, 0, padded[1] - grid[1], 0, padded[0] - grid[0]))
    return x.view(B, padded[0] * padded[1], C)


def crop_tokens(x: Tensor, padded: Grid, grid: Grid) -> Tensor:
    """Inverse of `pad_tokens`: (B, H'*W', C) on `padded` -> (B, H*W, C), the top-left `grid`."""
    B, N, C = x.shape
    return x.view(B, padded[0], padded[1], C)[:, :grid[0], :grid[1]].reshape(B, grid[0] * grid[1], C)


def relative_position_index(window: Grid) -> Tensor:
    """(n, n) int64 index into a ((2wh-1)(2ww-1), heads) bias table, n = wh*ww, as Swin computes it."""
    wh, ww = window
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij')).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    return (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1


def shifted_window_mask(grid: Grid, window: Grid, shift: int, device: Optional[torch.device] = None) -> Tensor:
    """(nW, n, n) additive mask, -100 between tokens that come from different regions of the rolled map.

    Rows (columns) fall into three regions: before the last window, in it before the last `shift` ones, and those.
    """
    H, W = grid
    rows, cols = torch.arange(H, device=device), torch.arange(W, device=device)
    row_region = (rows >= H - window[0]).long() + (rows >= H - shift).long()
    col_region = (cols >= W - window[1]).long() + (cols >= W - shift).long()
    region = (row_region[:, None] * 3 + col_region[None, :]).view(1, H * W, 1)
    region = window_partition(region, grid, window).squeeze(-1)
    diff = region[:, None, :] - region[:, :, None]
    return torch.zeros(diff.shape, device=device).masked_fill(diff != 0, -100.0)


def roll_tokens(x: Tensor, grid: Grid, shift: int) -> Tensor:
    """Cyclically shift a (B, H*W, C) token map by `shift` rows and columns (negative: towards the origin)."""
    B, N, C = x.shape
    return x.view(B, grid[0], grid[1], C).roll((shift, shift), (1, 2)).view(B, N, C)
