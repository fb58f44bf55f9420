"""Swappable attentions behind one interface: `build_attention(name, dim, num_heads, grid_size, grouping=...)`.

An attention is a grouping (`grouping.py`: global, spatial reduction, shifted windows, cross-shaped stripes) times
a mixer (one file per method, registered by name). Every module of this package is imported here, so a new
mixer file registers itself without further edits.
"""
import importlib
import pkgutil

__all__ = [
    'Grid', 'Mixer', 'MixContext', 'autocast_off', 'GroupedAttention', 'GlobalAttention', 'SpatialReductionAttention',
    'WindowAttention', 'StripeBranch', 'CrossShapedAttention', 'GROUPINGS', 'build_attention', 'check_attn_kwargs',
    'forms_score_matrix', 'get_mixer_class', 'list_attention_options', 'list_attentions', 'register_attention',
    'stage_attentions', 'UnknownAttentionError', 'MixerContractError',
]

from .layout import Grid
from .mixer import MixContext, Mixer, MixerContractError, autocast_off
from .grouping import (
    CrossShapedAttention, GlobalAttention, GroupedAttention, SpatialReductionAttention, StripeBranch,
    WindowAttention,
)
from .registry import (
    GROUPINGS, UnknownAttentionError, build_attention, check_attn_kwargs, forms_score_matrix, get_mixer_class,
    list_attention_options, list_attentions, register_attention,
)
from .pattern import stage_attentions
# The backbones' native attention first, then the others in the order the README presents them; any other
# module of the package (a new mixer file) registers itself after them.
from . import softmax, multimax, inline, flatten, sima, additive

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f'{__name__}.{_module.name}')
