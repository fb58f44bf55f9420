"""The mixer half of an attention: how one group of tokens is mixed, apart from how the tokens were grouped.

A mixer owns its method's parameters (MultiMax's `ranges` and `ts`, InLine's `residual`, ...) and maps grouped
queries, keys and values plus a `MixContext` to the mixed values. It never sees how the groups were formed; the
grouping (`grouping.py`) owns the projections, the windows or stripes, and the tables it needs for them, and
reads the mixer's flags once, when it is built:

- `forms_scores`: the mixer forms an n×m score matrix, so its cost is quadratic in the tokens of a group
  (families give such mixers windows or reduced keys, and the others the whole grid);
- `accepts_score_bias`: a relative position bias and a shifted-window mask can be added to its scores;
- `needs_tokens`: it reads the grouped attention input itself (`MixContext.tokens`), not only q, k and v;
- `reduces_keys`: its keys and values may come from a spatially reduced map (PVT) with fewer tokens than queries.

Method options (FLatten's `focusing_factor`, ...) are the keyword-only arguments of a mixer's constructor; a
backbone passes one `attn_kwargs` dict and each mixer takes the options it declares.
"""
import contextlib
import inspect
from typing import Any, ClassVar, ContextManager, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .layout import Grid, split_heads

__all__ = ['Mixer', 'MixContext', 'MixerContractError', 'autocast_off', 'cpu_float32_kernels_apply',
           'differentiable_grads', 'is_exporting', 'is_integer', 'is_number', 'needs_grad', 'check_heads']

# Device types with an autocast mode; others (the meta device used to count parameters and FLOPs) have none to turn off.
_AUTOCAST_DEVICES = frozenset(d for d in ('cpu', 'cuda', 'xpu', 'mps', 'hpu') if torch.amp.is_autocast_available(d))


class MixerContractError(ValueError):
    """A mixer, or its attention-matrix function, returned what its contract does not allow (a tensor of another
    shape): bad input from an attention of one's own, which the command-line tools report in one line."""


def autocast_off(device: torch.device) -> ContextManager:
    """Autocast disabled on `device`'s type, for math that chooses its own precision."""
    return torch.autocast(device.type, enabled=False) if device.type in _AUTOCAST_DEVICES else contextlib.nullcontext()


@torch.jit.unused  # asked only outside TorchScript, whose compiler reaches it behind `torch.jit.is_scripting()`
def is_exporting() -> bool:
    """True while an exporter or tracer records the model as a graph of standard operators to run elsewhere:
    torch.export (and the ONNX exporter built on it), the TorchScript-based ONNX exporter and `torch.jit.trace`.
    Their graphs take no custom operator, keep a convolution's group count static (the batch may change) and lose
    in-place updates made through views (the TorchScript-based exporter). torch.export's is read from the flag
    behind `torch.compiler.is_exporting()`, as torch 2.14's tracer reads it: earlier tracers (2.11's among them)
    answer that call with True inside every `torch.compile`, which would take the exporters' paths in every
    compiled model."""
    return (getattr(torch.compiler, '_is_exporting_flag', False) or torch.onnx.is_in_onnx_export()
            or torch.jit.is_tracing())


def cpu_float32_kernels_apply(*tensors: Tensor) -> bool:
    """Whether the zoo's float32 CPU kernels (oneDNN's products, `models.onednn`) may compute on `tensors`: all
    float32 on the CPU, without CPU autocast, and not while an exporter (torch.export, ONNX) traces them, which
    takes the standard operators."""
    if is_exporting() or torch.is_autocast_enabled('cpu'):
        return False
    return all(t.device.type == 'cpu' and t.dtype == torch.float32 for t in tensors)


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will differentiate through `tensors` (None entries ignored): training rather than
    inference, for the paths that take a bias, a mask or a fused activation in inference only."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def differentiable_grads(ctx, out: Tensor, inputs: Sequence[Optional[Tensor]], grad: Tensor) -> Tuple:
    """The gradients an autograd.Function's backward pass returns under create_graph=True: through autograd of
    `out`, the function of `inputs` recomputed with autograd, so that they can be differentiated again."""
    needs = ctx.needs_input_grad[:len(inputs)]
    wanted = [t for t, need in zip(inputs, needs) if need]
    grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=True))
    return tuple(next(grads) if need else None for need in needs)


