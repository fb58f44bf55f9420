"""Downloading released weights, reading checkpoint files without running pickled code, and the state-dict surgery
every family shares.

`download_checkpoint` fetches released weights into timm's cache under a real file name, atomically and once, and
fails on one line; the families use it for the release URLs without a file name, which timm's own download cannot
cache. `filter_checkpoint` makes any release file ready for a model: unwrapped, derived buffers dropped, every
tensor of another resolution adapted by the module that owns it (`adapt_loaded_tensor`: position embeddings, bias
tables, FLatten's positional encoding), and the keys checked on one line. `load_pretrained_into` starts a model
from the weights of another (softmax weights into another attention) and reports which keys were new.

Official InLine / FLatten / Swin training checkpoints pickle a yacs `CfgNode` under 'config'. Unpickling is
restricted to tensors and plain containers (`torch.load(weights_only=True)`); the `CfgNode` is read as the plain
`OrderedDict` it is, so no yacs code runs. The allow-list is registered with torch at import, which lets timm's
own `pretrained_cfg_overlay=dict(file=...)` loading read those files too.
"""
import argparse
import functools
import hashlib
import http.client
import logging
import os
import pickle
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import timm
import timm.models._hub
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError
from timm.data import ImageNetInfo
from timm.layers import resample_abs_pos_embed
from timm.models import get_arch_pretrained_cfgs, get_pretrained_cfg, split_model_name_tag
from tqdm import tqdm

from ._files import process_alive, remove_left_by_dead_processes

__all__ = [
    'CheckpointError', 'DownloadError', 'checkpoint_cache_dir', 'cached_file_name', 'download_checkpoint',
    'process_alive', 'HUB_SOURCES', 'is_hub_name', 'hub_weights_file', 'start_weights_file',
    'unknown_pretrained_tag', 'has_released_weights', 'released_weights_file', 'official_keys', 'set_tensor_slot',
    'filter_checkpoint', 'adapt_state_dict', 'IMAGENET22K_CLASSES', 'imagenet1k_classes',
    'imagenet1k_rows_of_imagenet22k', 'narrow_imagenet22k_classifier', 'load_pretrained_into',
    'load_shared_weights', 'TransferReport', 'SAFE_GLOBALS', 'load_checkpoint_file', 'MODEL_KEYS', 'EMA_KEYS',
    'PRETRAINED_KEYS', 'file_weights_keys', 'checkpoint_state_dict', 'held_weights', 'error_summary',
    'rename_loaded_keys', 'loaded_key_names', 'is_derived_buffer', 'drop_derived_buffers', 'check_state_dict',
    'load_state_dict_checked', 'resample_grid_embedding', 'resize_grid_embedding', 'resize_rel_pos_bias_table',
]

SAFE_GLOBALS = [(OrderedDict, 'yacs.config.CfgNode'), set, argparse.Namespace]
# the `source` of the pretrained cfg timm builds for a model saved by timm.models.save_for_hf, and the prefix of its
# model name
HUB_SOURCES = ('local-dir', 'hf-hub')
torch.serialization.add_safe_globals(SAFE_GLOBALS)
_logger = logging.getLogger(__name__)

DERIVED_BUFFERS = ('relative_position_index', 'relative_coords_table', 'attn_mask')
WRAPPER_PREFIXES = ('module.', '_orig_mod.')
# Where a checkpoint keeps its model weights, and its EMA weights: ours, DeiT's and Swin's, timm's train.py.
MODEL_KEYS = ('model', 'state_dict')
EMA_KEYS = ('model_ema', 'state_dict_ema')
# Where pretrained weights are taken from, in timm's order (`create_model(pretrained=True)` reads a weights file
# with `load_state_dict(use_ema=True)`): the EMA weights of a file that holds both. The CSWin releases are such
# files, and the CSWin code evaluates their EMA weights (its `--model-ema` cannot be turned off).
PRETRAINED_KEYS = ('state_dict_ema', 'model_ema', 'state_dict', 'model')
# Seconds a connection attempt or a read may stall before the download is given up.
DOWNLOAD_TIMEOUT_S = 60.
DOWNLOAD_CHUNK = 1 << 20
# How a torch checkpoint begins: a zip archive, or (before torch 1.6) a pickle of protocol 2 or higher.
CHECKPOINT_MAGIC = (b'PK\x03\x04', b'\x80')


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint file that cannot be read, is unsafe, or does not fit the model: a RuntimeError, as torch's
    strict `load_state_dict` raises where timm loads, and a ValueError, as bad input."""


class DownloadError(CheckpointError):
    """Released weights that could not be downloaded: unreachable host, HTTP error or a cut-off transfer."""


def error_summary(error: BaseException) -> str:
    """'<type>: <first line of its message>' (the type alone without a message), for a one-line error."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def checkpoint_cache_dir(cache_dir: Optional[str] = None) -> str:
    """The folder of downloaded weights: `cache_dir`, else `<torch hub dir>/checkpoints` (under TORCH_HOME), the
    folder timm and torch.hub download into."""
    return str(cache_dir) if cache_dir else os.path.join(torch.hub.get_dir(), 'checkpoints')


