"""The grouping half of an attention: which tokens attend to which, and the projections and tables that go with it.

Every grouping owns the query/key/value and output projections, builds its mixer for the grid of one group, and
calls it on grouped q, k, v with a `MixContext`:

- `GlobalAttention`: every token with every other, prefix tokens (a class token) included (DeiT);
- `SpatialReductionAttention`: separate `q` and `kv` projections, keys and values optionally from a strided
  convolution `sr` and LayerNorm `norm` of the map (PVT);
- `WindowAttention`: (shifted) windows with a relative position bias and the shifted-window mask for mixers that
  accept a score bias (Swin);
- `CrossShapedAttention`: one `qkv`, the channels split into vertical and horizontal stripe branches
  (`StripeBranch`), each with a locally-enhanced positional encoding `get_v` (CSwin).

The mixer's state-dict entries stand at the grouping's level (`attn.ranges`, not `attn.mixer.ranges`), which is
where the official checkpoints keep them.
"""
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type, Union

import torch
from torch import Tensor, nn

from timm.layers import register_notrace_module, trunc_normal_

from ..checkpoint import rename_loaded_keys, resize_rel_pos_bias_table, set_tensor_slot
from .layout import (
    Grid, crop_tokens, image_to_tokens, pad_tokens, padded_grid, relative_position_index, roll_tokens,
    shifted_window_mask, tokens_to_image, window_partition, window_reverse,
)
from .mixer import Mixer, MixContext, MixerContractError, is_exporting, is_integer

__all__ = [
    'MixerHost', 'GroupedAttention', 'GlobalAttention', 'SpatialReductionAttention', 'WindowAttention',
    'StripeBranch', 'CrossShapedAttention',
]


