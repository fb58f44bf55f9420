"""The attention registry: one name per mixer, one builder that joins any mixer with any grouping.

The registry is the single list of attentions: families build every block from it, and the entrypoints, the
benchmark, the zoo table and the tests iterate it.
"""
import ast
import difflib
import inspect
import re
import textwrap
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Type, TypeVar

from .causal import check_causal_grouping
from .grouping import (
    CrossShapedAttention, GlobalAttention, GroupedAttention, SpatialReductionAttention, WindowAttention,
)
from .layout import Grid
from .mixer import Mixer, check_heads

__all__ = [
    'UnknownAttentionError', 'register_attention', 'build_attention', 'list_attentions', 'get_mixer_class',
    'forms_score_matrix', 'list_attention_options', 'check_attn_kwargs', 'GROUPINGS',
]

_MIXERS: Dict[str, Type[Mixer]] = {}

# How tokens can be grouped, by name; `build_attention(grouping=...)` passes its keywords to the class.
GROUPINGS: Dict[str, Type[GroupedAttention]] = {
    'global': GlobalAttention,
    'reduction': SpatialReductionAttention,
    'window': WindowAttention,
    'stripes': CrossShapedAttention,
}

T = TypeVar('T', bound=Type[Mixer])


class UnknownAttentionError(ValueError):
    """An attention name that is not registered (yet: an attention of the user's own registers when its module is
    imported); `name` is the name given."""

    def __init__(self, message: str, name: Any = None):
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> Tuple[type, Tuple[str, Any]]:  # pickled with its name (processes, deepcopy)
        return type(self), (str(self), self.name)


def close_attention_name(name: Any) -> str:
    """"did you mean 'softmax'?" for a name close to a registered one (a typo, not another word around it: not
    'hot_softmax'), else ''."""
    close = difflib.get_close_matches(str(name), list(_MIXERS), n=1, cutoff=0.85)
    return f"did you mean {close[0]!r}?" if close else ''


# MixContext fields the groupings fill only for mixers whose flag asks for them; None for the others
_CONTEXT_FLAGS = {'tokens': 'needs_tokens', 'pos_bias': 'accepts_score_bias', 'mask': 'accepts_score_bias'}