def cached_file_name(name: str, url: str) -> str:
    """The cache file name of model `name`'s weights at `url`: the URL's own file name where it has one (as
    torch.hub names it, so both share the file), with the URL's hash where a query tells files of one path apart
    (`get?f=a`, `get?f=b`); else `<architecture>.pth` for the registered URL of its default weights (with or without
    their tag in `name`) and `<name>-<hash>.pth` for another, so that a URL of the user's own never reads the
    registered weights from the cache."""
    parsed = urllib.parse.urlparse(url)
    base = os.path.basename(parsed.path)
    digest = hashlib.sha256(url.encode()).hexdigest()[:8]
    if base and parsed.query:
        stem, extension = os.path.splitext(base)
        return f'{stem}-{digest}{extension}'
    if base:
        return base
    architecture, _ = split_model_name_tag(name)
    cfg = get_pretrained_cfg(architecture) if timm.is_model(architecture) else None
    if cfg is not None and cfg.url == url:
        return f'{architecture}.pth'
    return f'{name}-{digest}.pth'


def _download_failure(error: BaseException) -> str:
    """What went wrong in a download, in a few words."""
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return f"host unreachable: {error.reason}"
    if isinstance(error, TimeoutError):
        return f"no answer within {DOWNLOAD_TIMEOUT_S:.0f} s"
    if isinstance(error, http.client.IncompleteRead):
        return f"connection closed after {len(error.partial)} more bytes, {error.expected} short"
    return error_summary(error)


def _remove_stale_partials(folder: str, file_name: str) -> None:
    """Remove the partial downloads of `file_name` left by processes of this host that were killed (SIGKILL, or
    SIGTERM, whose default action runs no clean-up) and not written for ten read timeouts; those of live processes,
    of other hosts that share the folder, and of writers in other PID namespaces (which still write) stay."""
    remove_left_by_dead_processes(
        folder, re.compile(re.escape(f'{file_name}.{socket.gethostname()}.') + r'(\d+)\.[0-9a-f]{8}\.partial$'),
        unchanged_s=10 * DOWNLOAD_TIMEOUT_S)


def _unwritable(folder: str, error: OSError) -> 'DownloadError':
    return DownloadError(f"cannot write the download folder {folder!r} ({error_summary(error)}); expected a folder "
                         f"this user can write, with room for the file (TORCH_HOME sets it, or cache_dir=)")