def _lift_mixer_keys(module: 'MixerHost', state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: `prefix.mixer.x` -> `prefix.x`, in the order of one module that owned both parts
    (the official order): parameters, then buffers, then submodules, each the host's before the mixer's."""
    mixer = module.mixer

    def rank(key: str) -> int:
        rest = key[len(prefix):]
        if rest.startswith('mixer.'):
            name = rest[len('mixer.'):]
            return 5 if '.' in name else 1 if name in mixer._parameters else 3
        return 4 if '.' in rest else 0 if rest in module._parameters else 2

    # This module's entries are the last ones written: re-inserting them keeps them where they were.
    segment = [k for k in state_dict if k.startswith(prefix)]
    entries = {k: state_dict.pop(k) for k in segment}
    for key in sorted(segment, key=rank):
        lifted = prefix + key[len(prefix) + len('mixer.'):] if key.startswith(prefix + 'mixer.') else key
        state_dict[lifted] = entries[key]


def _sink_mixer_keys(module: 'MixerHost', state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: `prefix.x` -> `prefix.mixer.x` for the names the mixer owns."""
    rename_loaded_keys(module, state_dict, {key: prefix + 'mixer.' + key[len(prefix):] for key in state_dict
                                            if key.startswith(prefix)
                                            and key[len(prefix):].split('.', 1)[0] in module.mixer_keys})


class MixerHost(nn.Module):
    """A module holding a `mixer` whose state-dict entries stand at this module's level."""
    # read from Python only; TorchScript sees no class attributes of the mixer
    __jit_unused_properties__ = ['attention_name']

    @property
    def attention_name(self) -> str:
        return self.mixer.attention_name

    def mount(self, mixer: Mixer) -> None:
        """Register `mixer` last, so that its entries follow this module's own, as in the official layouts."""
        own = set(self._parameters) | set(self._buffers) | set(self._modules)
        names = frozenset(key.split('.', 1)[0] for key in mixer.state_dict())
        if own & names:
            raise ValueError(f"{type(mixer).__name__} names {sorted(own & names)} clash with {type(self).__name__}'s")
        self.mixer = mixer
        self.mixer_keys = names
        self.needs_tokens = mixer.needs_tokens
        self.register_state_dict_post_hook(_lift_mixer_keys)
        self.register_load_state_dict_pre_hook(_sink_mixer_keys)

    def __getattr__(self, name: str) -> Any:
        """The mixer's parameter, buffer or submodule also under its state-dict name (`attn.ranges` for
        `attn.mixer.ranges`), for tools that follow state-dict keys through attributes (`Module.get_parameter`,
        torch.func.functional_call). Reached only for names this module has not."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            mixer = self.__dict__.get('_modules', {}).get('mixer')
            if mixer is None or name not in self.__dict__.get('mixer_keys', ()):
                raise
            return getattr(mixer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A tensor set under the state-dict name of the mixer's parameter or buffer takes its place in the mixer,
        as torch.func.functional_call swaps tensors in and back by state-dict keys; set here, it would be an
        attribute that the mixer never reads."""
        mixer = self.__dict__.get('_modules', {}).get('mixer')
        if not (mixer is not None and isinstance(value, Tensor) and name in self.__dict__.get('mixer_keys', ())
                and set_tensor_slot(mixer, name, value)):
            super().__setattr__(name, value)

    def _fqn_modifiers(self) -> Dict[str, str]:
        """The state-dict names that skip the `mixer` module, for torch.distributed.checkpoint, which maps each
        state-dict key to its module path through this method where state-dict hooks rename keys."""
        return {name: 'mixer' for name in getattr(self, 'mixer_keys', ())}  # none where branches hold the mixers

    def _mixed(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        """The mixer's output, (B', n, C) as the queries. A mixer of one's own that leaves its heads split failed
        later, in the projection or as tokens of another grid; here its output is named with the expected shape."""
        out = self.mixer(q, k, v, ctx)
        # not while tracing or exporting: the tracer warns at every comparison of shapes it reads as tensors
        if not torch.jit.is_scripting() and not is_exporting() and out.shape != q.shape:
            self._refuse_output(out, q)
        return out

    @torch.jit.unused
    def _refuse_output(self, out: Tensor, q: Tensor) -> None:
        raise MixerContractError(
            f"attention {self.attention_name!r}: {type(self.mixer).__name__}.forward returned shape "
            f"{tuple(out.shape)} for queries of shape {tuple(q.shape)}; expected the queries' shape (B', n, C), "
            f"heads merged back (models.attention.layout.merge_heads)")


# reason: FX can't trace the control flow on the token count and grid (prefix tokens, windows, MultiMax's path)
@register_notrace_module
class GroupedAttention(MixerHost):
    """What every grouping shares: its mixer's name and heads, the output projection, the token-count check."""

    def __init__(self, dim: int, num_heads: int, grid_size: Optional[Grid]):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        if grid_size is not None and not (isinstance(grid_size, (tuple, list)) and len(grid_size) == 2
                                          and all(is_integer(side) and side > 0 for side in grid_size)):
            raise ValueError(f"grid_size {grid_size!r} must be an (H, W) pair of positive integers")
        self.grid_size: Optional[Grid] = None if grid_size is None else tuple(grid_size)

    def _finish(self, mixer: Mixer, proj_drop: float) -> None:
        self.proj = nn.Linear(self.dim, self.dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.mount(mixer)

    def _require_grid(self, what: str) -> Grid:
        if self.grid_size is None:
            raise ValueError(f"{type(self).__name__}: {what} needs grid_size=(H, W)")
        return self.grid_size

    def _output(self, x: Tensor) -> Tensor:
        return self.proj_drop(self.proj(x))

    def set_grid(self, grid: Grid) -> None:
        """Make `grid` the token grid of every call from now on, with the grid-sized tables and parameters
        resampled as a call on that grid resamples them on the fly."""
        self.grid_size = (grid[0], grid[1])
        if self.mixer.group_grid is not None:
            self.mixer.set_group_grid(self.grid_size)

    def extra_repr(self) -> str:
        return f'dim={self.dim}, num_heads={self.num_heads}'


def _prefix_tokens(size: Grid, num_tokens: int) -> int:
    """The number of tokens before the `size` grid; a ValueError when there are too few tokens for it."""
    if size[0] < 1 or size[1] < 1:
        raise ValueError(f"grid {size[0]}x{size[1]} must have positive sides")
    num_prefix = num_tokens - size[0] * size[1]
    if num_prefix < 0:
        raise ValueError(f"{num_tokens} tokens cannot hold a {size[0]}x{size[1]} grid")
    return num_prefix


def _tokens(needs_tokens: bool, x: Tensor, block_input: Optional[Tensor]) -> Optional[Tensor]:
    """The tokens a mixer that needs them summarises: the block input when the family gives it, else x."""
    if not needs_tokens:
        return None
    return x if block_input is None else block_input


class GlobalAttention(GroupedAttention):
    """All tokens attend to all: `qkv` Linear(C, 3C), the mixer, `proj`.

    `attn(x, size)`: x (B, N, C) whose last H*W tokens form the grid `size`, the others prefix tokens -> (B, N, C).
    """

    def __init__(
            self,
            mixer_cls: Type[Mixer],
            dim: int,
            num_heads: int,
            grid_size: Optional[Grid] = None,
            qkv_bias: bool = True,
            *,
            mixer_options: Optional[Mapping[str, Any]] = None,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
    ):
        super().__init__(dim, num_heads, grid_size)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self._finish(mixer_cls(dim, num_heads, self.grid_size, attn_drop=attn_drop, **(mixer_options or {})),
                     proj_drop)

    def forward(self, x: Tensor, size: Grid, block_input: Optional[Tensor] = None) -> Tensor:
        ctx = MixContext(size, _prefix_tokens(size, x.shape[1]), tokens=_tokens(self.needs_tokens, x, block_input))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self._output(self._mixed(q, k, v, ctx))


class SpatialReductionAttention(GroupedAttention):
    """PVT's attention: `q` Linear(C, C) and `kv` Linear(C, 2C), keys and values from the map reduced by a
    stride-`sr_ratio` convolution `sr` and a LayerNorm `norm` when `sr_ratio` > 1, or (PVT v2's linear
    spatial reduction, `pool_size`) average-pooled to a `pool_size` × `pool_size` map at any input size, then a
    1×1 convolution `sr`, LayerNorm `norm` and GELU; either for mixers that take reduced keys only. Then the mixer
    and `proj`. Prefix tokens are allowed without reduction.
    """

    def __init__(
            self,
            mixer_cls: Type[Mixer],
            dim: int,
            num_heads: int,
            grid_size: Optional[Grid] = None,
            qkv_bias: bool = True,
            *,
            sr_ratio: int = 1,
            pool_size: Optional[int] = None,
            mixer_options: Optional[Mapping[str, Any]] = None,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
    ):
        super().__init__(dim, num_heads, grid_size)
        if not is_integer(sr_ratio) or sr_ratio < 1:
            raise ValueError(f"sr_ratio {sr_ratio!r} must be a positive integer")
        if pool_size is not None:
            if not is_integer(pool_size) or pool_size < 1:
                raise ValueError(f"pool_size {pool_size!r} must be a positive integer")
            if sr_ratio > 1:
                raise ValueError(f"pool_size {pool_size} and sr_ratio {sr_ratio} both reduce the keys; expected one "
                                 f"of them (sr_ratio=1 with pool_size)")
            if not mixer_cls.reduces_keys:
                raise ValueError(f"{mixer_cls.attention_name} attention takes no reduced keys: pool_size "
                                 f"{pool_size} needs an attention whose mixer sets reduces_keys = True "
                                 f"(pool_size=None expected)")
        if sr_ratio > 1 and not mixer_cls.reduces_keys:
            raise ValueError(f"{mixer_cls.attention_name} attention takes no reduced keys: sr_ratio {sr_ratio} needs "
                             f"an attention whose mixer sets reduces_keys = True (sr_ratio=1 expected)")
        if sr_ratio > 1:
            gh, gw = self._require_grid('sr_ratio')
            if sr_ratio > min(gh, gw):
                raise ValueError(f"sr_ratio {sr_ratio} is larger than the {gh}x{gw} grid it reduces; expected at most "
                                 f"{min(gh, gw)}")
        self.sr_ratio = sr_ratio
        self.pool_size = pool_size
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.pool = self.act = None
        if pool_size is not None:
            self.pool = nn.AdaptiveAvgPool2d(pool_size)
            self.sr = nn.Conv2d(dim, dim, kernel_size=1)
            self.norm = nn.LayerNorm(dim)
            self.act = nn.GELU()
        elif sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)
        else:
            self.sr = self.norm = None
        self._finish(mixer_cls(dim, num_heads, self.grid_size, attn_drop=attn_drop, **(mixer_options or {})),
                     proj_drop)

    def extra_repr(self) -> str:
        reduction = f'pool_size={self.pool_size}' if self.pool_size is not None else f'sr_ratio={self.sr_ratio}'
        return f'{super().extra_repr()}, {reduction}'

    def forward(self, x: Tensor, size: Grid, block_input: Optional[Tensor] = None) -> Tensor:
        num_prefix = _prefix_tokens(size, x.shape[1])
        ctx = MixContext(size, num_prefix, tokens=_tokens(self.needs_tokens, x, block_input))
        q = self.q(x)
        if self.sr is not None:
            if num_prefix:
                raise ValueError(f"spatial reduction does not support prefix tokens, got {num_prefix} before the "
                                 f"{size[0]}x{size[1]} grid")
            image = tokens_to_image(x, size)
            if self.pool is not None:
                image = self.pool(image)
            x = self.norm(image_to_tokens(self.sr(image)))
            if self.act is not None:
                x = self.act(x)
        k, v = self.kv(x).chunk(2, dim=-1)
        return self._output(self._mixed(q, k, v, ctx))


def _resolve_window(grid: Grid, window_size: Union[int, Grid], shift_size: int) -> Tuple[Optional[Grid], int]:
    """(window, shift) for a grid, None for one window covering the grid (unshifted).

    A square `window_size` as large as the grid's short side is unshifted and shrinks to that side, as in Swin,
    where such windows tile the grid (4x4 windows on a 4x8 grid); where they do not, it is clamped side by side
    as timm clamps it (a 7x5 grid under 7x7 windows is one 7x5 window). A window never reaches past the grid; a
    grid that does not divide into windows is padded to whole ones where used.
    """
    H, W = grid
    pair = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(map(is_integer, window_size))
    if not (is_integer(window_size) or pair):
        raise ValueError(f"window_size {window_size!r} must be an integer or an (h, w) pair of integers")
    if not is_integer(shift_size):
        raise ValueError(f"shift_size {shift_size!r} must be an integer")
    if isinstance(window_size, int):
        short = min(H, W)
        window = (window_size, window_size)
        if short <= window_size:
            shift_size = 0
            tiles = H % short == 0 and W % short == 0
            window = (short, short) if tiles else (min(window_size, H), min(window_size, W))
    else:
        window = (min(window_size[0], H), min(window_size[1], W))
    if min(window) < 1:
        raise ValueError(f"window {window[0]}x{window[1]} must have positive sides")
    if not 0 <= shift_size < min(window):
        raise ValueError(f"shift_size {shift_size} must be in [0, {min(window)})")
    if window == (H, W):
        return None, 0
    return window, shift_size


def _check_no_prefix(size: Grid, num_tokens: int) -> None:
    """A ValueError when tokens come before the `size` grid, which windows and stripes cannot group."""
    num_prefix = _prefix_tokens(size, num_tokens)
    if num_prefix:
        raise ValueError(f"windowed attention does not support prefix tokens, got {num_prefix} before the "
                         f"{size[0]}x{size[1]} grid")


class WindowAttention(GroupedAttention):
    """Swin's (shifted) window attention: `qkv`, a relative position bias and the shifted-window mask for mixers
    that accept a score bias, the mixer on every window, `proj`.

    `window_size` is an int for square windows (unshifted and clamped to the grid once as large as its short
    side: 7 on a 7x7 or 7x5 grid is one window over the whole grid) or (wh, ww); odd blocks shift by
    `shift_size`. Mixers that take no score bias get neither the bias table nor the mask, but the same windows
    and shift.

    On any grid, windows keep the size and shift they were built with: the map is padded with zeros below and
    right to whole windows before the shift, as Swin does at other resolutions, and the mask is that of the
    padded grid. An attention built with one window over its whole grid stays global on every grid, its bias
    table resampled bicubically to the grid's window.
    """

    def __init__(
            self,
            mixer_cls: Type[Mixer],
            dim: int,
            num_heads: int,
            grid_size: Grid,
            qkv_bias: bool = True,
            *,
            window_size: Union[int, Grid],
            shift_size: int = 0,
            rel_pos_bias: bool = True,
            mixer_options: Optional[Mapping[str, Any]] = None,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
    ):
        super().__init__(dim, num_heads, grid_size)
        grid = self._require_grid('window_size')
        self.window, self.shift_size = _resolve_window(grid, window_size, shift_size)
        group_grid = self.window or grid
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        # no annotation: TorchScript types the attribute by its value (None, or the grid where the table is)
        self.bias_window = None
        if rel_pos_bias and mixer_cls.accepts_score_bias:
            self.bias_window = group_grid
            wh, ww = group_grid
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
            trunc_normal_(self.relative_position_bias_table, std=.02)
            self.register_buffer('relative_position_index', relative_position_index(group_grid), persistent=False)
        self.masked = bool(self.shift_size) and mixer_cls.accepts_score_bias
        self.mask_grid: Grid = grid
        if self.masked:
            self.mask_grid = padded_grid(grid, self.window)
            self.register_buffer('attn_mask', shifted_window_mask(self.mask_grid, self.window, self.shift_size),
                                 persistent=False)
        else:
            self.attn_mask = None
        self._finish(mixer_cls(dim, num_heads, group_grid, attn_drop=attn_drop, **(mixer_options or {})), proj_drop)

    def extra_repr(self) -> str:
        parts = [super().extra_repr()]
        if self.window is not None:
            parts.append(f'window={self.window}')
        if self.shift_size:
            parts.append(f'shift={self.shift_size}')
        return ', '.join(parts)

    def relative_position_bias(self, window: Optional[Grid] = None) -> Optional[Tensor]:
        """(heads, n, n) bias for the tokens of one window (the built one, or `window` from a resampled table),
        or None."""
        if self.bias_window is None:
            return None
        table, index = self.relative_position_bias_table, self.relative_position_index
        if window is not None and window != self.bias_window:
            table = resize_rel_pos_bias_table(table, window, self.bias_window)
            index = relative_position_index(window).to(index.device)
        else:
            window = self.bias_window
        n = window[0] * window[1]
        return table[index.view(-1)].view(n, n, -1).permute(2, 0, 1)

    def _mask(self, padded: Grid, x: Tensor) -> Optional[Tensor]:
        """The shifted-window mask of the `padded` grid: the built one, or one made for another grid."""
        if not self.masked or padded == self.mask_grid:
            return self.attn_mask
        return shifted_window_mask(padded, self.window, self.shift_size, x.device).to(x.dtype)

    def set_grid(self, grid: Grid) -> None:
        grid = (grid[0], grid[1])
        if self.window is None and self.bias_window is not None and grid != self.bias_window:
            table = self.relative_position_bias_table
            with torch.no_grad():
                resized = resize_rel_pos_bias_table(table, grid, self.bias_window)
            self.relative_position_bias_table = nn.Parameter(resized, requires_grad=table.requires_grad)
            self.relative_position_index = relative_position_index(grid).to(self.relative_position_index.device)
            self.bias_window = grid
        if self.masked:
            self.mask_grid = padded_grid(grid, self.window)
            self.attn_mask = shifted_window_mask(self.mask_grid, self.window, self.shift_size).to(self.attn_mask)
        else:
            self.mask_grid = grid
        if self.window is None:
            super().set_grid(grid)
        else:
            self.grid_size = grid

    @torch.jit.ignore
    def init_non_persistent_buffers(self) -> None:
        """Recompute the relative position index and the shifted-window mask where the weights are: timm's
        `reinit_non_persistent_buffers` calls it after a build on the meta device and `load_state_dict(...,
        assign=True)`, or after `to_empty()`, which leave these computed buffers on the meta device or empty."""
        weight = self.qkv.weight
        if self.bias_window is not None:
            self.relative_position_index = relative_position_index(self.bias_window).to(weight.device)
        if self.masked:
            self.attn_mask = shifted_window_mask(self.mask_grid, self.window, self.shift_size, weight.device).to(
                weight.dtype)

    def adapt_loaded_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """A bias table of another window, resized bicubically as the official fine-tuning does."""
        if name == 'relative_position_bias_table' and tensor.shape[1:] == self.relative_position_bias_table.shape[1:]:
            return resize_rel_pos_bias_table(tensor, self.bias_window)
        return tensor

    def forward(self, x: Tensor, size: Grid, block_input: Optional[Tensor] = None) -> Tensor:
        tokens = _tokens(self.needs_tokens, x, block_input)
        if self.window is None:
            ctx = MixContext(size, _prefix_tokens(size, x.shape[1]), self.relative_position_bias(size), None, tokens)
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self._output(self._mixed(q, k, v, ctx))
        _check_no_prefix(size, x.shape[1])
        padded = padded_grid(size, self.window)
        # The projections act token by token, so they commute with the grouping into windows: grouping the
        # input once moves a third of the data that grouping q, k and v would.
        ctx = MixContext(self.window, 0, self.relative_position_bias(), self._mask(padded, x),
                         None if tokens is None else self._group(tokens, size, padded))
        q, k, v = self.qkv(self._group(x, size, padded)).chunk(3, dim=-1)
        return self._ungroup(self._output(self._mixed(q, k, v, ctx)), size, padded)

    def _group(self, x: Tensor, size: Grid, padded: Grid) -> Tensor:
        """(B, H*W, C) -> (B * nW, n, C): pad to whole windows, roll by the shift, cut into windows."""
        if padded != size:
            x = pad_tokens(x, size, padded)
        if self.shift_size:
            x = roll_tokens(x, padded, -self.shift_size)
        return window_partition(x, padded, self.window)

    def _ungroup(self, x: Tensor, size: Grid, padded: Grid) -> Tensor:
        """Inverse of `_group`: (B * nW, n, C) -> (B, H*W, C)."""
        x = window_reverse(x, padded, self.window)
        if self.shift_size:
            x = roll_tokens(x, padded, self.shift_size)
        return crop_tokens(x, padded, size) if padded != size else x


def _stripe(grid: Grid, split_size: int, vertical: bool) -> Grid:
    """(wh, ww) of the vertical (full height) or horizontal (full width) stripes `split_size` wide on `grid`."""
    H, W = grid
    return (H, min(split_size, W)) if vertical else (min(split_size, H), W)


class StripeBranch(MixerHost):
    """One branch of cross-shaped attention: the mixer within stripes of already projected q, k, v, plus LePE, a
    depthwise 3x3 convolution `get_v` of V inside each stripe.

    Stripes span the grid's height (`vertical`) or width and are `split_size` wide (None: one group over the whole
    grid), on any grid: a grid whose side does not divide into stripes is padded with zeros below or right.
    """

    def __init__(self, mixer: Mixer, grid_size: Grid, split_size: Optional[int] = None, vertical: bool = True):
        super().__init__()
        self.split_size = split_size
        self.vertical = vertical
        self.grid_size: Grid = (grid_size[0], grid_size[1])
        self.window = self.stripe(self.grid_size)
        self.num_heads = mixer.num_heads
        self.get_v = nn.Conv2d(mixer.dim, mixer.dim, 3, padding=1, groups=mixer.dim)
        self.mount(mixer)

    def stripe(self, grid: Grid) -> Optional[Grid]:
        """(wh, ww) of the stripes on `grid`, None for one group over the whole grid."""
        if self.split_size is None:
            return None
        window = _stripe(grid, self.split_size, self.vertical)
        return None if window == (grid[0], grid[1]) else window

    def stripe_on(self, size: Grid) -> Optional[Grid]:
        """The stripes a call on the grid `size` takes: the built grid's, else `stripe(size)`."""
        return self.window if size == self.grid_size else self.stripe(size)

    def set_grid(self, grid: Grid) -> None:
        """Make `grid` the grid of every call, the mixer's grid-tied parameters resampled for its stripes."""
        self.grid_size = (grid[0], grid[1])
        self.window = self.stripe(self.grid_size)
        self.mixer.set_group_grid(self.window or self.grid_size)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, size: Grid, tokens: Optional[Tensor]) -> Tensor:
        """q, k, v: (B, H*W, C') over the grid `size` -> (B, H*W, C')."""
        window = self.stripe_on(size)
        if window is None:
            return self._mix(q, k, v, size, tokens)
        padded = padded_grid(size, window)
        if padded != size:
            q, k, v = (pad_tokens(t, size, padded) for t in (q, k, v))
            tokens = None if tokens is None else pad_tokens(tokens, size, padded)
        q, k, v = (window_partition(t, padded, window) for t in (q, k, v))
        tokens = None if tokens is None else window_partition(tokens, padded, window)
        out = window_reverse(self._mix(q, k, v, window, tokens), padded, window)
        return crop_tokens(out, padded, size) if padded != size else out

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, grid: Grid, tokens: Optional[Tensor]) -> Tensor:
        out = self._mixed(q, k, v, MixContext(grid, 0, tokens=tokens))
        return out + image_to_tokens(self.get_v(tokens_to_image(v, grid)))


