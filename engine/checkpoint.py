"""Training checkpoints: written atomically, read with `torch.load(weights_only=True)`, resumable exactly.

A checkpoint holds `model`, `model_ema` (EMA on), `optimizer`, `scheduler`, `scaler`, `epoch` (the epoch index
the state belongs to), `epoch_batches` (batches of that epoch already trained), `step` (optimizer updates so far),
`max_accuracy`, `max_ema_accuracy`, `rng` (one entry per rank), `world_size`, `config` (the YAML text),
`metrics` (the last epoch's log record, None when saved before the epoch's validation) and `train_record` (the
training part of that record when the epoch's training finished but its validation did not, else None).
`TrainingCheckpoint` owns this format.

`OutputLock` keeps one run at a time in an output folder; `remove_stale_temp_files` clears the temporary files of
writes that were killed.
"""
import argparse
import atexit
import fcntl
import logging
import os
import random
import shutil
import socket
from contextlib import contextmanager
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from timm.scheduler.scheduler import Scheduler
from timm.utils import ModelEmaV3
from torch import nn
from yacs.config import CfgNode as CN

from models._files import (TEMP_NAME, atomic_write, file_in_the_way, files_taken_together,
                           remove_left_by_dead_processes, temporary_path)
from models.checkpoint import CheckpointError, load_checkpoint_file, load_state_dict_checked

from .build import optimizer_settings
from .config import ConfigError, config_changes, config_from_yaml_string, describe_model
from .distributed import DistInfo, all_gather_objects
from .errors import UsageError
from .loops import TrainState, step_schedule

__all__ = ['LAST', 'BEST', 'LOCK', 'recorded_classes', 'TrainingCheckpoint', 'OutputLock', 'check_writable_folder',
           'prepare_script_out', 'atomic_save', 'atomic_write_text', 'files_taken_together', 'NOTES_MARKER',
           'write_table_keeping_notes', 'remove_stale_temp_files', 'rng_state', 'set_rng_state']

LAST, BEST, LOCK = 'last.pth', 'best.pth', '.train.lock'
logger = logging.getLogger('engine')


# Below this line in a script's Markdown output, the text is written by hand and kept by the script's next run.
NOTES_MARKER = '<!-- notes -->'


def atomic_save(obj: Any, path: str) -> None:
    """`torch.save` through `atomic_write`: a crash at any point leaves the previous file or the new one."""
    def save(f: BinaryIO) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError as e:  # torch's zip writer reports a failed write (a full disk) as its own error
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise

    atomic_write(path, save)


def atomic_write_text(path: str, text: str) -> None:
    """`text` in UTF-8 through `atomic_write`, for the tables and notes that a long run writes at its end. Text
    read with `errors='surrogateescape'` is written back byte for byte, UTF-8 or not."""
    atomic_write(path, lambda f: f.write(text.encode('utf-8', errors='surrogateescape')))


def write_table_keeping_notes(path: str, table: str) -> None:
    """The Markdown `table` to `path` through `atomic_write_text`, keeping what the file there holds from
    `NOTES_MARKER` on: the notes written by hand below a script's table survive the script's next run, byte for
    byte (also in another encoding than UTF-8)."""
    notes = ''
    if os.path.exists(path):
        with open(path, encoding='utf-8', errors='surrogateescape') as f:
            previous = f.read()
        if NOTES_MARKER in previous:
            notes = '\n' + NOTES_MARKER + previous.split(NOTES_MARKER, 1)[1]
    atomic_write_text(path, table + notes)


def remove_stale_temp_files(folder: str) -> List[str]:
    """Remove the temporary files of `atomic_save` calls whose process no longer runs on this host (killed
    mid-write); return their names."""
    return remove_left_by_dead_processes(folder, TEMP_NAME)


def _not_writable(folder: str, error: OSError, source: str) -> str:
    return (f"output folder {folder!r} is not writable ({error.strerror}); expected a folder this user can write "
            f"({source})")