def download_checkpoint(url: str, file_name: str, cache_dir: Optional[str] = None, progress: bool = True) -> str:
    """The cached copy of `url` as `file_name` in the download folder (`checkpoint_cache_dir`), downloaded first
    when it is not there yet, with a progress bar on stderr when `progress`.

    The bytes go to a temporary file in the same folder that replaces the cached name only once complete (its
    length checked against the server's), so an interrupted download leaves nothing behind (the temporary file of
    a killed process is removed by a later download of the file on its host, `_remove_stale_partials`) and
    concurrent downloads (one per process) each land whole. Any failure is a `DownloadError` on one line.
    """
    folder = checkpoint_cache_dir(cache_dir)
    path = os.path.join(folder, file_name)
    if os.path.isfile(path):
        return path
    hint = (f"without network access, download it where you can and load it with "
            f"pretrained_cfg_overlay=dict(file=...) (eval.py: --checkpoint FILE, train.py: --pretrained FILE), "
            f"or copy it to {path}")
    # named before it is made, so that the `finally` removes it whenever an interruption comes
    partial = os.path.join(folder, f'{file_name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial')
    try:
        try:
            os.makedirs(folder, exist_ok=True)
            _remove_stale_partials(folder, file_name)
            out = open(partial, 'xb')
        except OSError as e:
            raise _unwritable(folder, e) from None
        with out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            length = response.headers.get('Content-Length')
            expected = int(length) if length and length.isdigit() else None
            received = 0
            with tqdm(total=expected, unit='B', unit_scale=True, unit_divisor=1024, desc=file_name,
                      disable=not progress) as bar:
                while chunk := response.read(DOWNLOAD_CHUNK):
                    try:
                        out.write(chunk)
                    except OSError as e:
                        raise _unwritable(folder, e) from None
                    received += len(chunk)
                    bar.update(len(chunk))
        if not os.path.exists(partial) and os.path.isfile(path):  # removed by a process that then cached the file
            return path
        if expected is not None and received != expected:
            raise DownloadError(f"cannot download {url}: the connection closed after {received} of {expected} "
                                f"bytes; {hint}")
        # read whole before it is cached: a server that announces no length, or a wrong one, can cut the file
        # short unnoticed, and a web page or another archive can stand in for it
        try:
            load_checkpoint_file(partial, shown_as=f"the file received ({received} bytes)")
        except CheckpointError as e:
            raise DownloadError(f"cannot download {url}: {e}; {hint}") from None
        os.replace(partial, path)
    except (OSError, http.client.HTTPException, ValueError) as e:
        if isinstance(e, DownloadError):
            raise
        raise DownloadError(f"cannot download {url} ({_download_failure(e)}); {hint}") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def unknown_pretrained_tag(name: str) -> Optional[str]:
    """For a registered model `name` whose pretrained tag (after the dot) timm does not know, one line that says so
    and lists the known ones; None otherwise."""
    architecture, tag = split_model_name_tag(name)
    known = list(get_arch_pretrained_cfgs(architecture)) if tag else []
    if not tag or name in known:
        return None
    return (f"unknown pretrained tag {tag!r} of {architecture!r}; expected {', '.join(known) or 'no tag'}, or the name "
            f"without a tag")


def has_released_weights(name: str) -> bool:
    """Whether registered model `name`'s pretrained cfg gives weights `released_weights_file` can fetch: a `file`,
    a hub repository or a `url`."""
    if unknown_pretrained_tag(name):
        return False
    cfg = get_pretrained_cfg(name)
    return cfg is not None and bool(cfg.file or cfg.hf_hub_id or cfg.url)


def released_weights_file(name: str) -> str:
    """A local file of registered model `name`'s released weights, from where `timm.create_model(name,
    pretrained=True)` takes them: its cfg's `file`; else its hub repository (timm's own models), downloaded into
    the hub's cache; else its `url` (this zoo's releases), downloaded into timm's cache by `download_checkpoint`."""
    if not timm.is_model(name):
        raise CheckpointError(f"model {name!r} is not registered with timm; expected a model name")
    tag_problem = unknown_pretrained_tag(name)
    if tag_problem:
        raise CheckpointError(tag_problem)
    if not has_released_weights(name):
        raise CheckpointError(f"model {name!r} has no released weights; expected a checkpoint file of your own "
                              f"(eval.py: --checkpoint FILE, train.py: --pretrained FILE)")
    cfg = get_pretrained_cfg(name)
    if cfg.file:
        return cfg.file
    if cfg.hf_hub_id:
        offline = ("; without network access, download it where you can and give the file (eval.py: --checkpoint "
                   "FILE, train.py: --pretrained FILE)")
        return _downloaded_weights_file(f"the released weights of {name!r} (hub repository {cfg.hf_hub_id!r})",
                                        cfg.hf_hub_id, _hub_filenames(cfg.hf_hub_filename), offline)
    return download_checkpoint(cfg.url, cached_file_name(name, cfg.url))


