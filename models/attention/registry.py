"""The attention registry: one name per attention, one builder for every backbone."""
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, TypeVar

from .base import Attention, CrossShapedAttention

__all__ = [
    'register_attention', 'build_attention', 'list_attentions', 'get_attention_class', 'is_linear_attention',
    'method_kwargs',
]

_ATTENTIONS: Dict[str, Type[Attention]] = {}

T = TypeVar('T', bound=Type[Attention])


def register_attention(name: str) -> Callable[[T], T]:
    """Class decorator that makes an `Attention` subclass buildable by `name`."""
    def wrap(cls: T) -> T:
        if name in _ATTENTIONS:
            raise ValueError(f"attention {name!r} is already registered by {_ATTENTIONS[name].__name__}")
        _ATTENTIONS[name] = cls
        cls.attention_name = name
        return cls
    return wrap


def list_attentions() -> List[str]:
    """Names of the registered attentions, in registration order."""
    return list(_ATTENTIONS)


def get_attention_class(name: str) -> Type[Attention]:
    """The class registered as `name`; an unknown name raises `ValueError` listing the valid ones."""
    try:
        return _ATTENTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention {name!r}; expected one of {', '.join(_ATTENTIONS)}") from None


def is_linear_attention(name: str) -> bool:
    """True when the attention's cost is linear in the number of tokens (it forms no score matrix)."""
    return get_attention_class(name).linear


def method_kwargs(name: str, **options: Any) -> Dict[str, Any]:
    """The `options` that attention `name`'s constructor takes by name (FLatten's `focusing_factor`, ...).

    A backbone offers every block the same method options; each attention gets only those it knows.
    """
    params = inspect.signature(get_attention_class(name).__init__).parameters
    return {key: value for key, value in options.items() if key in params}


def build_attention(
        name: str,
        dim: int,
        num_heads: int,
        grid_size: Optional[Tuple[int, int]] = None,
        qkv_bias: bool = True,
        *,
        split_size: Optional[int] = None,
        **kwargs,
) -> Attention:
    """Build attention `name` for `dim` channels and `num_heads` heads over a `grid_size` = (H, W) token grid.

    The module's forward is `attn(x, size)` with `x` of shape (B, N, C) whose last H*W tokens form the grid
    `size` = (H, W); the result has shape (B, N, C). Without further arguments the attention is global.

    Grouping keywords (see `Attention`): `qkv_layout`, `sr_ratio`, `window_size`, `shift_size`, `rel_pos_bias`,
    `lepe`. `split_size` builds CSwin's cross-shaped stripes: the channels are split into two branches attending
    within vertical and horizontal stripes of that width, or one global branch when the stripes cover the grid.
    Method keywords (`focusing_factor`, `kernel_size`, ...) go to the attention class.
    """
    cls = get_attention_class(name)
    if split_size is not None:
        return CrossShapedAttention(cls, dim, num_heads, grid_size, qkv_bias, split_size=split_size, **kwargs)
    return cls(dim, num_heads, grid_size, qkv_bias, **kwargs)