def _unflagged_context_reads(cls: Type[Mixer]) -> List[str]:
    """The MixContext fields `cls.forward` reads by name from its context argument that the groupings leave None
    under the class's flags; none where the source is not available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return []
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(function.args.args) < 5:
        return []
    context = function.args.args[4].arg
    read = {node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == context}
    return [field for field, flag in _CONTEXT_FLAGS.items() if field in read and not getattr(cls, flag)]

# the arguments every grouping passes a mixer's constructor; the others are its method options
_MIXER_ARGUMENTS = ('dim', 'num_heads', 'group_grid', 'attn_drop')


def register_attention(name: str) -> Callable[[T], T]:
    """Class decorator that makes a `Mixer` subclass buildable by `name` in every grouping and family.

    `name` is a lower-case identifier (it starts the families' model names, `{name}_deit_tiny`, and the official
    pattern strings are upper-case); the class overrides `forward(q, k, v, ctx)` and its constructor takes
    `Mixer`'s arguments, (dim, num_heads, group_grid, attn_drop=...), with its method options keyword-only."""
    if not isinstance(name, str) or not re.fullmatch(r'[a-z][a-z0-9_]*', name):
        raise ValueError(f"attention name {name!r}: expected a lower-case identifier such as 'cosine' (letters, "
                         f"digits and '_', a letter first), which starts its model names ('cosine_deit_tiny')")

    def wrap(cls: T) -> T:
        if name in _MIXERS:
            raise ValueError(f"attention {name!r} is already registered by {_MIXERS[name].__name__}")
        if not inspect.isclass(cls) or not issubclass(cls, Mixer):
            raise TypeError(f"attention {name!r}: {getattr(cls, '__name__', repr(cls))} must be a class that "
                            f"subclasses models.attention.Mixer")
        if _MIXERS.get(cls.attention_name) is cls:
            raise ValueError(f"attention {name!r}: {cls.__name__} is registered as {cls.attention_name!r} already; "
                             f"expected a subclass of it for a second name")
        if cls.forward is Mixer.forward:
            raise TypeError(f"attention {name!r}: {cls.__name__} defines no forward(q, k, v, ctx); expected one that "
                            f"maps (B', n, C) queries and (B', m, C) keys and values to (B', n, C)")
        try:
            inspect.signature(cls.forward).bind(None, 'q', 'k', 'v', 'ctx')
        except TypeError as e:
            raise TypeError(f"attention {name!r}: {cls.__name__}.forward cannot take the groupings' (q, k, v, ctx) "
                            f"({e}); expected forward(self, q, k, v, ctx)") from None
        unflagged = _unflagged_context_reads(cls)
        if unflagged:
            flag = _CONTEXT_FLAGS[unflagged[0]]
            raise TypeError(f"attention {name!r}: {cls.__name__}.forward reads ctx.{unflagged[0]}, which the groupings "
                            f"give only to mixers that declare it; expected the class attribute {flag} = True")
        try:
            constructor = inspect.signature(cls)
            constructor.bind(8, 2, None, attn_drop=0.)
        except TypeError as e:
            raise TypeError(f"attention {name!r}: {cls.__name__}'s constructor cannot take the groupings' "
                            f"(dim, num_heads, group_grid, attn_drop=...) ({e}); expected Mixer's arguments, "
                            f"with method options keyword-only") from None
        # an option that is not keyword-only is no option: attn_kwargs and the families would never pass it
        positional = [p.name for p in constructor.parameters.values() if p.name not in _MIXER_ARGUMENTS
                      and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if positional:
            raise TypeError(f"attention {name!r}: {cls.__name__}'s constructor argument {positional[0]!r} is not "
                            f"keyword-only, so it cannot be a method option; expected it after a bare * "
                            f"(__init__(self, dim, num_heads, group_grid=None, attn_drop=0., *, {positional[0]}=...))")
        _MIXERS[name] = cls
        cls.attention_name = name
        return cls
    return wrap


def list_attentions() -> List[str]:
    """Names of the registered attentions, in registration order."""
    return list(_MIXERS)


def get_mixer_class(name: str) -> Type[Mixer]:
    """The mixer class registered as `name`; an unknown name raises `ValueError` listing the valid ones."""
    try:
        return _MIXERS[name]
    except (KeyError, TypeError):
        close = close_attention_name(name)
        raise UnknownAttentionError(f"unknown attention {name!r}{f' ({close})' if close else ''}; expected one of "
                                    f"{', '.join(_MIXERS)}", name) from None


def forms_score_matrix(name: str) -> bool:
    """True when attention `name` forms a score matrix, so its cost grows with the square of the tokens of a group."""
    return get_mixer_class(name).forms_scores


def list_attention_options() -> Dict[str, List[str]]:
    """Every method option any registered attention takes, with the attentions that take it."""
    options: Dict[str, List[str]] = {}
    for name, cls in _MIXERS.items():
        for option in cls.option_names():
            options.setdefault(option, []).append(name)
    return options


def check_attn_kwargs(names: Iterable[str], attn_kwargs: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """`attn_kwargs` as a dict, or a ValueError naming an option that none of the attentions `names` takes."""
    if attn_kwargs is not None and not isinstance(attn_kwargs, Mapping):
        raise ValueError(f"attn_kwargs {attn_kwargs!r} is not a dict; expected a dict of method options, e.g. "
                         f"dict(focusing_factor=3)")
    attn_kwargs = dict(attn_kwargs or {})
    names = sorted(set(names))
    taken = {option for name in names for option in get_mixer_class(name).option_names()}
    unknown = [key for key in attn_kwargs if key not in taken]
    if unknown:
        raise ValueError(f"attn_kwargs {unknown[0]!r} is not an option of the model's attention ({', '.join(names)}); "
                         f"expected one of: {', '.join(sorted(taken)) or 'none (they take no options)'}")
    return attn_kwargs


def build_attention(
        name: str,
        dim: int,
        num_heads: int,
        grid_size: Optional[Grid] = None,
        qkv_bias: bool = True,
        *,
        grouping: str = 'global',
        attn_kwargs: Optional[Mapping[str, Any]] = None,
        attn_drop: float = 0.,
        proj_drop: float = 0.,
        **grouping_kwargs: Any,
) -> GroupedAttention:
    """Attention `name` in `grouping`, for `dim` channels and `num_heads` heads over a `grid_size` = (H, W) grid.

    The module's forward is `attn(x, size)` with `x` (B, N, C) whose last H*W tokens form the grid `size` = (H, W);
    the result has shape (B, N, C).

    Groupings and their keywords: 'global' (prefix tokens allowed), 'reduction' (`sr_ratio`, `pool_size`), 'window'
    (`window_size`, `shift_size`, `rel_pos_bias`), 'stripes' (`split_size`). `attn_kwargs` holds method options;
    the mixer takes those it declares, so one dict serves models that mix several attentions. `causal=True`
    needs one sequence of tokens: the 'global' grouping, or 'reduction' with sr_ratio=1.
    """
    cls = get_mixer_class(name)
    check_heads(name, dim, num_heads)  # before the grouping's projections are built with them
    try:
        grouping_cls = GROUPINGS[grouping]
    except (KeyError, TypeError):
        raise ValueError(f"unknown grouping {grouping!r}; expected one of {', '.join(GROUPINGS)}") from None
    params = inspect.signature(grouping_cls.__init__).parameters
    for key in grouping_kwargs:
        if key not in params or key in ('mixer_cls', 'mixer_options'):
            keywords = [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY and p != 'mixer_options']
            raise ValueError(f"grouping {grouping!r} takes no keyword {key!r}; expected one of {', '.join(keywords)}")
    known = list_attention_options()
    for key in attn_kwargs or {}:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ''
            raise ValueError(f"attn_kwargs {key!r} is not an option of any attention; {hint}expected one of: "
                             f"{', '.join(sorted(known))}")
    options = cls.take_options(attn_kwargs)
    if (attn_kwargs or {}).get('causal'):
        if 'causal' not in options:  # one dict serves several attentions, but a model is causal only if all are
            raise ValueError(f"{name} attention takes no causal option, so it cannot serve causal=True")
        check_causal_grouping(grouping, grouping_kwargs)
    return grouping_cls(cls, dim, num_heads, grid_size, qkv_bias, mixer_options=options,
                        attn_drop=attn_drop, proj_drop=proj_drop, **grouping_kwargs)