def _refusal(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, without its advice: allow-listing the global or loading with
    `weights_only=False` would run the file's code."""
    detail = str(error).split('WeightsUnpickler error:')[-1].strip()
    detail = detail.splitlines()[0] if detail else 'no detail'
    return detail.split(' Please ')[0].rstrip('.')


def _is_safetensors(head: bytes) -> bool:
    """Whether a file's first 9 bytes open a safetensors file: the JSON header's length (8 bytes, little-endian),
    then the header's opening brace."""
    return len(head) == 9 and head[8:9] == b'{' and int.from_bytes(head[:8], 'little') > 1


def load_checkpoint_file(path: str, map_location: Any = 'cpu', shown_as: Optional[str] = None) -> Any:
    """Load a checkpoint file, refusing pickled objects outside the allow-list without running them.

    A safetensors file (weights as the Hugging Face hub keeps them) loads as its flat state dict. A file that
    begins as neither (an image, a text file) is named as such before any unpickling. `shown_as` names the file
    in the errors instead of its path.
    """
    what = shown_as or f"checkpoint {path!r}"
    if not os.path.isfile(path):
        raise CheckpointError(f"{what} does not exist or is not a file")
    try:
        return _read_checkpoint_file(path, map_location, what, shown_as or repr(path))
    except CheckpointError as e:
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(checkpoint_cache_dir()):
            raise
        # downloads land whole or not at all, but a file copied into the cache by hand, or by another tool, may not
        raise CheckpointError(f"{e}; it is in the download cache: delete it, and the next use downloads it "
                              f"again") from None


def _read_checkpoint_file(path: str, map_location: Any, what: str, named: str) -> Any:
    """`load_checkpoint_file` of the existing file `path`, named `what` (`named` where it is no checkpoint)."""
    try:
        with open(path, 'rb') as f:
            head = f.read(9)
    except OSError as e:
        raise CheckpointError(f"{what} cannot be read ({e.strerror})") from None
    if _is_safetensors(head):
        try:
            return safetensors.torch.load_file(path, device=str(map_location))
        except (safetensors.SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{what} is truncated or corrupt ({error_summary(e)})") from None
    if not head.startswith(CHECKPOINT_MAGIC):
        start = f"starts with {head[:8]!r}" if head else "is empty"
        raise CheckpointError(f"{named} is not a checkpoint: it {start}; expected a file written by torch.save (a "
                              f"zip archive or a pickle) or a safetensors file")
    # Registered again rather than through the `safe_globals` context manager, whose exit would also remove the
    # process-wide registration that timm's own loader relies on.
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
    try:
        with warnings.catch_warnings():
            # a pickle of another protocol than torch writes: refused below, on one line
            warnings.filterwarnings('ignore', message='Detected pickle protocol')
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{what} is refused: it pickles objects outside the allow-list of tensors and plain "
            f"containers ({_refusal(e)}); nothing of it ran") from None
    except MemoryError:
        raise
    except Exception as e:  # a damaged pickle fails in the unpickler with any error: KeyError, IndexError, ...
        raise CheckpointError(f"{what} is truncated or corrupt ({error_summary(e)})") from None


def _weights_key(checkpoint: Mapping[str, Any], keys: Sequence[str]) -> Optional[str]:
    """The key `checkpoint_state_dict` takes the weights from: the first of `keys`, then of `EMA_KEYS`, that holds a
    mapping; None for a flat state dict."""
    return next((key for key in (*keys, *EMA_KEYS) if isinstance(checkpoint.get(key), Mapping)), None)


def file_weights_keys(checkpoint: Any) -> Tuple[str, ...]:
    """Where the loaded contents of a checkpoint file give their weights from: one of this engine's training
    checkpoints (its config kept as YAML text) its model weights (`MODEL_KEYS`); any other file (a release, an
    official or timm training file) the weights its release gives (`PRETRAINED_KEYS`: the EMA weights of one that
    holds both, as timm's `load_checkpoint` reads it), so that a release copied by hand gives its download's."""
    ours = isinstance(checkpoint, Mapping) and isinstance(checkpoint.get('config'), str)
    return MODEL_KEYS if ours else PRETRAINED_KEYS


def held_weights(checkpoint: Any, keys: Sequence[str] = MODEL_KEYS) -> str:
    """Which weights `checkpoint_state_dict(checkpoint, keys)` gives: 'ema' (under one of `EMA_KEYS`) or 'model'."""
    return 'ema' if isinstance(checkpoint, Mapping) and _weights_key(checkpoint, keys) in EMA_KEYS else 'model'


def _with_article(type_name: str) -> str:
    return f"{'an' if type_name[0].lower() in 'aeiou' else 'a'} {type_name}"


def checkpoint_state_dict(checkpoint: Any, keys: Sequence[str] = MODEL_KEYS,
                          source: str = 'the checkpoint') -> Dict[str, Tensor]:
    """The model weights inside a checkpoint: the first of `keys` present, else the first of `EMA_KEYS` (a file of
    EMA weights alone, as some releases are), else the checkpoint itself; `source` names it in the errors.

    Wrapper prefixes ('module.' from DDP, '_orig_mod.' from torch.compile) are removed.
    """
    held_under = ', '.join(dict.fromkeys([*keys, *EMA_KEYS]))
    expected = f"expected a flat state dict of tensors or one under the key {held_under}"
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"{source} holds {_with_article(type(checkpoint).__name__)}; {expected}")
    key = _weights_key(checkpoint, keys)
    if key is not None:
        checkpoint = checkpoint[key]
    state_dict = {}
    for name, value in checkpoint.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(f"{source} holds {name!r}, {_with_article(type(value).__name__)}, beside its "
                                  f"tensors; {expected}")
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
        state_dict[name] = value
    return state_dict