class MixContext(NamedTuple):
    """What a mixer may need besides q, k and v, for one call over B' groups of n query tokens.

    grid: (h, w) image shape of the last h*w query tokens of every group.
    num_prefix_tokens: n - h*w leading tokens outside the image (a class token).
    pos_bias: (heads, n, m) additive score bias (a relative position bias), for mixers that accept one.
    mask: (nW, n, m) additive mask of shifted windows, group g using mask[g % nW], for mixers that accept one.
    tokens: (B', n, C) grouped attention input, for mixers that need it.
    """
    grid: Grid
    num_prefix_tokens: int = 0
    pos_bias: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    tokens: Optional[Tensor] = None


def is_integer(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_heads(name: str, dim: int, num_heads: int) -> None:
    """A ValueError, naming attention `name`, unless `dim` and `num_heads` are positive Python ints and the heads
    divide the channels."""
    for what, value in (('dim', dim), ('num_heads', num_heads)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} attention: {what} {value!r} must be a positive int")
    if dim % num_heads:
        raise ValueError(f"{name} attention: dim {dim} must be a multiple of num_heads {num_heads}")


# What a method option's annotation asks of its value: (in words, test).
_OPTION_TYPES = {bool: ('true or false', lambda v: isinstance(v, bool)), int: ('an integer', is_integer),
                 float: ('a number', is_number)}


class Mixer(nn.Module):
    """Base of every registered attention's mixing.

    Args:
        dim: channels C of q, k and v (heads concatenated in channel order).
        num_heads: number of heads; C must divide by it.
        group_grid: (h, w) token grid of every group the mixer will see (the window, the stripe or the whole
            map), for mixers with parameters tied to it; None where the grouping has no fixed grid.
        attn_drop: dropout on the attention weights, for mixers that form them.
    """
    attention_name: ClassVar[str] = ''
    forms_scores: ClassVar[bool] = False
    accepts_score_bias: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False
    reduces_keys: ClassVar[bool] = False

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0.):
        super().__init__()
        check_heads(self.attention_name or type(self).__name__, dim, num_heads)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.group_grid: Optional[Grid] = None if group_grid is None else tuple(group_grid)
        self.attn_drop = attn_drop
        # attention products through oneDNN where this mixer has a path for them: `models.convert_to_onednn`
        self.onednn = False

    @classmethod
    def option_names(cls) -> Tuple[str, ...]:
        """The method options this mixer's constructor takes (its keyword-only arguments)."""
        params = inspect.signature(cls.__init__).parameters.values()
        return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @classmethod
    def take_options(cls, attn_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """The entries of `attn_kwargs` that are this mixer's options, or a ValueError for a value that is not of
        the type its annotation names (bool, int or float)."""
        params = inspect.signature(cls.__init__).parameters
        options = {}
        for key, value in (attn_kwargs or {}).items():
            if key not in params or params[key].kind is not inspect.Parameter.KEYWORD_ONLY:
                continue
            expected, valid = _OPTION_TYPES.get(params[key].annotation, ('', None))
            if valid is not None and not valid(value):
                raise ValueError(f"{cls.attention_name} attention option {key} is {value!r}; expected {expected}")
            options[key] = value
        return options

    def heads(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """q, k, v: (B', n, C) each as (B', heads, n, C / heads), the layout of the pure attention functions."""
        return split_heads(q, self.num_heads), split_heads(k, self.num_heads), split_heads(v, self.num_heads)

    def require_group_grid(self, what: str) -> Grid:
        """The fixed grid of the groups, or a ValueError saying that `what` needs one."""
        if self.group_grid is None:
            raise ValueError(f"{self.attention_name} attention: {what} needs a fixed token grid (grid_size=(H, W))")
        return self.group_grid

    def set_group_grid(self, grid: Grid) -> None:
        """Make `grid` the grid of every group from now on; mixers with parameters tied to the grid resample
        them as they would on the fly."""
        self.group_grid = (grid[0], grid[1])

    def adapt_loaded_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """A checkpoint's value for this mixer's parameter `name`, adapted to the mixer's shape where the mixer
        knows how (another resolution); by default unchanged."""
        return tensor

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        """q: (B', n, C), k and v: (B', m, C) of B' groups (m = n unless keys are reduced) -> (B', n, C)."""
        raise NotImplementedError
