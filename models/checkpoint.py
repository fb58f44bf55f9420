"""Reading checkpoint files without running pickled code, and the state-dict surgery every family shares.

`filter_checkpoint` makes any release file ready for a model: unwrapped, derived buffers dropped, every tensor of
another resolution adapted by the module that owns it (`adapt_loaded_tensor`: position embeddings, bias tables,
FLatten's positional encoding), and the keys checked on one line. `load_pretrained_into` starts a model from the
weights of another (softmax weights into another attention) and reports which keys were new.

Official InLine / FLatten / Swin training checkpoints pickle a yacs `CfgNode` under 'config'. Unpickling is
restricted to tensors and plain containers (`torch.load(weights_only=True)`); the `CfgNode` is read as the plain
`OrderedDict` it is, so no yacs code runs. The allow-list is registered with torch at import, which lets timm's
own `pretrained_cfg_overlay=dict(file=...)` loading read those files too.
"""
import argparse
import os
import pickle
import zipfile
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import timm
from timm.models import get_pretrained_cfg

__all__ = [
    'CheckpointError', 'filter_checkpoint', 'adapt_state_dict', 'load_pretrained_into', 'TransferReport',
    'SAFE_GLOBALS', 'load_checkpoint_file', 'checkpoint_state_dict', 'drop_derived_buffers',
    'check_state_dict', 'load_state_dict_checked', 'resize_grid_embedding', 'resize_rel_pos_bias_table',
]

SAFE_GLOBALS = [(OrderedDict, 'yacs.config.CfgNode'), set, argparse.Namespace]
torch.serialization.add_safe_globals(SAFE_GLOBALS)

DERIVED_BUFFERS = ('relative_position_index', 'relative_coords_table', 'attn_mask')
WRAPPER_PREFIXES = ('module.', '_orig_mod.')


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, is unsafe, or does not fit the model."""


def load_checkpoint_file(path: str, map_location: Any = 'cpu') -> Any:
    """Load a checkpoint file, refusing pickled objects outside the allow-list without running them."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist or is not a file")
    # Registered again rather than through the `safe_globals` context manager, whose exit would also remove the
    # process-wide registration that timm's own loader relies on.
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e).split('WeightsUnpickler error:')[-1].strip().splitlines()[0] if str(e) else ''
        raise CheckpointError(
            f"checkpoint {path!r} is refused: it pickles objects outside the allow-list of tensors and plain "
            f"containers ({detail})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None


def checkpoint_state_dict(checkpoint: Any, keys: Sequence[str] = ('model', 'state_dict')) -> Dict[str, Tensor]:
    """The model weights inside a checkpoint: the first of `keys` present, else the checkpoint itself.

    Wrapper prefixes ('module.' from DDP, '_orig_mod.' from torch.compile) are removed.
    """
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"expected a checkpoint dict, got {type(checkpoint).__name__}")
    for key in keys:
        if isinstance(checkpoint.get(key), Mapping):
            checkpoint = checkpoint[key]
            break
    state_dict = {}
    for name, value in checkpoint.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(f"checkpoint entry {name!r} is a {type(value).__name__}, not a tensor; "
                                  f"expected one of the keys {', '.join(keys)} or a flat state dict")
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
        state_dict[name] = value
    return state_dict


def drop_derived_buffers(state_dict: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """Remove the buffers the models recompute (relative position indices, shifted-window masks)."""
    return {k: v for k, v in state_dict.items() if k.rsplit('.', 1)[-1] not in DERIVED_BUFFERS}


def check_state_dict(
        model: nn.Module,
        state_dict: Mapping[str, Tensor],
        source: str = 'checkpoint',
        free_shape_prefixes: Sequence[str] = (),
) -> None:
    """Raise `CheckpointError` naming the missing, unexpected and mis-shaped keys, on one line.

    Keys under `free_shape_prefixes` (a classifier that the loader re-creates for another class count) may differ
    in shape.
    """
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}"
              for k in own if k in state_dict and state_dict[k].shape != own[k].shape
              and not k.startswith(tuple(free_shape_prefixes))]
    if missing or unexpected or shapes:
        parts = []
        for what, keys in (('missing', missing), ('unexpected', unexpected), ('mis-shaped', shapes)):
            if keys:
                shown = ', '.join(keys[:8]) + (f', ... ({len(keys)} in all)' if len(keys) > 8 else '')
                parts.append(f"{what}: {shown}")
        raise CheckpointError(f"{source} does not match {type(model).__name__}: " + '; '.join(parts))


def load_state_dict_checked(model: nn.Module, state_dict: Mapping[str, Tensor], source: str = 'checkpoint') -> None:
    """Strict `load_state_dict` whose error names the missing, unexpected and mis-shaped keys on one line."""
    check_state_dict(model, state_dict, source)
    model.load_state_dict(state_dict, strict=True)


