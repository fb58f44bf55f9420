"""Training and evaluation engine: yacs configs, image-folder data, torchrun distribution, atomic checkpoints.

The package's names load on first use, so that `engine.startup` runs before torch does."""
import importlib
from typing import Any

__all__ = ['ConfigError', 'UsageError', 'get_default_config', 'load_config']
_MODULE_OF = {'ConfigError': 'config', 'get_default_config': 'config', 'load_config': 'config', 'UsageError': 'errors'}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f'.{_MODULE_OF[name]}', __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
