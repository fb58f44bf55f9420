"""Models saved by `timm.models.save_for_hf`, named as timm names them: `local-dir:FOLDER` or `hf-hub:REPO`."""
import os
from typing import Any, Dict, Tuple

import timm.models._hub
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

from models.checkpoint import is_hub_name

from .distributed import DistInfo, main_process_first
from .errors import UsageError

__all__ = ['HUB_WEIGHTS_FILES', 'is_hub_name', 'hub_config', 'local_weights_file', 'hub_weights_file']

# the weights files save_for_hf writes, in the order timm's loader prefers them
HUB_WEIGHTS_FILES = ('model.safetensors', 'pytorch_model.bin')


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _no_weights(setting: str, name: str, where: str) -> UsageError:
    return UsageError(f"{setting} {name!r}: the {where} holds no weights; expected {' or '.join(HUB_WEIGHTS_FILES)} "
                      f"(the files timm.models.save_for_hf writes)")


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
        raise UsageError(f"{setting} {name!r}: its config.json cannot be read ({_first_line(e)}); expected a "
                         f"{'folder' if source == 'local-dir' else 'hub repository'} written by "
                         f"timm.models.save_for_hf") from None


def local_weights_file(name: str, setting: str) -> str:
    """The weights file in the folder of `local-dir:` name `name`: model.safetensors, else pytorch_model.bin."""
    folder = name.partition(':')[2]
    for filename in HUB_WEIGHTS_FILES:
        if os.path.isfile(os.path.join(folder, filename)):
            return os.path.join(folder, filename)
    raise _no_weights(setting, name, 'folder')


def _download(name: str, setting: str) -> str:
    repository = name.partition(':')[2]
    for filename in HUB_WEIGHTS_FILES:
        try:
            return timm.models._hub.download_from_hf(repository, filename)
        except LocalEntryNotFoundError as e:  # offline, and not in the cache: another file would not be either
            raise UsageError(f"{setting} {name!r}: {filename} cannot be downloaded ({_first_line(e)})") from None
        except EntryNotFoundError:
            continue
        except OSError as e:
            raise UsageError(f"{setting} {name!r}: {filename} cannot be downloaded ({_first_line(e)})") from None
    raise _no_weights(setting, name, 'repository')


def hub_weights_file(name: str, setting: str, info: DistInfo) -> str:
    """The weights file of hub name `name` (see `local_weights_file`); from the hub, the first process of each
    node downloads it while the others wait."""
    if name.startswith('local-dir:'):
        return local_weights_file(name, setting)
    path = main_process_first(info, lambda: _download(name, setting), f"download the weights of {name!r}",
                              per_node=True)
    return path if path is not None else _download(name, setting)
