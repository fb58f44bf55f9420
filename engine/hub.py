"""Models saved by `timm.models.save_for_hf`, named as timm names them: `local-dir:FOLDER` or `hf-hub:REPO`."""
from typing import Any, Dict, Optional, Tuple

import timm.models._hub

from models.checkpoint import CheckpointError, error_summary, hub_weights_file as _hub_weights_file, is_hub_name

from .distributed import DistInfo, each_node_first
from .errors import UsageError

__all__ = ['is_hub_name', 'hub_config', 'hub_weights_file']


def hub_config(name: str, setting: str) -> Tuple[Dict[str, Any], str, Dict[str, Any]]:
    """(pretrained config, architecture, constructor arguments) from the config.json of hub name `name`, read as
    timm reads it; `setting` (the option that gave the name) starts the one-line error where it cannot be read."""
    source, _, location = name.partition(':')
    try:
        # timm's own reader (private to timm.models._hub) parses every layout of config.json that timm has written
        if source == 'local-dir':
            return timm.models._hub.load_model_config_from_path(location)
        return timm.models._hub.load_model_config_from_hf(location)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{setting} {name!r}: its config.json cannot be read ({error_summary(e)}); expected a "
                         f"{'folder' if source == 'local-dir' else 'hub repository'} written by "
                         f"timm.models.save_for_hf") from None


def _weights_file(name: str, setting: str) -> str:
    try:
        return _hub_weights_file(name)
    except CheckpointError as e:
        raise UsageError(f"{setting} {e}") from None


def hub_weights_file(name: str, setting: str, info: Optional[DistInfo] = None) -> str:
    """The weights file of hub name `name`, the one timm reads (`models.checkpoint.hub_weights_file`); from the
    hub, the first process of each node of `info`'s run downloads it while the others wait (without `info`, this
    process alone). `setting` (the option that gave the name) starts the one-line error where there is none."""
    if info is None or name.startswith('local-dir:'):
        return _weights_file(name, setting)
    return each_node_first(info, lambda: _weights_file(name, setting), f"download the weights of {name!r}")
