"""Vision transformers with swappable attention, registered with timm.

`import models` registers every family, so `timm.create_model('inline_swin_tiny')` works.
"""
from . import checkpoint
from .attention import (
    Attention, build_attention, get_attention_class, is_linear_attention, list_attentions, register_attention,
    stage_attentions,
)
from . import vit, pvt
from . import swin, cswin