# For each module, the keys its load-state-dict pre-hooks renamed in the loads through it: a new key -> the key it
# had, so that a model names unexpected keys as the loaded state dict named them
_LOAD_RENAMES: 'weakref.WeakKeyDictionary[nn.Module, Dict[str, str]]' = weakref.WeakKeyDictionary()


def set_tensor_slot(module: nn.Module, name: str, value: Tensor) -> bool:
    """Put `value` in the parameter or buffer slot `name` of `module`, as torch.func.functional_call swaps tensors in
    and back (a plain tensor in a parameter's slot included); False where `module` has no such slot."""
    for slots in (module._parameters, module._buffers):
        if name in slots:
            slots[name] = value
            return True
    return False


def rename_loaded_keys(module: nn.Module, state_dict: Dict[str, Any], renames: Mapping[str, str]) -> None:
    """In a load-state-dict pre-hook of `module`: move each entry of `state_dict` from a key of `renames` to the key
    it maps to, remembering the key it had (`loaded_key_names`)."""
    for key, new_key in renames.items():
        state_dict[new_key] = state_dict.pop(key)
    if renames:
        _LOAD_RENAMES.setdefault(module, {}).update({new: old for old, new in renames.items()})


def loaded_key_names(root: nn.Module) -> Dict[str, str]:
    """The renames of the pre-hooks of `root`'s modules (a renamed key -> the key it had), forgotten once read."""
    renames: Dict[str, str] = {}
    for module in root.modules():
        renames.update(_LOAD_RENAMES.pop(module, {}))
    return renames


def is_derived_buffer(key: str) -> bool:
    """Whether state-dict `key` names a buffer the models recompute (a relative position index, a shifted-window
    mask), which official checkpoints hold."""
    return key.rsplit('.', 1)[-1] in DERIVED_BUFFERS


