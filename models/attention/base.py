"""What every attention shares: projections, token grouping and the output projection.

An attention is an `Attention` subclass that owns its method's parameters and implements `mix`, the token
mixing of one group of tokens. The base class decides how tokens are grouped: globally (with optional prefix
tokens such as a class token), with keys and values from a spatially reduced map (PVT), in (shifted) windows
with a relative position bias (Swin), or in stripes with a locally-enhanced positional encoding (CSwin, through
`CrossShapedAttention`). The score normaliser is the subclass's business, so every grouping works with every
attention.
"""
import contextlib
from typing import ClassVar, ContextManager, List, Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import trunc_normal_

__all__ = [
    'Attention', 'CrossShapedAttention', 'Grid', 'window_partition', 'window_reverse', 'relative_position_index',
    'shifted_window_mask', 'split_heads', 'merge_heads', 'tokens_to_image', 'image_to_tokens', 'autocast_off',
]

Grid = Tuple[int, int]

# Device types with an autocast mode; others (the meta device used to count parameters and FLOPs) have none to turn off.
_AUTOCAST_DEVICES = frozenset(d for d in ('cpu', 'cuda', 'xpu', 'mps', 'hpu') if torch.amp.is_autocast_available(d))


def autocast_off(device: torch.device) -> ContextManager:
    """Autocast disabled on `device`'s type, for math that chooses its own precision."""
    return torch.autocast(device.type, enabled=False) if device.type in _AUTOCAST_DEVICES else contextlib.nullcontext()


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, N, C) -> (B, heads, N, C // heads); channel c belongs to head c // (C // heads)."""
    B, N, C = x.shape
    return x.view(B, N, num_heads, C // num_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, heads, N, d) -> (B, N, heads * d)."""
    B, h, N, d = x.shape
    return x.transpose(1, 2).reshape(B, N, h * d)


def tokens_to_image(x: Tensor, grid: Grid) -> Tensor:
    """(B, H*W, C) in row-major token order -> (B, C, H, W)."""
    B, N, C = x.shape
    return x.transpose(1, 2).reshape(B, C, grid[0], grid[1])


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


def relative_position_index(window: Grid) -> Tensor:
    """(n, n) int64 index into a ((2wh-1)(2ww-1), heads) bias table, n = wh*ww, as Swin computes it."""
    wh, ww = window
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij')).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    return (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1


def shifted_window_mask(grid: Grid, window: Grid, shift: int) -> Tensor:
    """(nW, n, n) additive mask, -100 between tokens that come from different regions of the rolled map."""
    H, W = grid
    wh, ww = window
    region = torch.zeros(1, H, W, 1)
    label = 0
    for hs in (slice(0, -wh), slice(-wh, -shift), slice(-shift, None)):
        for ws in (slice(0, -ww), slice(-ww, -shift), slice(-shift, None)):
            region[:, hs, ws, :] = label
            label += 1
    region = window_partition(region.view(1, H * W, 1), grid, window).squeeze(-1)
    diff = region[:, None, :] - region[:, :, None]
    return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)


def _roll(x: Tensor, grid: Grid, shift: int) -> Tensor:
    """Cyclically shift a (B, H*W, C) token map by `shift` rows and columns (negative: towards the origin)."""
    B, N, C = x.shape
    return x.view(B, grid[0], grid[1], C).roll((shift, shift), (1, 2)).view(B, N, C)


class Attention(nn.Module):
    """Multi-head attention over a token grid: projections, grouping, `mix`, output projection.

    Args:
        dim: channels C of the input and output.
        num_heads: number of heads; C must divide by it.
        grid_size: (H, W) token grid the module is built for (needed by windows, reduction and grid-sized
            parameters).
        qkv_bias: bias of the query/key/value projections.
        qkv_layout: 'fused' for one `qkv` Linear(C, 3C), 'split' for `q` Linear(C, C) and `kv` Linear(C, 2C) (PVT),
            'none' for no projections at all (a branch of `CrossShapedAttention`).
        sr_ratio: PVT's spatial reduction: keys and values come from a stride-`sr_ratio` convolution `sr` and a
            LayerNorm `norm` of the input map (needs 'split' and an attention that supports reduced keys).
        window_size: None for global attention, an int for square Swin windows (clamped to the grid as Swin does:
            a window as large as the grid's short side means global attention, unshifted), or (wh, ww).
        shift_size: Swin's cyclic shift of the windows.
        rel_pos_bias: add Swin's learned relative position bias to the scores (score-forming attentions only).
        lepe: add CSwin's locally-enhanced positional encoding, a depthwise 3x3 convolution `get_v` of V per group.
        attn_drop, proj_drop: dropout on the attention weights (where there are any) and on the output.

    Subclasses set `linear` (no score matrix: cost linear in tokens), `uses_tokens` (`mix` needs the grouped
    attention input) and `supports_reduction`, and implement `mix`.
    """
    attention_name: ClassVar[str] = ''
    linear: ClassVar[bool] = False
    uses_tokens: ClassVar[bool] = False
    supports_reduction: ClassVar[bool] = False

    def __init__(
            self,
            dim: int,
            num_heads: int,
            grid_size: Optional[Grid] = None,
            qkv_bias: bool = True,
            *,
            qkv_layout: str = 'fused',
            sr_ratio: int = 1,
            window_size: Optional[Union[int, Grid]] = None,
            shift_size: int = 0,
            rel_pos_bias: bool = False,
            lepe: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
    ):
        super().__init__()
        name = self.attention_name or type(self).__name__
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"{name} attention: dim {dim} must be a multiple of num_heads {num_heads}")
        if qkv_layout not in ('fused', 'split', 'none'):
            raise ValueError(f"{name} attention: qkv_layout {qkv_layout!r} must be 'fused', 'split' or 'none'")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.grid_size: Optional[Grid] = tuple(grid_size) if grid_size is not None else None
        self.qkv_layout = qkv_layout

        if qkv_layout == 'fused':
            self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        elif qkv_layout == 'split':
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)

        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            if qkv_layout != 'split' or not self.supports_reduction:
                raise ValueError(
                    f"{name} attention: sr_ratio {sr_ratio} needs qkv_layout='split' and an attention that supports "
                    f"reduced keys (sr_ratio=1 expected)")
            self._require_grid('sr_ratio')
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

        self.window: Optional[Grid] = None
        self.shift_size = 0
        if window_size is not None:
            self._require_grid('window_size')
            self.window, self.shift_size = self._resolve_window(window_size, shift_size)

        self.bias_window: Optional[Grid] = None
        if rel_pos_bias and not self.linear:
            self.bias_window = self.window or self._require_grid('rel_pos_bias')
            wh, ww = self.bias_window
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
            trunc_normal_(self.relative_position_bias_table, std=.02)
            self.register_buffer('relative_position_index', relative_position_index(self.bias_window), persistent=False)
        if self.shift_size and not self.linear:
            self.register_buffer(
                'attn_mask', shifted_window_mask(self.grid_size, self.window, self.shift_size), persistent=False)
        else:
            self.attn_mask = None

        self.get_v = nn.Conv2d(dim, dim, 3, padding=1, groups=dim) if lepe else None
        self.attn_drop = attn_drop
        if qkv_layout != 'none':
            self.proj = nn.Linear(dim, dim)
            self.proj_drop = nn.Dropout(proj_drop)

    def _require_grid(self, what: str) -> Grid:
        if self.grid_size is None:
            raise ValueError(f"{self.attention_name or type(self).__name__} attention: {what} needs grid_size=(H, W)")
        return self.grid_size

    def _resolve_window(self, window_size: Union[int, Grid], shift_size: int) -> Tuple[Optional[Grid], int]:
        H, W = self.grid_size
        if isinstance(window_size, int):
            if min(H, W) <= window_size:
                window_size, shift_size = min(H, W), 0
            window = (window_size, window_size)
        else:
            window = tuple(window_size)
        if H % window[0] or W % window[1]:
            raise ValueError(f"grid {H}x{W} does not divide into windows of {window[0]}x{window[1]}")
        if not 0 <= shift_size < min(window):
            raise ValueError(f"shift_size {shift_size} must be in [0, {min(window)})")
        if window == (H, W):
            return None, 0
        return window, shift_size

    def extra_repr(self) -> str:
        parts = [f'dim={self.dim}', f'num_heads={self.num_heads}']
        if self.window is not None:
            parts.append(f'window={self.window}')
        if self.shift_size:
            parts.append(f'shift={self.shift_size}')
        if self.sr_ratio > 1:
            parts.append(f'sr_ratio={self.sr_ratio}')
        return ', '.join(parts)

    def relative_position_bias(self) -> Optional[Tensor]:
        """(heads, n, n) bias for the tokens of one window, or None."""
        if self.bias_window is None:
            return None
        n = self.bias_window[0] * self.bias_window[1]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, -1).permute(2, 0, 1)

    def project(self, x: Tensor, size: Grid) -> Tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values, each (B, N, C); keys and values have N/sr^2 tokens under reduction."""
        if self.qkv_layout == 'fused':
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return q, k, v
        if self.qkv_layout == 'none':
            raise RuntimeError("an attention built with qkv_layout='none' is a branch: call attend(q, k, v, size)")
        q = self.q(x)
        if self.sr_ratio > 1:
            if x.shape[1] != size[0] * size[1]:
                raise ValueError("spatial reduction does not support prefix tokens")
            x = self.norm(image_to_tokens(self.sr(tokens_to_image(x, size))))
        k, v = self.kv(x).chunk(2, dim=-1)
        return q, k, v

    def forward(self, x: Tensor, size: Grid, block_input: Optional[Tensor] = None) -> Tensor:
        """x: (B, N, C), the last H*W tokens forming the grid `size` = (H, W) -> (B, N, C).

        `block_input`, when given, is the un-normalised block input; attentions that summarise their input
        (InLine's local residual) summarise it instead of `x`, as CSwin's InLine does.
        """
        tokens = (x if block_input is None else block_input) if self.uses_tokens else None
        if self.window is None or self.sr_ratio > 1:
            q, k, v = self.project(x, size)
            return self.proj_drop(self.proj(self.attend(q, k, v, size, tokens)))
        # The projections act token by token, so they commute with the grouping into windows: grouping the
        # input once moves a third of the data that grouping q, k and v would.
        self._check_size(size, x.shape[1])
        q, k, v = self.project(self._group(x, size), self.window)
        out = self._mix_windows(q, k, v, None if tokens is None else self._group(tokens, size))
        return self._ungroup(self.proj_drop(self.proj(out)), size)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, size: Grid, tokens: Optional[Tensor] = None) -> Tensor:
        """Group the tokens, mix each group, add LePE, ungroup: (B, N, C) each -> (B, N, C)."""
        num_prefix = self._check_size(size, q.shape[1])
        if self.window is None:
            out = self.mix(q, k, v, size, num_prefix, tokens, self.relative_position_bias(), None)
            if self.get_v is not None:
                out = out + self._lepe(v, size, num_prefix)
            return out
        groups = [self._group(t, size) for t in (q, k, v)]
        return self._ungroup(self._mix_windows(*groups, None if tokens is None else self._group(tokens, size)), size)

    def _check_size(self, size: Grid, num_tokens: int) -> int:
        """The number of prefix tokens before the `size` grid; raises ValueError for a grid the module cannot take."""
        H, W = size
        num_prefix = num_tokens - H * W
        if num_prefix < 0:
            raise ValueError(f"{num_tokens} tokens cannot hold a {H}x{W} grid")
        if self.grid_size is not None and (self.window is not None or self.shift_size) and size != self.grid_size:
            raise ValueError(f"input grid {H}x{W} does not match the {self.grid_size[0]}x{self.grid_size[1]} grid "
                             f"this windowed attention was built for")
        if self.window is not None and num_prefix:
            raise ValueError(f"windowed attention does not support prefix tokens, got {num_prefix} before the "
                             f"{H}x{W} grid")
        return num_prefix

    def _group(self, x: Tensor, size: Grid) -> Tensor:
        """(B, H*W, C) -> (B * nW, n, C): roll by the shift, then cut into windows."""
        if self.shift_size:
            x = _roll(x, size, -self.shift_size)
        return window_partition(x, size, self.window)

    def _ungroup(self, x: Tensor, size: Grid) -> Tensor:
        """Inverse of `_group`: (B * nW, n, C) -> (B, H*W, C)."""
        x = window_reverse(x, size, self.window)
        return _roll(x, size, self.shift_size) if self.shift_size else x

    def _mix_windows(self, q: Tensor, k: Tensor, v: Tensor, tokens: Optional[Tensor]) -> Tensor:
        """`mix` plus LePE for (B * nW, n, C) windows."""
        out = self.mix(q, k, v, self.window, 0, tokens, self.relative_position_bias(), self.attn_mask)
        if self.get_v is not None:
            out = out + self._lepe(v, self.window, 0)
        return out

    def _lepe(self, v: Tensor, grid: Grid, num_prefix: int) -> Tensor:
        lepe = image_to_tokens(self.get_v(tokens_to_image(v[:, num_prefix:], grid)))
        return F.pad(lepe, (0, 0, num_prefix, 0)) if num_prefix else lepe

    def mix(
            self,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            grid: Grid,
            num_prefix_tokens: int,
            tokens: Optional[Tensor],
            pos_bias: Optional[Tensor],
            mask: Optional[Tensor],
    ) -> Tensor:
        """Mix one group of tokens.

        Args:
            q: (B', n, C) queries of B' groups; k, v: (B', m, C) keys and values (m = n unless reduced).
            grid: (h, w) image shape of the last h*w query tokens of a group.
            num_prefix_tokens: n - h*w leading tokens outside the image (a class token).
            tokens: (B', n, C) attention input of the group when `uses_tokens`, else None.
            pos_bias: (heads, n, m) additive score bias (Swin's relative position bias) or None.
            mask: (nW, n, m) additive mask of shifted windows, group g using mask[g % nW], or None.
        Returns:
            (B', n, C) mixed values, heads concatenated in channel order.
        """
        raise NotImplementedError


class CrossShapedAttention(nn.Module):
    """CSwin's cross-shaped window attention around any attention class.

    One `qkv` over all channels; the first half of the channels (and heads) attends within vertical stripes of
    width `split_size`, the second half within horizontal stripes, each branch (`attns`) adding LePE; when the
    stripes cover the grid a single global branch takes all channels. `proj` follows the concatenation.
    """

    def __init__(
            self,
            attn_cls: Type[Attention],
            dim: int,
            num_heads: int,
            grid_size: Optional[Grid],
            qkv_bias: bool = True,
            *,
            split_size: int,
            lepe: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            **kwargs,
    ):
        super().__init__()
        if grid_size is None:
            raise ValueError("cross-shaped attention needs grid_size=(H, W)")
        H, W = grid_size
        self.attention_name = attn_cls.attention_name
        self.linear = attn_cls.linear
        self.uses_tokens = attn_cls.uses_tokens
        self.grid_size = (H, W)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        branch = dict(qkv_layout='none', lepe=lepe, attn_drop=attn_drop, **kwargs)
        if split_size >= max(H, W):
            self.attns = nn.ModuleList([attn_cls(dim, num_heads, grid_size, **branch)])
        else:
            if dim % 2 or num_heads % 2:
                raise ValueError(f"two stripe branches need an even dim and num_heads, got {dim} and {num_heads}")
            self.attns = nn.ModuleList([
                attn_cls(dim // 2, num_heads // 2, grid_size, window_size=window, **branch)
                for window in ((H, split_size), (split_size, W))
            ])
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, size: Grid, block_input: Optional[Tensor] = None) -> Tensor:
        """x: (B, H*W, C) -> (B, H*W, C)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        tokens = (x if block_input is None else block_input) if self.uses_tokens else None
        if len(self.attns) == 1:
            out = self.attns[0].attend(q, k, v, size, tokens)
        else:
            outs: List[Tensor] = []
            c = q.shape[-1] // 2
            for i, attn in enumerate(self.attns):
                part = slice(i * c, (i + 1) * c)
                outs.append(attn.attend(
                    q[..., part], k[..., part], v[..., part], size, None if tokens is None else tokens[..., part]))
            out = torch.cat(outs, dim=-1)
        return self.proj_drop(self.proj(out))
