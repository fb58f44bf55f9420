"""Training checkpoints: written atomically, read with `torch.load(weights_only=True)`, resumable exactly.

A checkpoint holds `model`, `model_ema` (EMA on), `optimizer`, `scheduler`, `scaler`, `epoch` (the epoch index
the state belongs to), `epoch_batches` (batches of that epoch already trained), `step` (optimizer updates so far),
`max_accuracy`, `max_ema_accuracy`, `rng` (one entry per rank), `world_size` and `config` (the YAML text).
"""
import os
import random
import uuid
from typing import Any, Dict, List, Mapping

import numpy as np
import torch

from models.checkpoint import CheckpointError, load_checkpoint_file

__all__ = ['TRAINING_KEYS', 'atomic_save', 'rng_state', 'set_rng_state', 'load_training_checkpoint']

TRAINING_KEYS = ('model', 'optimizer', 'scheduler', 'scaler', 'epoch', 'epoch_batches', 'step', 'max_accuracy',
                 'rng', 'world_size', 'config')


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str) -> None:
    """`torch.save` to a temporary file in the target's folder, fsync, then rename over `path`.

    A crash at any point leaves either the previous file or the new one, never a partial file.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f'.{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp')
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # permissions from the umask, like open()
    try:
        with os.fdopen(fd, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_folder(folder)


def rng_state() -> Dict[str, Any]:
    """This process's torch, CUDA, NumPy and `random` generator states as tensors and numbers."""
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return dict(
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        numpy_keys=torch.from_numpy(np_keys.astype(np.int64)), numpy_pos=int(np_pos),
        numpy_has_gauss=int(np_has_gauss), numpy_gauss=float(np_gauss),
        python_version=int(py_version), python_internal=torch.tensor(py_internal, dtype=torch.int64),
        python_gauss=py_gauss,
    )


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state['torch'])
    if state['cuda'] and torch.cuda.is_available() and len(state['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state['cuda'])
    np.random.set_state(('MT19937', state['numpy_keys'].numpy().astype(np.uint32), state['numpy_pos'],
                         state['numpy_has_gauss'], state['numpy_gauss']))
    random.setstate((state['python_version'], tuple(state['python_internal'].tolist()), state['python_gauss']))


def load_training_checkpoint(path: str) -> Dict[str, Any]:
    """A checkpoint written by the training loop; another file raises `CheckpointError` naming what is missing."""
    checkpoint = load_checkpoint_file(path)
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(checkpoint).__name__}, not a training checkpoint")
    missing: List[str] = [k for k in TRAINING_KEYS if k not in checkpoint]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is not a training checkpoint of this engine: it lacks "
                              f"{', '.join(missing)}")
    return dict(checkpoint)
