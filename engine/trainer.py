"""The training run: data, model, EMA, optimizer and schedule from a config; epochs with validation, logging,
atomic `last.pth` / `best.pth` checkpoints, exact resumption, one run at a time per output folder, and a stop on
SIGTERM / SIGINT that saves, then exits with 128 + the signal."""
import json
import logging
import math
import os
import random
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, TextIO, Tuple

import numpy as np
import torch
import yaml
from timm.utils import ModelEmaV3
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from yacs.config import CfgNode as CN

from models._files import named_on_error
from models.checkpoint import CheckpointError, held_weights, load_checkpoint_file

from .build import (autocast_dtype, check_model_config, check_onednn, check_optimizer_config, check_pretrained,
                    check_sync_bn, create_criterion, create_model, create_optimizer, create_scheduler,
                    checkpoint_weights, create_training_model, official_weights, read_weights,
                    synchronize_batchnorm, trained_as_another_model, weights_keys)
from .checkpoint import BEST, LAST, OutputLock, TrainingCheckpoint, atomic_write_text, remove_stale_temp_files
from .compile import CompileTimer, compile_errors_reported, compile_model
from .config import describe_model, ema_decay, scaled_lrs, stored_config, total_batch_size
from .data import (build_batch_augmentation, build_eval_loader, build_train_loader, check_images, check_splits,
                   check_trained_classes, class_difference, eval_batch_size, eval_transform, image_mode, load_split,
                   report_scan, resolve_data_root, train_transform)
from .distributed import (
    DistInfo, all_gather_objects, all_reduce_sum, any_rank, average_batchnorm_statistics, barrier, main_process_first,
    match_gradient_strides,
)
from .errors import Stopped, UsageError, error_line, exit_at_once
from .hub import weights_file
from .loops import EpochOptions, TrainState, evaluate, train_one_epoch

__all__ = ['LOG', 'CONFIG', 'train', 'seed_everything', 'setup_logging', 'StopSignal']

LOG, CONFIG = 'log.jsonl', 'config.yaml'
# torchrun passes the signals it gets on to every rank, which a terminal's Ctrl-C has already reached: a repeat of
# the first signal this soon after it is that copy, not a second signal
FORWARDED_WITHIN_S = 1.0
logger = logging.getLogger('engine')


class _LogFile(logging.FileHandler):
    """`train.log`: a record it cannot write (a full disk) is said once, on one line, where logging would print a
    traceback for every record; the console keeps them all."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        self.failed = True
        error = sys.exc_info()[1]
        reason = error.strerror if isinstance(error, OSError) and error.strerror else repr(error)
        print(f"warning: cannot write {self.baseFilename!r} ({reason}); the log goes on on the console alone",
              file=sys.stderr)


def _log_files(output: str) -> List[_LogFile]:
    path = os.path.abspath(os.path.join(output, 'train.log'))
    return [handler for handler in logger.handlers if isinstance(handler, _LogFile) and handler.baseFilename == path]


def _count(number: int, noun: str, plural: str = '') -> str:
    """'1 epoch', '2 epochs'; '1 class', '2 classes' with the `plural` given."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def _note_in_log_file(output: str, message: str) -> None:
    """`message` in the `train.log` of `output` alone, so that the log of a run that stopped on an error ends
    with it."""
    for handler in _log_files(output):
        handler.handle(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, None, None))


def _close_log_file(output: str) -> None:
    """Stop logging into the `train.log` of `output`: a later run in this process writes there only once it
    holds the folder."""
    for handler in _log_files(output):
        logger.removeHandler(handler)
        handler.close()


def setup_logging(info: DistInfo, output: Optional[str] = None, stream: Optional[TextIO] = None) -> None:
    """Rank 0 logs to `stream`, stdout by default (and `output/train.log`); the other ranks only log warnings."""
    for old in list(logger.handlers):
        logger.removeHandler(old)
        old.close()
    logger.propagate = False
    logger.setLevel(logging.INFO if info.is_main else logging.WARNING)
    fmt = logging.Formatter('[%(asctime)s] %(message)s', datefmt='%H:%M:%S')
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    if output and info.is_main:
        file_handler = _LogFile(os.path.join(output, 'train.log'))
        file_handler.setFormatter(fmt)
        logger.addHandler(file_handler)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# The signals that stop training after a save: a scheduler's or torchrun's SIGTERM, Ctrl-C, and the SIGHUP of a