def check_writable_folder(folder: str, source: str) -> None:
    """Make `folder` where it is missing and prove, with a new file, that it takes new files; else a one-line
    `UsageError` naming the folder and `source`, the option it came from (`--out docs/benchmarks`), so that a run
    fails before its work rather than when it writes the results."""
    blocker = file_in_the_way(folder)
    if blocker is not None:
        where = 'is a file' if blocker == folder else f'cannot be made: {blocker!r} is a file'
        raise UsageError(f"output folder {folder!r} {where}; expected a folder ({source})")
    try:
        os.makedirs(folder, exist_ok=True)
        probe = temporary_path(os.path.join(folder, 'write-probe'))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.remove(probe)
    except OSError as e:
        raise UsageError(_not_writable(folder, e, source)) from None


def prepare_script_out(parser: argparse.ArgumentParser, out: str, prefix: bool, suffixes: Sequence[str] = (),
                       example: str = 'results') -> None:
    """`parser.error` (one line, status 2) unless a script's `--out` can be written: the folder of `out` when it
    is a prefix of the files (`docs/benchmarks` for .md and .csv: `suffixes`, none of which may name a folder; a
    folder given as the prefix is refused with `example` as the name to put in it),
    else `out` itself. The temporary files that runs killed outright (SIGTERM, SIGKILL) while writing there left
    are removed (a finished or stopped run leaves none). The folders made for it are removed at exit if they are
    still empty (the run failed before its results)."""
    if prefix and (out.endswith(os.sep) or os.path.isdir(out)):
        parser.error(f"--out {out}: is a folder; expected a path prefix of the files, such as "
                     f"{os.path.join(out, example)}")
    for suffix in suffixes:
        if os.path.isdir(out + suffix):
            parser.error(f"--out {out}: {out + suffix!r} is a folder; expected a prefix whose files "
                         f"({', '.join(suffixes)}) are not folders")
    folder = (os.path.dirname(out) or '.') if prefix else out
    atexit.register(_remove_empty_folders, _missing_folders(folder))
    try:
        check_writable_folder(folder, f'--out {out}')
    except UsageError as e:
        parser.error(str(e))
    if os.path.isdir(folder):
        remove_stale_temp_files(folder)


