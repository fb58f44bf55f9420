"""Looking inside the attentions: recorded weights mapped to the image, statistics over a data set, figures.

`record_attention` and the statistics need only the model's own dependencies; `models.analysis.plots` needs
the `analysis` extra (matplotlib, entmax, grad-cam).
"""
from .matrices import MixerWeights, attention_matrix, mixer_weights, pools_tokens
from .record import AttentionRecord, LayerAttention, Query, attention_layers, record_attention

__all__ = [
    'MixerWeights', 'attention_matrix', 'mixer_weights', 'pools_tokens', 'AttentionRecord', 'LayerAttention', 'Query',
    'attention_layers', 'record_attention',
]
