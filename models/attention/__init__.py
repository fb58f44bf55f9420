"""Swappable attentions behind one interface: `build_attention(name, dim, num_heads, grid_size)(x, size)`."""
from .base import Attention, CrossShapedAttention
from .registry import (
    build_attention, get_attention_class, is_linear_attention, list_attentions, method_kwargs, register_attention,
)
from .softmax import SoftmaxAttention, softmax_attention
from .multimax import MultiMaxAttention, multimax_attention, multimax_modulation
from .inline import InLineAttention, inline_attention, inline_local_residual
from .flatten import FocusedLinearAttention, focused_feature_map, focused_linear_attention
from .sima import SimAAttention, sima_attention
from .additive import AdditiveAttention, additive_attention
from .pattern import stage_attentions