def _missing_folders(folder: str) -> List[str]:
    """The folders that `os.makedirs(folder)` would make, deepest first."""
    missing = []
    folder = os.path.abspath(folder)
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _remove_empty_folders(folders: Sequence[str]) -> None:
    """Remove `folders`, deepest first, while they are empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


class OutputLock:
    """An advisory lock (`fcntl.flock`) on `<output>/.train.lock`, which holds the holder's host and PID, so that
    one run at a time writes into an output folder. The kernel drops the lock when its process dies, so a lock
    file left by a killed run is simply taken over."""

    def __init__(self, output: str):
        self.output, self.path = output, os.path.join(output, LOCK)
        self.fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Check that the output folder is a writable folder and lock it; return the holder written in a lock file
        that a run which has ended left behind (None if there was none). Raise `UsageError` when the folder is
        a file, cannot be created or written, or another run holds it."""
        output, source = self.output, 'OUTPUT / --output'
        check_writable_folder(output, source)
        fd: Optional[int] = None
        try:
            fd = self._lock()
            previous = os.read(fd, 256).decode(errors='replace').strip() or None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        except OSError as e:
            self.fd = fd
            self.release()
            raise UsageError(_not_writable(output, e, source)) from None
        self.fd = fd
        return previous

    def _lock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 256).decode(errors='replace').strip() or 'holder unknown'
                os.close(fd)
                raise UsageError(f"output folder {self.output!r} is in use by another run ({holder}, lock file "
                                 f"{self.path}); expected one run per output folder: wait for it to end or choose "
                                 f"another --output") from None
            # a holder that ends unlinks the file before unlocking it: a lock on that old file locks nothing
            if _same_file(fd, self.path):
                return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file, then unlock it."""
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass  # a read-only folder keeps it; the next run takes it over
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in `obj`, about what `torch.save` writes."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _free_bytes(folder: str) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


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


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_optimizer_state(value: Any) -> bool:
    if not isinstance(value, Mapping) or not isinstance(value.get('state'), Mapping):
        return False
    groups = value.get('param_groups')
    return (isinstance(groups, list) and bool(groups)
            and all(isinstance(g, Mapping) and isinstance(g.get('params'), list) for g in groups))


def _is_name_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


# what each field of a training checkpoint must be, checked before anything is built from it
FIELDS: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ('model', lambda v: isinstance(v, Mapping) and bool(v) and all(isinstance(t, torch.Tensor) for t in v.values()),
     'a state dict of tensors'),
    ('optimizer', _is_optimizer_state, "an optimizer state dict: 'state' and a non-empty list of 'param_groups'"),
    ('scheduler', lambda v: isinstance(v, Mapping), 'a state dict'),
    ('scaler', lambda v: isinstance(v, Mapping), 'a state dict'),
    ('epoch', _is_count, 'an integer >= 0'),
    ('epoch_batches', _is_count, 'an integer >= 0'),
    ('step', _is_count, 'an integer >= 0'),
    ('max_accuracy', lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), 'a number'),
    ('world_size', lambda v: _is_count(v) and v > 0, 'an integer > 0'),
    ('rng', lambda v: isinstance(v, list) and bool(v) and all(isinstance(r, Mapping) for r in v),
     'a list of random states, one per process'),
    ('config', lambda v: isinstance(v, str), 'the config as YAML text'),
    ('metrics', lambda v: v is None or isinstance(v, Mapping), "None or the epoch's log record"),
    ('classes', lambda v: v is None or _is_name_list(v), 'None or the list of class folder names'),
)


def _describe(value: Any) -> str:
    """`value` in a few words: small values as they are, containers by their size and keys."""
    if isinstance(value, Mapping):
        keys = ', '.join(map(str, list(value)[:6]))
        return f"a mapping with the keys {keys}" if value else '{}'
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}" if value else repr(value)
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


@contextmanager
def _loading(path: str, what: str, expected: str) -> Iterator[None]:
    """A stored state that the live object refuses becomes one line naming the checkpoint and the part."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        detail = str(e).splitlines()[0] if str(e) else 'no detail'
        raise CheckpointError(f"checkpoint {path!r} has {what} that this run cannot load ({type(e).__name__}: "
                              f"{detail}); expected {expected}") from None


def _model_of(checkpoint: Mapping[str, Any], path: str) -> str:
    """The model name and keywords of the run that wrote `checkpoint`, as its stored config gives them."""
    return describe_model(config_from_yaml_string(checkpoint['config'], f"checkpoint {path!r}"))


def _as_trained(cfg: CN) -> CN:
    """`cfg` with TRAIN.OPTIMIZER's EPS and BETAS as its optimizer takes them (None: the optimizer's own values;
    absent where it takes none), so that a run saved with EPS 1e-8 and one with None compare as the same AdamW."""
    try:
        settings = optimizer_settings(cfg)
    except ConfigError:
        return cfg
    cfg = cfg.clone()
    cfg.defrost()
    cfg.TRAIN.OPTIMIZER.EPS, cfg.TRAIN.OPTIMIZER.BETAS = settings.get('eps'), settings.get('betas')
    cfg.freeze()
    return cfg


