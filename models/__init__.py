"""Vision transformers with swappable attention, registered with timm.

`import models` registers every attention and family, so `timm.create_model('inline_swin_tiny')` works.
"""
from . import checkpoint
from .attention import (
    build_attention, forms_score_matrix, get_mixer_class, list_attentions, register_attention, stage_attentions,
)
from . import vit, pvt, pvt_v2
from . import swin, cswin
from . import xcit_sima
from .onednn import OneDNNLinear, convert_to_onednn
