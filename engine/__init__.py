"""Training and evaluation engine: yacs configs, image-folder data, torchrun distribution, atomic checkpoints."""
from .config import ConfigError, get_default_config, load_config
from .errors import UsageError

__all__ = ['ConfigError', 'UsageError', 'get_default_config', 'load_config']