# terminal or ssh session that closes (torchrun passes it on to the processes too).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignal:
    """Remembers a SIGTERM / SIGINT / SIGHUP so training can save and stop after the current step; a second one ends
    the process at once, without saving. Under torchrun, the copy of the first signal that torchrun passes on is
    not a second one."""

    def __init__(self):
        self.received: Optional[int] = None
        self.received_at = 0.0
        self.copy_seen = False
        self.pid = os.getpid()

    def __call__(self) -> bool:
        return self.received is not None

    def _is_torchrun_copy(self, signum: int) -> bool:
        copy = (signum == self.received and not self.copy_seen and 'TORCHELASTIC_RUN_ID' in os.environ
                and time.monotonic() - self.received_at < FORWARDED_WITHIN_S)
        self.copy_seen = self.copy_seen or copy
        return copy

    def _handle(self, signum, frame) -> None:
        # DataLoader workers inherit the handler and get Ctrl-C too; their process stops them, once, itself
        if os.getpid() != self.pid:
            return
        if self.received is not None:
            if self._is_torchrun_copy(signum):
                return
            exit_at_once(signum, f"stopped at once by a second {signal.Signals(signum).name}, without saving; the "
                                 f"checkpoints saved before are unchanged")
        self.received, self.received_at = signum, time.monotonic()
        logger.warning(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping "
                       f"(send it again to stop at once)")

    @contextmanager
    def installed(self) -> Iterator['StopSignal']:
        """The handler for the `STOP_SIGNALS` while the block runs; after a signal, a collective that fails because
        another process ended at once ends this one at once too, on one line. A signal that this process was
        started ignoring stays ignored, as Python leaves an ignored SIGINT: a run under `nohup` outlives its
        terminal's SIGHUP."""
        self.pid = os.getpid()
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                    if signal.getsignal(s) is not signal.SIG_IGN}
        try:
            yield self
        except RuntimeError as e:
            if self.received is None or not torch.distributed.is_initialized():
                raise
            detail = (str(e).splitlines() or ['no detail'])[0]
            exit_at_once(self.received, f"stopped at once after {signal.Signals(self.received).name}: a collective "
                                        f"with the other processes failed ({detail}), as one of them stopped at "
                                        f"once; the checkpoints saved before are unchanged")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _check_nothing_replaced(output: str, resume: Optional[str]) -> None:
    """Refuse a run that would write its checkpoints over those of another run in `output`: a fresh run
    (TRAIN.AUTO_RESUME False, or no last.pth beside a best.pth) or one resuming a checkpoint from elsewhere
    (MODEL.RESUME)."""
    last = os.path.join(output, LAST)
    if resume is not None and (not os.path.exists(resume) or _is_same_file(resume, last)):
        return  # a missing MODEL.RESUME, which reading names, or the folder's own run resumed
    for name in (LAST, BEST):
        path = os.path.join(output, name)
        if not os.path.isfile(path) or (resume is not None and _is_same_file(resume, path)):
            continue  # nothing to replace, or the best.pth that this run resumes
        if resume:
            source, advice = f"MODEL.RESUME is {resume}", ", or resume that run (without --resume)"
        elif name == LAST:  # a last.pth that is not resumed means TRAIN.AUTO_RESUME is off
            source, advice = "TRAIN.AUTO_RESUME is False", ", or resume that run (TRAIN.AUTO_RESUME True)"
        else:
            source, advice = f"there is no {LAST} beside it to resume", ""
        raise UsageError(f"output folder {output!r} holds the checkpoints of a run ({path}) that this run would "
                         f"replace, since {source}; expected a folder without one: choose another --output{advice}")


def _is_same_file(path: str, other: str) -> bool:
    """Whether the existing file `path` is `other`, which may be missing."""
    return os.path.isfile(other) and os.path.samefile(path, other)