class CrossShapedAttention(GroupedAttention):
    """CSwin's cross-shaped window attention: one `qkv` over all channels; the first half of the channels (and
    heads) attends within vertical stripes of width `split_size`, the second half within horizontal stripes,
    each branch (`attns`) adding LePE; when the stripes cover the grid a single branch takes all channels
    globally, on every grid. `proj` follows the concatenation.

    `attn(x, size, block_input)`: x (B, H*W, C) -> (B, H*W, C); mixers that need the tokens summarise
    `block_input` (the un-normalised block input) when given.
    """

    def __init__(
            self,
            mixer_cls: Type[Mixer],
            dim: int,
            num_heads: int,
            grid_size: Grid,
            qkv_bias: bool = True,
            *,
            split_size: int,
            mixer_options: Optional[Mapping[str, Any]] = None,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
    ):
        super().__init__(dim, num_heads, grid_size)
        grid = self._require_grid('split_size')
        if not is_integer(split_size) or split_size < 1:
            raise ValueError(f"split_size {split_size!r} must be a positive stripe width")
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        H, W = grid
        options = dict(attn_drop=attn_drop, **(mixer_options or {}))
        if split_size >= max(H, W):
            branches = [StripeBranch(mixer_cls(dim, num_heads, grid, **options), grid)]
        else:
            if dim % 2 or num_heads % 2:
                raise ValueError(f"two stripe branches need an even dim and num_heads, got {dim} and {num_heads}")
            branches = []
            for vertical in (True, False):
                mixer = mixer_cls(dim // 2, num_heads // 2, _stripe(grid, split_size, vertical), **options)
                branches.append(StripeBranch(mixer, grid, split_size, vertical))
        self.attns = nn.ModuleList(branches)
        self.needs_tokens = mixer_cls.needs_tokens
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    __jit_unused_properties__ = ['attention_name', 'mixer']

    @property
    def mixer(self) -> Mixer:
        return self.attns[0].mixer

    def set_grid(self, grid: Grid) -> None:
        self.grid_size = (grid[0], grid[1])
        for branch in self.attns:
            branch.set_grid(self.grid_size)

    def forward(self, x: Tensor, size: Grid, block_input: Optional[Tensor] = None) -> Tensor:
        _check_no_prefix(size, x.shape[1])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        tokens = _tokens(self.needs_tokens, x, block_input)
        if len(self.attns) == 1:
            return self._output(self.attns[0](q, k, v, size, tokens))
        outs: List[Tensor] = []
        c = q.shape[-1] // 2
        for i, branch in enumerate(self.attns):
            part = slice(i * c, (i + 1) * c)
            outs.append(branch(q[..., part], k[..., part], v[..., part], size,
                               None if tokens is None else tokens[..., part]))
        return self._output(torch.cat(outs, dim=-1))