def drop_derived_buffers(state_dict: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """Remove the buffers the models recompute (`is_derived_buffer`)."""
    return {k: v for k, v in state_dict.items() if not is_derived_buffer(k)}


def _differ_in_input_channels_only(a: Tensor, b: Tensor) -> bool:
    return a.ndim == b.ndim >= 2 and a.shape[0] == b.shape[0] and a.shape[2:] == b.shape[2:]


def check_state_dict(
        model: nn.Module,
        state_dict: Mapping[str, Tensor],
        source: str = 'checkpoint',
        free_shape_prefixes: Sequence[str] = (),
        input_conv_weights: Sequence[str] = (),
        strict: bool = True,
        given_shapes: Optional[Mapping[str, torch.Size]] = None,
) -> None:
    """Raise `CheckpointError` naming the missing, unexpected and mis-shaped keys, on one line; not `strict`, the
    mis-shaped ones only (as `load_state_dict(strict=False)` refuses them alone).

    Keys under `free_shape_prefixes` (a classifier that the loader re-creates for another class count) may differ
    in shape, and the weights in `input_conv_weights` in their input channels (dim 1), which timm's loader adapts
    to the model's `in_chans`. A mis-shaped tensor is shown in its `given_shapes` one where that is given (the
    shape in the file, before a resampling to the model's grid).
    """
    own = model.state_dict()
    given_shapes = given_shapes or {}
    missing = [k for k in own if k not in state_dict] if strict else []
    unexpected = [k for k in state_dict if k not in own] if strict else []
    shapes = [f"{k} {tuple(given_shapes.get(k, state_dict[k].shape))} vs {tuple(own[k].shape)}"
              for k in own if k in state_dict and state_dict[k].shape != own[k].shape
              and not k.startswith(tuple(free_shape_prefixes))
              and not (k in input_conv_weights and _differ_in_input_channels_only(state_dict[k], own[k]))]
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


def resample_grid_embedding(embedding: Tensor, grid: Tuple[int, int], new_grid: Tuple[int, int],
                            num_prefix_tokens: int = 0, interpolation: str = 'bicubic') -> Tensor:
    """(1, prefix + H*W, C) embedding over `grid` -> (1, prefix + H'*W', C) over `new_grid`, the prefix rows kept;
    the identity at `new_grid` == `grid`. timm's resampling without antialias (in float32 at least)."""
    return resample_abs_pos_embed(embedding, [new_grid[0], new_grid[1]], [grid[0], grid[1]], num_prefix_tokens,
                                  interpolation, antialias=False)


def resize_grid_embedding(embedding: Tensor, new_grid: Tuple[int, int], num_prefix_tokens: int = 0,
                          interpolation: str = 'bicubic') -> Tensor:
    """Resize a (1, prefix + S*S, C) embedding over a square grid to (1, prefix + H*W, C) (a checkpoint holds no
    grid, so one of another token count is taken as square)."""
    tokens = embedding.shape[1] - num_prefix_tokens
    if tokens == new_grid[0] * new_grid[1]:
        return embedding
    side = int(round(tokens ** 0.5))
    if side * side != tokens:
        raise CheckpointError(f"cannot resize an embedding of {tokens} tokens: not a square grid")
    return resample_grid_embedding(embedding, (side, side), new_grid, num_prefix_tokens, interpolation)


def resize_rel_pos_bias_table(table: Tensor, new_window: Tuple[int, int],
                              window: Optional[Tuple[int, int]] = None) -> Tensor:
    """Bicubically resize a ((2wh-1)(2ww-1), heads) relative position bias table of `window` (None: square) to
    `new_window`."""
    rows = (2 * new_window[0] - 1) * (2 * new_window[1] - 1)
    if window is None:
        if table.shape[0] == rows:
            return table
        side = int(round(table.shape[0] ** 0.5))
        if side * side != table.shape[0] or side % 2 == 0:
            raise CheckpointError(f"cannot resize a relative position bias table of {table.shape[0]} rows: not that of "
                                  f"a square window, (2w - 1)² rows; expected a checkpoint of square windows, or the "
                                  f"model built at the checkpoint's size and resized by set_input_size")
        span = (side, side)
    else:
        if tuple(window) == tuple(new_window):
            return table
        span = (2 * window[0] - 1, 2 * window[1] - 1)
    heads = table.shape[1]
    image = table.T.reshape(1, heads, span[0], span[1]).float()
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


def _cfg_module_names(model: nn.Module, key: str, default: Sequence[str] = ()) -> Tuple[str, ...]:
    """The module names under `key` ('first_conv', 'classifier') of the model's pretrained cfg, as a tuple."""
    names = (getattr(model, 'pretrained_cfg', None) or {}).get(key) or default
    return (names,) if isinstance(names, str) else tuple(names)


def official_keys(model: nn.Module, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """`state_dict` under the official key names of `model`'s family: a family whose weights also circulate in
    timm's own layout renames them in its `official_keys_of` (Swin, PVT v2)."""
    rename = getattr(model, 'official_keys_of', None)
    return rename(state_dict) if rename is not None else state_dict


IMAGENET22K_CLASSES = 21841
# ImageNet-1k classes missing from the ImageNet-21k synset list, with the row Swin's fine-tuning takes for them
_ROWS_OUTSIDE_IMAGENET21K = {'n04399382': 5564}


@functools.lru_cache(maxsize=None)
def imagenet1k_classes() -> Tuple[str, ...]:
    """The WordNet synsets of the 1000 ImageNet-1k classes in class order, the names of ImageNet's class folders."""
    return tuple(ImageNetInfo('imagenet-1k').label_names())


@functools.lru_cache(maxsize=None)
def imagenet1k_rows_of_imagenet22k() -> Tuple[int, ...]:
    """The row of each ImageNet-1k class, in class order, in the ImageNet-22k classifiers of Swin's releases, as
    Swin's fine-tuning picks them (its `map22kto1k.txt`): the class's index in Google's ImageNet-21k synset list,
    which timm ships, and row 5564 for the one class that list lacks (teddy bear)."""
    full_list = {synset: row for row, synset in enumerate(ImageNetInfo('imagenet-21k-goog').label_names())}
    return tuple(full_list[synset] if synset in full_list else _ROWS_OUTSIDE_IMAGENET21K[synset]
                 for synset in imagenet1k_classes())


def narrow_imagenet22k_classifier(model: nn.Module, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """`state_dict` with a classifier of 21841 ImageNet-22k classes narrowed to the rows of the 1000 ImageNet-1k
    classes (`imagenet1k_rows_of_imagenet22k`) when `model` classifies 1000 classes and its family's official
    fine-tuning starts so (`narrows_imagenet22k_classifier`: Swin's); else `state_dict` itself."""
    if not getattr(model, 'narrows_imagenet22k_classifier', False) or getattr(model, 'num_classes', None) != 1000:
        return state_dict
    rows = None
    for classifier in _cfg_module_names(model, 'classifier', ('head',)):
        for part in ('weight', 'bias'):
            key = f'{classifier}.{part}'
            if key in state_dict and state_dict[key].shape[0] == IMAGENET22K_CLASSES:
                if rows is None:
                    rows = torch.tensor(imagenet1k_rows_of_imagenet22k(), device=state_dict[key].device)
                state_dict = {**state_dict, key: state_dict[key].index_select(0, rows)}
    return state_dict


def filter_checkpoint(
        checkpoint: Any,
        model: nn.Module,
        prepare: Callable[[Dict[str, Tensor]], Dict[str, Tensor]] = lambda state_dict: state_dict,
        strict: bool = True,
) -> Dict[str, Tensor]:
    """A checkpoint made ready for `model`: weights unwrapped (a file's EMA weights where it holds both, as timm
    takes pretrained weights: `PRETRAINED_KEYS`), derived buffers dropped, keys of timm's layout renamed
    (`official_keys`), an ImageNet-22k classifier narrowed to ImageNet-1k where the family's fine-tuning does so
    (`narrow_imagenet22k_classifier`), `prepare` applied (a family's own adjustment), tensors of another resolution
    adapted, a classifier the model is built without (`num_classes=0`) dropped, and the keys checked (not `strict`,
    timm's `pretrained_strict=False`: their shapes only). Two kinds of tensor may differ in shape, for timm's
    loader adapts them after this filter: the classifier (re-created for another class count) and the cfg's
    `first_conv` weights in their input channels (adapted to the model's `in_chans`)."""
    state_dict = official_keys(model, drop_derived_buffers(checkpoint_state_dict(checkpoint, PRETRAINED_KEYS)))
    state_dict = prepare(narrow_imagenet22k_classifier(model, state_dict))
    given_shapes = {k: v.shape for k, v in state_dict.items()}
    state_dict = adapt_state_dict(model, state_dict)
    classifiers = tuple(f'{name}.' for name in _cfg_module_names(model, 'classifier', ('head',)))
    own = model.state_dict()
    state_dict = {k: v for k, v in state_dict.items() if k in own or not k.startswith(classifiers)}
    check_state_dict(model, state_dict, 'checkpoint', free_shape_prefixes=classifiers,
                     input_conv_weights=[f'{name}.weight' for name in _cfg_module_names(model, 'first_conv')],
                     strict=strict, given_shapes=given_shapes)
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


def is_hub_name(name: str) -> bool:
    """Whether `name` is a `local-dir:FOLDER` / `hf-hub:REPO` model name, as `timm.create_model` reads them."""
    return name.startswith(tuple(f'{source}:' for source in HUB_SOURCES))


def _folder_weights_file(name: str, folder: str) -> str:
    if not os.path.isdir(folder):
        raise CheckpointError(f"{name!r}: {folder!r} is not a folder; expected one written by "
                              f"timm.models.save_for_hf")
    # timm's own order (private to timm.models._hub), so the file is the one create_model(name, pretrained=True) reads
    for filename in timm.models._hub._PREFERRED_FILES:
        if os.path.isfile(os.path.join(folder, filename)):
            return os.path.join(folder, filename)
    for extension in timm.models._hub._EXT_PRIORITY:
        found = sorted(f for f in os.listdir(folder)
                       if f.endswith(extension) and os.path.isfile(os.path.join(folder, f)))
        if found:
            if len(found) > 1:
                _logger.warning(f"{name!r}: the folder holds {len(found)} {extension} files {found}; reading "
                                f"{found[0]!r}")
            return os.path.join(folder, found[0])
    raise CheckpointError(f"{name!r}: the folder holds no weights; expected {' or '.join(_hub_filenames(None))} (the "
                          f"files timm.models.save_for_hf writes), or a {' / '.join(timm.models._hub._EXT_PRIORITY)} "
                          f"file")


def _hub_filenames(filename: Optional[str]) -> Tuple[str, ...]:
    """The files timm tries in a hub repository for weights file `filename` (default pytorch_model.bin): its
    safetensors alternatives first (timm's own list, private to timm.models._hub), then the file itself."""
    filename = filename or timm.models._hub.HF_WEIGHTS_NAME
    if filename.endswith('.safetensors'):
        return (filename,)
    return (*timm.models._hub._get_safe_alternatives(filename), filename)


def _downloaded_weights_file(what: str, repository: str, filenames: Sequence[str], advice: str = '') -> str:
    """The first of `filenames` in hub `repository`, downloaded into the hub's cache; `what` names the weights,
    and `advice` follows, in the one-line error where none can be downloaded."""
    for filename in filenames:
        try:
            return timm.models._hub.download_from_hf(repository, filename)
        except LocalEntryNotFoundError as e:  # offline, and not in the cache: another file would not be either
            raise CheckpointError(f"{what}: {filename} cannot be downloaded ({error_summary(e)}){advice}") from None
        except EntryNotFoundError:
            continue
        except OSError as e:
            raise CheckpointError(f"{what}: {filename} cannot be downloaded ({error_summary(e)}){advice}") from None
    raise CheckpointError(f"{what}: the repository holds no weights; expected {' or '.join(filenames)}")


def hub_weights_file(name: str) -> str:
    """The weights file of `local-dir:FOLDER` / `hf-hub:REPO` name `name`, the one that
    `timm.create_model(name, pretrained=True)` reads: in a folder, the first of timm's preferred file names
    (model.safetensors, pytorch_model.bin, ...), else the first file of each weights extension in timm's order; in a
    hub repository, model.safetensors, else pytorch_model.bin, downloaded into the hub's cache."""
    source, _, location = name.partition(':')
    if source == 'local-dir':
        return _folder_weights_file(name, location)
    return _downloaded_weights_file(repr(name), location, _hub_filenames(None))


def start_weights_file(source: str) -> str:
    """The local weights file of `source`, where a model starts from: a checkpoint file itself; for a
    `local-dir:FOLDER` / `hf-hub:REPO` name, the file timm reads (`hub_weights_file`); for a registered model name,
    its released weights (`released_weights_file`), downloaded into the cache."""
    if is_hub_name(source):
        return hub_weights_file(source)
    if os.path.isfile(source):
        return source
    if timm.is_model(source):
        return released_weights_file(source)
    raise CheckpointError(f"pretrained source {source!r} is neither a file nor a registered model name; expected a "
                          f"checkpoint file, a registered model name, or 'local-dir:FOLDER' / 'hf-hub:REPO'")


def load_pretrained_into(model: nn.Module, source: str) -> TransferReport:
    """Start `model` from the weights of `source`, a checkpoint file, a registered model name whose
    pretrained weights are downloaded into timm's cache, or the `local-dir:FOLDER` / `hf-hub:REPO` name of a model
    saved by `timm.models.save_for_hf`: a fine-tuning start such as softmax DeiT weights in a DeiT with another
    attention.

    A 1000-class Swin takes the ImageNet-1k rows of an ImageNet-22k classifier (`narrow_imagenet22k_classifier`:
    the function knows no data, so it takes the classes to be ImageNet-1k's, as Swin's fine-tuning does).
    Every tensor whose key and (after adaptation to the model's resolution) shape the model shares is loaded;
    the report names the model's new keys, which keep their initialisation, and the dropped ones. A name gives the
    weights `timm.create_model(name, pretrained=True)` takes (`PRETRAINED_KEYS`), and so does its release file; one
    of our training checkpoints gives its model weights (`file_weights_keys`).
    """
    path = start_weights_file(source)
    checkpoint = load_checkpoint_file(path)
    keys = file_weights_keys(checkpoint) if os.path.isfile(source) else PRETRAINED_KEYS
    state_dict = checkpoint_state_dict(checkpoint, keys, f"checkpoint {path!r}")
    return load_shared_weights(model, narrow_imagenet22k_classifier(model, official_keys(model, state_dict)), source)


def load_shared_weights(model: nn.Module, state_dict: Mapping[str, Tensor], source: str) -> TransferReport:
    """Load into `model` every tensor of `state_dict` (any layout a family reads) whose key and, after adaptation
    to the model's resolution, shape it shares; `source` names the weights in the error when none is shared."""
    state_dict = adapt_state_dict(model, official_keys(model, drop_derived_buffers(state_dict)))
    own = model.state_dict()
    # in the model's order, whatever order the file keeps (safetensors sorts its keys)
    loaded = [k for k, v in own.items() if k in state_dict and state_dict[k].shape == v.shape]
    if not loaded:
        raise CheckpointError(f"{source!r} shares no tensor with {type(model).__name__}; expected weights of the "
                              f"same family")
    model.load_state_dict({k: state_dict[k] for k in loaded}, strict=False)
    return TransferReport(loaded, [k for k in own if k not in loaded], [k for k in state_dict if k not in loaded])