def resize_grid_embedding(embedding: Tensor, new_grid: Tuple[int, int], num_prefix_tokens: int = 0) -> Tensor:
    """Bicubically resize a (1, prefix + S*S, C) embedding over a square grid to (1, prefix + H*W, C)."""
    prefix, grid = embedding[:, :num_prefix_tokens], embedding[:, num_prefix_tokens:]
    if grid.shape[1] == new_grid[0] * new_grid[1]:
        return embedding
    side = int(round(grid.shape[1] ** 0.5))
    if side * side != grid.shape[1]:
        raise CheckpointError(f"cannot resize an embedding of {grid.shape[1]} tokens: not a square grid")
    C = grid.shape[-1]
    image = grid.reshape(1, side, side, C).permute(0, 3, 1, 2).float()
    image = F.interpolate(image, size=new_grid, mode='bicubic', align_corners=False)
    grid = image.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], C).to(embedding.dtype)
    return torch.cat([prefix, grid], dim=1)


def resize_rel_pos_bias_table(table: Tensor, new_window: Tuple[int, int]) -> Tensor:
    """Bicubically resize a ((2w-1)^2, heads) relative position bias table to a new window."""
    rows = (2 * new_window[0] - 1) * (2 * new_window[1] - 1)
    if table.shape[0] == rows:
        return table
    side = int(round(table.shape[0] ** 0.5))
    heads = table.shape[1]
    image = table.T.reshape(1, heads, side, side).float()
    image = F.interpolate(image, size=(2 * new_window[0] - 1, 2 * new_window[1] - 1), mode='bicubic',
                          align_corners=False)
    return image.reshape(heads, rows).T.contiguous().to(table.dtype)


def adapt_state_dict(model: nn.Module, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Give every tensor whose shape differs from the model's to the module that owns the parameter, through its
    `adapt_loaded_tensor(name, tensor)` where it has one (another resolution, window or grid); others stay as they
    are, for the key check to name."""
    own = model.state_dict(keep_vars=True)
    owners = {id(param): (module, name) for module in model.modules()
              for name, param in module._parameters.items() if param is not None}
    for key, value in state_dict.items():
        target = own.get(key)
        if target is None or target.shape == value.shape or id(target) not in owners:
            continue
        module, name = owners[id(target)]
        adapt = getattr(module, 'adapt_loaded_tensor', None)
        if adapt is not None:
            state_dict[key] = adapt(name, value)
    return state_dict


def filter_checkpoint(
        checkpoint: Any,
        model: nn.Module,
        prepare: Callable[[Dict[str, Tensor]], Dict[str, Tensor]] = lambda state_dict: state_dict,
) -> Dict[str, Tensor]:
    """A checkpoint made ready for `model`: weights unwrapped, derived buffers dropped, `prepare` applied (a
    family's own renaming), tensors of another resolution adapted, and the keys checked (the classifier may
    differ in shape: the loader re-creates it for another class count)."""
    state_dict = prepare(drop_derived_buffers(checkpoint_state_dict(checkpoint)))
    state_dict = adapt_state_dict(model, state_dict)
    check_state_dict(model, state_dict, 'checkpoint', free_shape_prefixes=('head.',))
    return state_dict


class TransferReport(NamedTuple):
    """What `load_pretrained_into` did: keys loaded, keys of the model the source lacks (they keep their
    initialisation), and keys of the source the model has no place for or another shape for (dropped)."""
    loaded: List[str]
    new: List[str]
    dropped: List[str]

    def __str__(self) -> str:
        def shown(keys: List[str]) -> str:
            return ', '.join(keys[:8]) + (f', ... ({len(keys)} in all)' if len(keys) > 8 else '') if keys else 'none'
        return (f"loaded {len(self.loaded)} tensors; new (initialised, not loaded): {shown(self.new)}; "
                f"dropped: {shown(self.dropped)}")


def load_pretrained_into(model: nn.Module, source: str) -> TransferReport:
    """Start `model` from the weights of `source`, a checkpoint file or a registered model name whose
    pretrained weights are downloaded into timm's cache: a fine-tuning start such as softmax DeiT weights in a
    DeiT with another attention.

    Every tensor whose key and (after adaptation to the model's resolution) shape the model shares is loaded;
    the report names the model's new keys, which keep their initialisation, and the dropped ones.
    """
    if os.path.exists(source):
        checkpoint = load_checkpoint_file(source)
    else:
        if not timm.is_model(source):
            raise CheckpointError(f"pretrained source {source!r} is neither a file nor a registered model name")
        cfg = get_pretrained_cfg(source)
        url = (cfg.file or cfg.url) if cfg is not None else None
        if not url:
            raise CheckpointError(f"model {source!r} has no pretrained weights to start from")
        checkpoint = load_checkpoint_file(url) if cfg.file else torch.hub.load_state_dict_from_url(
            url, map_location='cpu', progress=True, weights_only=True, file_name=f'{source}.pth')
    state_dict = adapt_state_dict(model, drop_derived_buffers(checkpoint_state_dict(checkpoint)))
    own = model.state_dict()
    loaded = [k for k, v in state_dict.items() if k in own and own[k].shape == v.shape]
    if not loaded:
        raise CheckpointError(f"{source!r} shares no tensor with {type(model).__name__}; expected weights of the "
                              f"same family")
    model.load_state_dict({k: state_dict[k] for k in loaded}, strict=False)
    return TransferReport(loaded, [k for k in own if k not in loaded], [k for k in state_dict if k not in loaded])