def _continues(last: str, resume: str) -> bool:
    """Whether the checkpoint `last` was written by a run resumed from `resume` (its stored MODEL.RESUME names that
    file): the run of the same command, paused or stopped, which that command goes on with."""
    try:  # memory-mapped: the config alone is read, not the tensors
        stored = yaml.safe_load(torch.load(last, map_location='cpu', weights_only=True, mmap=True)['config'])
        started_from = stored['MODEL']['RESUME']
        return bool(started_from) and os.path.exists(resume) and os.path.samefile(started_from, resume)
    except Exception:  # unreadable or another layout: not this command's run, and reading it will say why
        return False


def _resume_path(cfg: CN) -> Optional[str]:
    last = os.path.join(cfg.OUTPUT, LAST)
    auto = cfg.TRAIN.AUTO_RESUME and os.path.isfile(last)
    if cfg.MODEL.RESUME and not (auto and _continues(last, cfg.MODEL.RESUME)):
        return cfg.MODEL.RESUME
    return last if auto else None


def _append_log(path: str, record: Dict[str, Any]) -> None:
    """Append `record` as a line of strict JSON: a number that is not finite (the NaN loss of an epoch whose every
    update was skipped) as null, which JSON has, where Python would write NaN."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with named_on_error(path), open(path, 'a') as f:
        f.write(json.dumps(finite, allow_nan=False) + '\n')
        f.flush()
        os.fsync(f.fileno())


def _drop_log_records(path: str, first_epoch: int) -> None:
    """Remove the records of epochs from `first_epoch` on, which a resumed run trains again, and a last line that a
    kill cut short (its epoch was appended before its checkpoint, so it is trained again too)."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line.rstrip('\n') for line in f if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
            if number == len(lines):  # a prefix of a record is never valid JSON
                logger.warning(f"dropped the cut last line of {path}: the run was stopped while writing it")
                continue
        if not isinstance(record, dict) or type(record.get('epoch')) is not int:
            raise UsageError(f"line {number} of {path} is not a JSON record of an epoch; expected the log this run "
                             f"writes, one record per line")
        if record['epoch'] < first_epoch:
            kept.append(line + '\n')
    atomic_write_text(path, ''.join(kept))


