"""Where a model's weights come from: models saved by `timm.models.save_for_hf`, named as timm names them
(`local-dir:FOLDER` or `hf-hub:REPO`), checkpoint files, and the released weights of registered models."""
import os
from typing import Any, Dict, Optional, Tuple

import timm.models._hub

from models.checkpoint import CheckpointError, error_summary, is_hub_name, start_weights_file

from .distributed import DistInfo, each_node_first
from .errors import UsageError

__all__ = ['is_hub_name', 'hub_config', 'weights_file']


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


def _resolved(source: str, setting: str) -> str:
    try:
        return start_weights_file(source)
    except CheckpointError as e:
        if is_hub_name(source):  # its errors name the saved model; the option that gave it comes first
            raise UsageError(f"{setting} {e}") from None
        raise


def weights_file(source: str, setting: str, info: Optional[DistInfo] = None) -> str:
    """The local weights file of `source`, as `models.checkpoint.start_weights_file` finds it: a checkpoint file, a
    `local-dir:` / `hf-hub:` name, or a registered model name with released weights. What is downloaded (a hub
    repository, released weights), the first process of each node of `info`'s run downloads while the others wait
    (without `info`, this process alone). `setting`, the option that gave `source`, starts the errors of a hub
    name."""
    if info is None or os.path.isfile(source) or source.startswith('local-dir:'):
        return _resolved(source, setting)
    return each_node_first(info, lambda: _resolved(source, setting), f"download the weights of {source!r}")