def _with_live_settings(stored: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """`stored` (an optimizer's state dict) with the live `optimizer`'s group settings (weight decay, betas, eps,
    momentum, the kernel flags, ...) in place of its own: torch's `load_state_dict` keeps only the live groups'
    parameters and takes every setting from the state it loads, so a run resumed with another TRAIN.WEIGHT_DECAY
    or TRAIN.OPTIMIZER.BETAS would go on with the old ones, as the schedule follows this run's config. They are
    replaced before loading, not after: the kernel flags decide where torch puts each `step` counter (on the
    parameter's device for the fused kernel)."""
    live = optimizer.param_groups
    groups = [{**group, **{k: v for k, v in live[i].items() if k != 'params'}} if i < len(live) else group
              for i, group in enumerate(stored['param_groups'])]
    return {**stored, 'param_groups': groups}


def recorded_classes(checkpoint: Any) -> Optional[List[str]]:
    """The class folder names, in label order, that a training checkpoint of this engine records; None for any
    other file and for checkpoints written before the names were kept."""
    classes = checkpoint.get('classes') if isinstance(checkpoint, Mapping) else None
    return classes if _is_name_list(classes) else None


# Where and how often a run writes, where its data lies, how it starts or pauses, which kernels and device compute
# it: values a resumed run may change without changing what it trains (a start from pretrained weights does not
# apply to a resumed run)
_NOT_TRAINING_KEYS = ('OUTPUT', 'PRINT_FREQ', 'SAVE_FREQ', 'DEVICE', 'DATA.DATA_PATH', 'DATA.PIN_MEMORY',
                      'MODEL.PRETRAINED', 'MODEL.PRETRAINED_STRICT', 'MODEL.PRETRAINED_EMA', 'MODEL.RESUME',
                      'TRAIN.AUTO_RESUME', 'TRAIN.EPOCHS_PER_RUN', 'TRAIN.COMPILE', 'TRAIN.COMPILE_MODE',
                      'TRAIN.COMPILE_BACKEND', 'TRAIN.ONEDNN', 'TRAIN.OPTIMIZER.FUSED', 'DIST.BACKEND',
                      'DIST.TIMEOUT_MIN')


# what a resumed run must build as the run it resumes built it
_MODEL_KEYS = ('MODEL.NAME', 'MODEL.NUM_CLASSES', 'DATA.IMG_SIZE')


def _same_source(given: str, started: str) -> bool:
    """Whether MODEL.PRETRAINED `given` names the weights `started` names: the same text, or the same file."""
    if given == started:
        return True
    try:
        return bool(started) and os.path.samefile(given, started)
    except OSError:
        return False


class TrainingCheckpoint:
    """The checkpoint of one training run: what it holds, the atomic writing of `last.pth` / `best.pth`, reading
    one back checked, and restoring one into the live model, EMA, optimizer, scaler, schedule, state and RNG."""

    # what a file must hold to resume; `model_ema`, `max_ema_accuracy`, `metrics` and `classes` may be absent
    KEYS = ('model', 'optimizer', 'scheduler', 'scaler', 'epoch', 'epoch_batches', 'step', 'max_accuracy', 'rng',
            'world_size', 'config')

    def __init__(self, output: str, info: DistInfo, state: TrainState, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Scheduler, scaler: torch.amp.GradScaler,
                 ema: Optional[ModelEmaV3], config: str, classes: Optional[Sequence[str]] = None):
        self.last_path, self.best_path = os.path.join(output, LAST), os.path.join(output, BEST)
        self.info, self.state, self.model, self.ema = info, state, model, ema
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.config = config
        # the class folder names in label order: a resumed run and eval.py check their data against them
        self.classes = list(classes) if classes is not None else None

    def save(self, metrics: Optional[Dict[str, Any]] = None, best: bool = False,
             train_record: Optional[Dict[str, Any]] = None) -> None:
        """Write `last.pth`, and `best.pth` too when `best`; `train_record` marks a checkpoint saved after an
        epoch's training and before its validation. Every process calls it, since each one's random state goes in;
        rank 0 writes."""
        rngs = all_gather_objects(rng_state())
        if not self.info.is_main:
            return
        state = self.state
        payload = dict(
            model=self.model.state_dict(),
            model_ema=self.ema.module.state_dict() if self.ema is not None else None,
            optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
            scaler=self.scaler.state_dict(), epoch=state.epoch, epoch_batches=state.epoch_batches, step=state.step,
            max_accuracy=state.max_accuracy, max_ema_accuracy=state.max_ema_accuracy, rng=rngs,
            world_size=self.info.world_size, config=self.config, metrics=metrics, train_record=train_record,
            classes=self.classes, epoch_loss=(state.epoch_loss_sum, state.epoch_loss_count))
        # best.pth first: a run killed between the two writes leaves a best.pth at least as new as the best epoch
        # that last.pth records, never an older one
        for path in ([self.best_path] if best else []) + [self.last_path]:
            try:
                atomic_save(payload, path)
            except OSError as e:
                free = _free_bytes(os.path.dirname(path))
                # the previous file stays until the new one is whole: both must fit at once
                space = f"the checkpoint takes about {_tensor_bytes(payload) / 1e6:.1f} MB beside the previous one"
                if free is not None:
                    space += f"; {free / 1e6:.1f} MB are free"
                raise UsageError(f"cannot write checkpoint {path!r}: {e.strerror} ({space}); the checkpoints saved "
                                 f"before are kept; expected a writable output folder with room for it") from None

    @classmethod
    def read(cls, path: str) -> Dict[str, Any]:
        """The checkpoint at `path`; a file that is not one raises `CheckpointError` naming what is missing."""
        checkpoint = load_checkpoint_file(path)
        if not isinstance(checkpoint, Mapping):
            raise CheckpointError(f"checkpoint {path!r} holds a {type(checkpoint).__name__}, not a training "
                                  f"checkpoint")
        missing: List[str] = [k for k in cls.KEYS if k not in checkpoint]
        if missing:
            raise CheckpointError(f"checkpoint {path!r} is not a training checkpoint of this engine: it lacks "
                                  f"{', '.join(missing)}; expected a last.pth that train.py wrote (to start from "
                                  f"the weights of another file: --pretrained {path})")
        checkpoint = dict(checkpoint)
        checkpoint.setdefault('metrics', None)
        checkpoint.setdefault('classes', None)  # not recorded before the class names were kept
        for key, valid, expected in FIELDS:
            if not valid(checkpoint[key]):
                raise CheckpointError(f"checkpoint {path!r} is malformed: {key} is {_describe(checkpoint[key])}; "
                                      f"expected {expected}")
        if len(checkpoint['rng']) != checkpoint['world_size']:
            raise CheckpointError(f"checkpoint {path!r} is malformed: rng holds {len(checkpoint['rng'])} random "
                                  f"state(s) but world_size is {checkpoint['world_size']}; expected one per process")
        return checkpoint

    @staticmethod
    def check_same_run(checkpoint: Mapping[str, Any], path: str, cfg: CN) -> None:
        """Raise `UsageError` unless `cfg` builds the model that wrote `checkpoint` (MODEL.NAME, MODEL.KWARGS,
        MODEL.NUM_CLASSES, DATA.IMG_SIZE) with its optimizer (TRAIN.OPTIMIZER.NAME, and TRAIN.BACKBONE_LR_SCALE 1
        or not) and starts from the same MODEL.PRETRAINED, if it names one: a run resumed under another model goes
        on from the other model's weights and epoch where the shapes allow it (softmax, SimA and linear DeiT share
        every one), torch loads one optimizer's state into another without a check (AdamW's moments into LAMB or
        SGD; Adan fails at its first step), and weights given to start from are not loaded into a resumed run."""
        try:
            stored = config_from_yaml_string(checkpoint['config'], f"checkpoint {path!r}")
        except ConfigError:
            return  # a config this engine no longer reads: restoring compares the weights, and says so
        changes = config_changes(stored, cfg,
                                 compared=lambda key: key in _MODEL_KEYS or key.startswith('MODEL.KWARGS.'))
        if changes:
            raise UsageError(f"checkpoint {path!r} holds a run of another model: {'; '.join(changes)}; expected that "
                             f"model to resume it (another model: another --output; to start from its weights: "
                             f"--pretrained {path} with another --output)")
        optimizer = []
        then, now = stored.TRAIN.OPTIMIZER.NAME, cfg.TRAIN.OPTIMIZER.NAME
        if then.lower() != now.lower():  # timm's names are case-insensitive
            optimizer.append(f"TRAIN.OPTIMIZER.NAME {then!r} (this run: {now!r})")
        then, now = stored.TRAIN.BACKBONE_LR_SCALE, cfg.TRAIN.BACKBONE_LR_SCALE
        if (then == 1) != (now == 1):  # one parameter group or two
            optimizer.append(f"TRAIN.BACKBONE_LR_SCALE {then!r} (this run: {now!r})")
        if optimizer:
            raise UsageError(f"checkpoint {path!r} holds an optimizer state this run would not use: "
                             f"{'; '.join(optimizer)}; expected the same optimizer to resume it, with "
                             f"TRAIN.BACKBONE_LR_SCALE 1 in both runs or in neither (another optimizer: "
                             f"--pretrained {path} with another --output)")
        given, started = cfg.MODEL.PRETRAINED, stored.MODEL.PRETRAINED
        if given and not _same_source(given, started):
            resume = f"--pretrained {started}" if started else "--pretrained '' (no MODEL.PRETRAINED)"
            raise UsageError(f"MODEL.PRETRAINED {given!r} would not be loaded: this run resumes {path!r}, which "
                             f"started from {repr(started) if started else 'random weights'}; expected another "
                             f"--output to start from {given!r}, or {resume} to resume the run")

    @staticmethod
    def started_from(checkpoint: Mapping[str, Any], path: str) -> str:
        """The MODEL.PRETRAINED the run that wrote `checkpoint` started from ('' for random weights or a config
        this engine no longer reads)."""
        try:
            return config_from_yaml_string(checkpoint['config'], f"checkpoint {path!r}").MODEL.PRETRAINED
        except ConfigError:
            return ''

    @staticmethod
    def check_resumable(checkpoint: Mapping[str, Any], path: str, batch_size: int, accumulation: int,
                        world_size: int) -> None:
        """Raise `UsageError` when `checkpoint` stopped in the middle of an epoch and this run splits the data
        otherwise (batch size, accumulation steps or process count): its batch count would point elsewhere in the
        epoch. A checkpoint saved at the end of an epoch, or of its training, resumes under any of them."""
        if (checkpoint['metrics'] is not None or checkpoint.get('train_record') is not None
                or checkpoint['epoch_batches'] == 0):
            return
        stored = config_from_yaml_string(checkpoint['config'], f"checkpoint {path!r}")
        pairs = [('DATA.BATCH_SIZE', stored.DATA.BATCH_SIZE, batch_size),
                 ('TRAIN.ACCUMULATION_STEPS', stored.TRAIN.ACCUMULATION_STEPS, accumulation),
                 ('processes', checkpoint['world_size'], world_size)]
        changed = [f"{name} {then} (this run: {now})" for name, then, now in pairs if then != now]
        if changed:
            raise UsageError(f"checkpoint {path!r} stopped in the middle of epoch {checkpoint['epoch']} (batch "
                             f"{checkpoint['epoch_batches']}) with {', '.join(changed)}; expected the same values "
                             f"until that epoch ends")

    def restore(self, checkpoint: Mapping[str, Any], path: str, batches_per_epoch: int, accumulation: int = 1,
                schedule_per: str = 'update') -> None:
        """Load `checkpoint` (read from `path`) into the live objects, so training goes on where it stopped.

        A checkpoint saved at the end of its epoch (with `metrics`), or whose batches fill this run's
        `batches_per_epoch`, goes on at the next epoch, whatever batch size wrote it; one saved after its epoch's
        training (with `train_record`) stays at that epoch with all `batches_per_epoch` trained, to be validated.
        The schedule is set to that point of training at `accumulation` batches per update, stepped per
        `schedule_per` (TRAIN.LR_SCHEDULER.STEP). The random streams are
        restored only when the world size is the one that wrote them.
        """
        try:
            load_state_dict_checked(self.model, checkpoint['model'], f"checkpoint {path!r}")
        except CheckpointError as e:
            raise CheckpointError(f"{e}; it holds a run of {_model_of(checkpoint, path)}, expected that model to "
                                  f"resume it (another model: another --output)") from None
        if self.ema is not None:
            if checkpoint.get('model_ema') is None:
                self.ema.set(self.model)
                logger.warning(f"{path} has no EMA weights; the EMA starts from the model")
            else:
                load_state_dict_checked(self.ema.module, checkpoint['model_ema'], f"EMA of checkpoint {path!r}")
        with _loading(path, 'an optimizer state', 'one of the same model and TRAIN.OPTIMIZER.NAME, with '
                      'TRAIN.BACKBONE_LR_SCALE 1 in both runs or in neither'):
            self.optimizer.load_state_dict(_with_live_settings(checkpoint['optimizer'], self.optimizer))
        # a disabled scaler saves an empty state, which an enabled one refuses
        if self.scaler.is_enabled() and checkpoint['scaler']:
            with _loading(path, 'a gradient scaler state', "the state of torch's GradScaler"):
                self.scaler.load_state_dict(checkpoint['scaler'])
        state = self.state
        state.epoch, state.epoch_batches = checkpoint['epoch'], checkpoint['epoch_batches']
        state.step, state.max_accuracy = checkpoint['step'], checkpoint['max_accuracy']
        state.max_ema_accuracy = checkpoint.get('max_ema_accuracy', 0.0)
        with _loading(path, "an epoch's running loss", 'a (sum, count) pair of numbers'):
            state.epoch_loss_sum, state.epoch_loss_count = (float(v) for v in checkpoint.get('epoch_loss', (0, 0)))
        if checkpoint.get('train_record') is not None and checkpoint['metrics'] is None:
            state.epoch_batches = batches_per_epoch
        elif checkpoint['metrics'] is not None or state.epoch_batches >= batches_per_epoch:
            state.next_epoch()
        # the stored schedule is not loaded: the schedule follows this run's config at this point of training
        step_schedule(self.scheduler, state, batches_per_epoch // accumulation, accumulation, schedule_per)
        if checkpoint['world_size'] == self.info.world_size:
            with _loading(path, 'a random state', 'the states of torch, CUDA, NumPy and random that this engine saves'):
                set_rng_state(checkpoint['rng'][self.info.rank])
        elif self.info.is_main:
            logger.warning(f"{path} was written by {checkpoint['world_size']} processes, not "
                           f"{self.info.world_size}: random streams restart from the seed")
        logger.info(f"resumed from {path} at epoch {state.epoch} batch {state.epoch_batches} (step {state.step})")
        self._report_config_changes(checkpoint, path)

    def _report_config_changes(self, checkpoint: Mapping[str, Any], path: str) -> None:
        """Say which config values this run changes from the run it resumes: they take effect from here on (the
        learning-rate schedule is this run's), which a resume into the same folder would otherwise do silently.
        Rank 0 says it: every rank holds the same config."""
        if not self.info.is_main:
            return
        try:
            stored = config_from_yaml_string(checkpoint['config'], f"checkpoint {path!r}")
        except ConfigError as e:
            logger.warning(f"{path}: the config it holds cannot be compared with this run's ({e})")
            return
        changes = config_changes(_as_trained(stored), _as_trained(config_from_yaml_string(self.config, 'this run')),
                                 ignore=_NOT_TRAINING_KEYS)
        if changes:
            logger.warning(f"{path} was written under another config: {'; '.join(changes)}; the run goes on with "
                           f"this run's values, its learning-rate schedule included")