def _summary(log_path: str, checkpoint: TrainingCheckpoint, selected_by: str = 'val_top1',
             best_so_far: Optional[float] = None) -> str:
    """One line for the end of a finished run: its best epoch by `selected_by` (the record's key that chose
    best.pth) and its last epoch, from every record of `log.jsonl`. A run resumed from another folder's checkpoint
    saves no best.pth until it beats that checkpoint's best, `best_so_far`: the line says so."""
    records = []
    if os.path.isfile(log_path):
        with open(log_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return f"finished; {checkpoint.last_path} holds the final weights"
    scored = [r for r in records if selected_by in r]  # epochs without an EMA validation (EMA.EVAL off then) aside
    if not scored:
        scored, selected_by = records, 'val_top1'
    best = max(scored, key=lambda r: r[selected_by])  # the first of equal maxima, as best.pth keeps it
    last = records[-1]
    what = 'val top-1' if selected_by == 'val_top1' else 'EMA val top-1'
    where = checkpoint.best_path
    if not os.path.isfile(checkpoint.best_path):
        above = f" {best_so_far:.2f}" if best_so_far is not None else ''
        where = f"not above the{above} of the checkpoint it resumed from, so no best.pth here"
    return (f"finished {_count(last['epoch'] + 1, 'epoch')}: best {what} {best[selected_by]:.2f} at epoch "
            f"{best['epoch']} ({where}), last {last.get(selected_by, last['val_top1']):.2f} ({checkpoint.last_path}); "
            f"log {log_path}")


def train(cfg: CN, info: DistInfo, check_data: bool = False) -> Dict[str, Any]:
    """Train `cfg` on this process's share of the data; return the last epoch's log record (or {}).

    With `check_data`, every image is decoded before training. Rank 0 holds the output folder's lock for the whole
    run. A run stopped by SIGTERM / SIGINT saves, then raises `Stopped`."""
    check_sync_bn(cfg, check_model_config(cfg), info)
    check_optimizer_config(cfg)
    resume = _resume_path(cfg)
    if resume is None:
        check_pretrained(cfg.MODEL.PRETRAINED, cfg.MODEL.PRETRAINED_EMA)
    elif not os.path.isfile(resume):
        raise UsageError(f"MODEL.RESUME {resume!r} (--resume) does not exist or is not a file; expected a training "
                         f"checkpoint of this engine, such as a run's last.pth")
    if cfg.TRAIN.ONEDNN:
        check_onednn(info.device, 'AMP.ENABLED' if cfg.AMP.ENABLED else None, 'TRAIN.ONEDNN')
    # the run to resume is read and compared with this one before the data is scanned, which can take minutes
    stored = _read_resumed(resume, auto=resume == os.path.join(cfg.OUTPUT, LAST)) if resume else None
    if stored is not None:
        TrainingCheckpoint.check_same_run(stored, resume, cfg)
        started = TrainingCheckpoint.started_from(stored, resume)
        if started and not cfg.MODEL.PRETRAINED:  # the checkpoints of every resumption name the run's start
            cfg = cfg.clone()
            cfg.defrost()
            cfg.MODEL.PRETRAINED = started
            cfg.freeze()
    # so are the weights to start from, read and matched with the model, where they lie in a file already (a
    # download waits for the data check)
    pretrained, held, trained_as = None, 'model', ''
    if stored is None and cfg.MODEL.PRETRAINED and os.path.isfile(cfg.MODEL.PRETRAINED):
        pretrained, held, trained_as = _read_start_file(cfg, cfg.MODEL.PRETRAINED)
        with warnings.catch_warnings():  # loading into the meta device copies nothing, which torch warns of per tensor
            warnings.filterwarnings('ignore', message='.*copying from a non-meta parameter')
            _with_start_weights(cfg, pretrained, lambda: create_model(
                cfg, pretrained, source=cfg.MODEL.PRETRAINED, device='meta', strict=cfg.MODEL.PRETRAINED_STRICT))
    lock = OutputLock(cfg.OUTPUT)
    try:
        return _train(cfg, info, lock, check_data, resume, stored, pretrained, held, trained_as)
    except Exception as e:  # a stop after saving has logged its own line
        if lock.fd is not None:  # the run took the folder: its log is this run's (the console has the error)
            _note_in_log_file(cfg.OUTPUT, error_line(e))
        raise
    finally:
        lock.release()
        _close_log_file(cfg.OUTPUT)


def _read_start_file(cfg: CN, path: str) -> Tuple[Dict[str, Tensor], str, str]:
    """The weights of the file `path` that MODEL.PRETRAINED_EMA picks (a release's EMA weights where it holds both,
    as its download gives), which they are ('EMA' or 'model'), and, where it is one of our checkpoints of another
    model than `cfg` builds, what differs ('' otherwise): a start from another attention's weights of the same
    shapes loads strictly, and the log says whose they are."""
    checkpoint = load_checkpoint_file(path)
    weights = checkpoint_weights(checkpoint, path, cfg.MODEL.PRETRAINED_EMA,
                                 without_ema='set MODEL.PRETRAINED_EMA False')
    held = 'EMA' if held_weights(checkpoint, weights_keys(checkpoint, cfg.MODEL.PRETRAINED_EMA)) == 'ema' else 'model'
    trained = stored_config(checkpoint, f"checkpoint {path!r}")
    return weights, held, ('; '.join(trained_as_another_model(trained, cfg)) if trained is not None else '')


def _read_start_weights(cfg: CN, path: str, released: bool = False) -> Dict[str, Tensor]:
    """The weights of the file `path` that MODEL.PRETRAINED_EMA picks, its EMA or its model weights; of the
    `released` weights of a model name, those `timm.create_model(name, pretrained=True)` takes."""
    return read_weights(path, cfg.MODEL.PRETRAINED_EMA, without_ema='set MODEL.PRETRAINED_EMA False',
                        released=released)


def _with_start_weights(cfg: CN, pretrained: Optional[Dict[str, Tensor]], build: Callable[[], nn.Module]) -> nn.Module:
    """`build()`, the model loaded with the MODEL.PRETRAINED weights `pretrained`; weights that do not fit it
    strictly raise with the way on: a start from the tensors they share, or, where they share under half of the
    model's (another family or size, which such a start would train mostly from scratch), weights of this model."""
    try:
        return build()
    except CheckpointError as e:
        if pretrained is None or not cfg.MODEL.PRETRAINED_STRICT:
            raise
        own = check_model_config(cfg).state_dict()
        shared = len(own.keys() & official_weights(cfg.MODEL.NAME, pretrained).keys())
        if 2 * shared < len(own):
            raise CheckpointError(f"{e}; it shares {shared} of the model's {len(own)} tensors by name, so it holds "
                                  f"weights of another architecture; expected weights of {cfg.MODEL.NAME} (or of "
                                  f"it with another attention)") from None
        raise CheckpointError(f"{e}; to start from the tensors the checkpoint shares with the model (such as another "
                              f"attention's weights), set MODEL.PRETRAINED_STRICT False") from None


def _read_resumed(path: str, auto: bool) -> Dict[str, Any]:
    """The training checkpoint `path`; where TRAIN.AUTO_RESUME found one that cannot be read, the error says how
    to go on."""
    try:
        return TrainingCheckpoint.read(path)
    except CheckpointError as e:
        if not auto:
            raise
        best = os.path.join(os.path.dirname(path), BEST)
        then = f", then --resume {best} goes on from the best epoch" if os.path.isfile(best) else \
            " to start the run again"
        raise CheckpointError(f"{e}; move it out of the output folder{then}") from None


def _train(cfg: CN, info: DistInfo, lock: OutputLock, check_data: bool, resume: Optional[str],
           stored: Optional[Dict[str, Any]], pretrained: Optional[Dict[str, Tensor]], held: str,
           trained_as: str) -> Dict[str, Any]:
    root = resolve_data_root(cfg, info)
    check_splits(root, ('train', 'val'))
    bad_images = cfg.DATA.BAD_IMAGES
    # a bad training image is replaced by the next readable one, so batches stay full and mixup keeps its pairs
    mode = image_mode(cfg)
    train_set = load_split(root, 'train', train_transform(cfg), cfg.MODEL.NUM_CLASSES, bad_images, replace_bad=True,
                           image_mode=mode)
    val_set = load_split(root, 'val', eval_transform(cfg), cfg.MODEL.NUM_CLASSES, bad_images, image_mode=mode)
    if train_set.classes != val_set.classes:
        difference = class_difference(train_set.classes, val_set.classes, 'train/', 'val/')
        raise UsageError(f"the class folders of {root}/train and {root}/val differ ({difference}); expected the same "
                         f"classes")
    output = cfg.OUTPUT
    stale_holder = main_process_first(info, lock.acquire, f"lock the output folder {output!r}")
    setup_logging(info, output)
    if info.is_main:
        if stale_holder is not None:
            logger.warning(f"took over the lock of a run that has ended ({stale_holder}) in {output}")
        removed = remove_stale_temp_files(output)
        if removed:
            logger.warning(f"removed {len(removed)} temporary file(s) of checkpoint writes killed before they "
                           f"finished: {', '.join(removed)}")
        report_scan(train_set)
        report_scan(val_set)
    if check_data:
        check_images(train_set, cfg, info)
        check_images(val_set, cfg, info)
    seed_everything(cfg.SEED + info.rank)
    train_loader = build_train_loader(cfg, train_set, info)
    val_loader = build_eval_loader(cfg, val_set, info, eval_batch_size(cfg))
    updates_per_epoch = len(train_loader.sampler.sampler) // cfg.DATA.BATCH_SIZE // cfg.TRAIN.ACCUMULATION_STEPS
    if updates_per_epoch == 0:
        raise UsageError(f"TRAIN.ACCUMULATION_STEPS {cfg.TRAIN.ACCUMULATION_STEPS} exceeds the "
                         f"{len(train_loader)} batches per epoch; expected fewer accumulation steps")

    main_process_first(info, lambda: _check_nothing_replaced(output, resume), f"check {output!r}")
    if stored is not None:
        TrainingCheckpoint.check_resumable(stored, resume, cfg.DATA.BATCH_SIZE, cfg.TRAIN.ACCUMULATION_STEPS,
                                           info.world_size)
        check_trained_classes(stored['classes'], train_set.classes, f"checkpoint {resume!r}",
                              os.path.join(root, 'train'))
    if cfg.MODEL.PRETRAINED and stored is None and pretrained is None:
        pretrained = _read_start_weights(cfg, weights_file(cfg.MODEL.PRETRAINED, 'MODEL.PRETRAINED', info),
                                         released=True)
    model = _with_start_weights(cfg, pretrained, lambda: create_training_model(
        cfg, info.device, pretrained, source=cfg.MODEL.PRETRAINED, strict=cfg.MODEL.PRETRAINED_STRICT,
        classes=train_set.classes))
    if pretrained is not None and info.is_main:
        if os.path.isfile(cfg.MODEL.PRETRAINED):
            of_run = f"; its run trained another model: {trained_as}" if trained_as else ''
            logger.info(f"started from the {held} weights of {cfg.MODEL.PRETRAINED} (MODEL.PRETRAINED_EMA "
                        f"{cfg.MODEL.PRETRAINED_EMA}){of_run}")
        else:
            logger.info(f"started from the weights of {cfg.MODEL.PRETRAINED}")
    ema = None
    if cfg.EMA.ENABLED:
        ema = ModelEmaV3(model, decay=ema_decay(cfg, info.world_size),
                         device=torch.device('cpu') if cfg.EMA.FORCE_CPU else None)
    lrs = scaled_lrs(cfg, info.world_size)
    optimizer = create_optimizer(cfg, model, lrs['lr'])
    scheduler, num_epochs = create_scheduler(cfg, optimizer, lrs, updates_per_epoch)
    amp_dtype = autocast_dtype(cfg, info.device, cfg.AMP.ENABLED)
    use_scaler = cfg.AMP.ENABLED and amp_dtype == 'float16'
    scaler = torch.amp.GradScaler(info.device.type, enabled=use_scaler)

    state = TrainState()
    checkpoint = TrainingCheckpoint(output, info, state, model, optimizer, scheduler, scaler, ema, cfg.dump(),
                                    classes=train_set.classes)
    if stored is not None:
        checkpoint.restore(stored, resume, updates_per_epoch * cfg.TRAIN.ACCUMULATION_STEPS,
                           cfg.TRAIN.ACCUMULATION_STEPS, cfg.TRAIN.LR_SCHEDULER.STEP)

    if cfg.TRAIN.SYNC_BN and info.distributed:
        model = synchronize_batchnorm(model, info)
    compiled = cfg.TRAIN.COMPILE
    # `model` stays plain for the checkpoints, the optimizer and the EMA; DDP wraps the compiled module
    eval_model = compile_model(model, cfg.TRAIN.COMPILE_MODE, cfg.TRAIN.COMPILE_BACKEND) if compiled else model
    train_model = eval_model
    if info.distributed:
        match_gradient_strides(model)
        train_model = DistributedDataParallel(
            eval_model, device_ids=[info.local_rank] if info.device.type == 'cuda' else None,
            find_unused_parameters=cfg.DIST.FIND_UNUSED_PARAMETERS)
        if ema is not None and stored is None:
            # each process built its model under its own seed; DDP has just given them all the first one's weights,
            # and the EMA starts from those too, or each process would average its own start into its EMA
            ema.set(model)
    train_timer, val_timer = CompileTimer('the training step', compiled), CompileTimer('validation', compiled)
    criterion = create_criterion(cfg)
    batch_augmentation = build_batch_augmentation(cfg, info.device)
    ema_validated = ema is not None and cfg.EMA.EVAL and not cfg.EMA.FORCE_CPU
    ema_selects_best = ema_validated and cfg.EMA.SELECTS_BEST
    epoch_options = EpochOptions(
        updates=updates_per_epoch, accumulation=cfg.TRAIN.ACCUMULATION_STEPS,
        schedule_per=cfg.TRAIN.LR_SCHEDULER.STEP, clip_grad=cfg.TRAIN.CLIP_GRAD,
        amp=cfg.AMP.ENABLED, amp_dtype=amp_dtype, max_nonfinite_steps=cfg.TRAIN.MAX_NONFINITE_STEPS,
        print_freq=cfg.PRINT_FREQ)

    # records of epochs this run trains (again) go: a run killed after logging an epoch but before saving it resumes
    # from the checkpoint before, and a fresh run starts a fresh log
    log_path = os.path.join(output, LOG)
    main_process_first(info, lambda: _drop_log_records(log_path, state.epoch), f"read {log_path}")
    if info.is_main:
        if state.epoch < num_epochs:  # the config of the checkpoints beside it: a run that trains nothing keeps it
            atomic_write_text(os.path.join(output, CONFIG), cfg.dump())
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(f"model {describe_model(cfg)}: {n_params / 1e6:.2f}M parameters; {len(train_set)} training and "
                    f"{len(val_set)} validation images in {_count(len(train_set.classes), 'class', 'classes')}")
        if len(train_set.classes) == 1:
            logger.warning(f"the dataset has 1 class ({train_set.classes[0]}): every prediction is that class, so "
                           f"top-1 is trivially 100 %; expected 2 or more classes for a meaningful accuracy")
        backbone_lr = ('' if cfg.TRAIN.BACKBONE_LR_SCALE == 1 else
                       f" ({lrs['lr'] * cfg.TRAIN.BACKBONE_LR_SCALE:.3e} outside the classifier: "
                       f"TRAIN.BACKBONE_LR_SCALE {cfg.TRAIN.BACKBONE_LR_SCALE:g})")
        logger.info(f"{info.world_size} process(es) on {info.device.type}, total batch "
                    f"{total_batch_size(cfg, info.world_size)}, lr {lrs['lr']:.3e}{backbone_lr}, "
                    f"{_count(updates_per_epoch, 'update')} per epoch, {_count(num_epochs, 'epoch')}; output {output}"
                    + (f"; compiled (torch.compile, backend {cfg.TRAIN.COMPILE_BACKEND}, mode "
                       f"{cfg.TRAIN.COMPILE_MODE})" if compiled else '')
                    + ('; products through oneDNN' if cfg.TRAIN.ONEDNN else ''))
        if cfg.TRAIN.WARMUP_EPOCHS >= cfg.TRAIN.EPOCHS:
            logger.warning(f"TRAIN.WARMUP_EPOCHS {cfg.TRAIN.WARMUP_EPOCHS} >= TRAIN.EPOCHS {cfg.TRAIN.EPOCHS}: the "
                           f"learning rate stays in its warm-up for the whole run, below TRAIN.BASE_LR")
        if lrs['min_lr'] > lrs['lr']:  # DeiT's recipe at a small total batch: BASE_LR scales, MIN_LR does not
            logger.warning(f"TRAIN.MIN_LR {lrs['min_lr']:.3e} is above the learning rate {lrs['lr']:.3e} "
                           f"(TRAIN.BASE_LR {cfg.TRAIN.BASE_LR:g} at total batch "
                           f"{total_batch_size(cfg, info.world_size)}, TRAIN.LR_SCALING {cfg.TRAIN.LR_SCALING}): the "
                           f"schedule rises to it instead of decaying; "
                           f"expected a lower TRAIN.MIN_LR, or TRAIN.LR_SCALING all, which scales it too")

    record: Dict[str, Any] = {}
    epochs_run, stopped = 0, False
    # a run that stopped, or whose validation failed, after an epoch's training resumes with that validation
    trained = stored.get('train_record') if stored is not None and stored['metrics'] is None else None
    if state.epoch >= num_epochs:
        logger.info(f"{resume} has trained {state.epoch} epoch(s) and TRAIN.EPOCHS is {num_epochs}: nothing to "
                    f"train (a larger TRAIN.EPOCHS goes on from it)")
    stop = StopSignal()
    with stop.installed(), compile_errors_reported(cfg.MODEL.NAME):
        while state.epoch < num_epochs:
            epoch = state.epoch
            last_epoch = epoch + 1 == num_epochs
            pause = cfg.TRAIN.EPOCHS_PER_RUN > 0 and epochs_run + 1 >= cfg.TRAIN.EPOCHS_PER_RUN
            due = last_epoch or pause or (epoch + 1) % cfg.SAVE_FREQ == 0
            if trained is None:
                train_loader.sampler.set_epoch(epoch, skip=state.epoch_batches * cfg.DATA.BATCH_SIZE)
                result = train_one_epoch(
                    train_model, train_loader, criterion, optimizer, scheduler, scaler, state, info,
                    replace(epoch_options, desc=f'epoch {epoch}/{num_epochs}'),
                    batch_augmentation=batch_augmentation, ema=ema,
                    stop_requested=stop, compile_timer=train_timer)
                finished = state.epoch_batches >= epoch_options.updates * epoch_options.accumulation
                if result.stopped and not finished:
                    checkpoint.save()
                    logger.info(f"stopped at epoch {epoch} batch {state.epoch_batches} (step {state.step}); "
                                f"{checkpoint.last_path} resumes it")
                    stopped = True
                    break
                # one model is saved and validated: the processes' BatchNorm statistics averaged
                average_batchnorm_statistics(model, info)
                if ema is not None:
                    average_batchnorm_statistics(ema.module, info)
                skipped = all_reduce_sum([len(train_loader.skipped)], info.device)[0]
                trained = dict(train_loss=result.loss, lr=result.lr, epoch_seconds=result.seconds,
                               images_per_second=result.images / max(result.seconds, 1e-9),
                               skipped_train_images=int(skipped))
                # the epoch's training is saved before validation reads a single image, so a bad validation image
                # or a stop costs the validation only
                if due or result.stopped:
                    checkpoint.save(train_record=trained)
                if result.stopped:
                    logger.info(f"stopped after the training of epoch {epoch} (step {state.step}); "
                                f"{checkpoint.last_path} resumes with its validation")
                    stopped = True
                    break
            val = evaluate(eval_model, val_loader, info, amp=cfg.AMP.ENABLED and cfg.AMP.EVAL,
                           amp_dtype=amp_dtype, desc='val', compile_timer=val_timer)
            record = dict(epoch=epoch, step=state.step, train_loss=trained['train_loss'], lr=trained['lr'],
                          val_loss=val['loss'], val_top1=val['top1'], val_top5=val['top5'])
            is_best = val['top1'] > state.max_accuracy or epoch == 0
            state.max_accuracy = max(state.max_accuracy, val['top1'])
            if ema_validated:
                ema_val = evaluate(ema.module, val_loader, info, amp=cfg.AMP.ENABLED and cfg.AMP.EVAL,
                                   amp_dtype=amp_dtype, desc='val ema')
                if ema_selects_best:
                    is_best = ema_val['top1'] > state.max_ema_accuracy or epoch == 0
                state.max_ema_accuracy = max(state.max_ema_accuracy, ema_val['top1'])
                record.update(ema_val_top1=ema_val['top1'], ema_val_top5=ema_val['top5'])
            skipped_train = trained['skipped_train_images']
            skipped_val = int(all_reduce_sum([len(val_loader.skipped)], info.device)[0])
            record.update(max_val_top1=state.max_accuracy, epoch_seconds=trained['epoch_seconds'],
                          images_per_second=trained['images_per_second'], skipped_images=skipped_train + skipped_val)
            trained = None
            epochs_run += 1
            if info.is_main:
                _append_log(os.path.join(output, LOG), record)
                ema_text = f", ema top-1 {record['ema_val_top1']:.2f}" if 'ema_val_top1' in record else ''
                logger.info(f"epoch {epoch}: train loss {record['train_loss']:.4f}, lr {record['lr']:.3e}, val top-1 "
                            f"{val['top1']:.2f} (max {state.max_accuracy:.2f}) top-5 {val['top5']:.2f}{ema_text}, "
                            f"{record['images_per_second']:.0f} img/s")
                if record['skipped_images']:
                    logger.warning(f"epoch {epoch}: skipped {skipped_train} training and {skipped_val} validation "
                                   f"image(s) that could not be read (DATA.BAD_IMAGES 'skip')")
            # a checkpoint with its epoch's record resumes at the next epoch: saved before the epoch moves on
            stop_now = any_rank(stop(), info.device)
            if is_best or due or stop_now:
                checkpoint.save(record, best=is_best)
            state.next_epoch()
            if pause and not last_epoch:
                logger.info(f"paused after {epochs_run} epoch(s) (TRAIN.EPOCHS_PER_RUN); run again to continue")
                break
            if stop_now:
                stopped = True
                break
        barrier()
        # ranks that got no signal themselves stopped with the others: all exit with the signal they got
        signums = all_gather_objects(stop.received) if stopped else []
    if info.is_main and not stopped and state.epoch >= num_epochs:
        logger.info(_summary(os.path.join(output, LOG), checkpoint,
                             'ema_val_top1' if ema_selects_best else 'val_top1',
                             state.max_ema_accuracy if ema_selects_best else state.max_accuracy))
    if stopped:
        raise Stopped(next(s for s in signums if s is not None), checkpoint.last_path)
    return record

