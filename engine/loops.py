"""The training epoch, the evaluation pass with exact counts over processes, and the throughput measurement."""
import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
from timm.utils import AverageMeter, accuracy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from .compile import CompileTimer, plain_module
from .distributed import DistInfo, all_reduce_sum, any_rank
from .errors import NonFiniteLossError, UsageError

__all__ = ['TrainState', 'EpochOptions', 'EpochResult', 'Progress', 'autocast', 'schedule_position', 'step_schedule',
           'train_one_epoch', 'evaluate', 'measure_throughput']

AMP_DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16}
logger = logging.getLogger('engine')


@dataclass
class TrainState:
    """Where training stands: `epoch` in progress, `epoch_batches` of it trained, `step` optimizer updates;
    `epoch_loss_sum` and `epoch_loss_count`, the training loss of the epoch so far summed over its images on every
    process, and those images (so that an epoch resumed mid-way reports the mean over all of it); `skipped_steps`
    updates dropped for a non-finite loss in this run (not checkpointed)."""
    epoch: int = 0
    epoch_batches: int = 0
    step: int = 0
    max_accuracy: float = 0.0
    max_ema_accuracy: float = 0.0
    epoch_loss_sum: float = 0.0
    epoch_loss_count: float = 0.0
    skipped_steps: int = 0

    def next_epoch(self) -> None:
        """Stand at the start of the next epoch."""
        self.epoch, self.epoch_batches = self.epoch + 1, 0
        self.epoch_loss_sum = self.epoch_loss_count = 0.0


def schedule_position(state: TrainState, updates_per_epoch: int, accumulation: int) -> int:
    """The update count the schedule is at: the epochs before at this run's `updates_per_epoch`, then this epoch's
    updates so far. Skipped updates count, as timm's and Swin's loops count them, so each epoch starts where the
    schedule puts it, whatever batch size or process count trained the epochs before, and a run ends at the
    schedule's end."""
    return state.epoch * updates_per_epoch + state.epoch_batches // accumulation


def step_schedule(scheduler, state: TrainState, updates_per_epoch: int, accumulation: int, per: str) -> None:
    """Set the learning rate of the next update (TRAIN.LR_SCHEDULER.STEP `per`): the schedule at the update count
    ('update': Swin, InLine, FLatten), at the epoch that update falls in ('epoch': timm's train.py and CSwin step
    it with the epoch about to start), or at the epoch before ('previous_epoch': DeiT's loop, and PVT's and SimA's
    after it, step it with the epoch just trained, so epochs 0 and 1 both run at the warm-up's start)."""
    position = schedule_position(state, updates_per_epoch, accumulation)
    if per == 'update':
        scheduler.step_update(num_updates=position)
    else:
        epoch = position // updates_per_epoch
        scheduler.step(epoch=max(epoch - 1, 0) if per == 'previous_epoch' else epoch)


@dataclass(frozen=True)
class EpochOptions:
    """How `train_one_epoch` trains: `updates` optimizer updates of `accumulation` batches each, the schedule
    stepped `schedule_per` update or epoch (`step_schedule`), gradient norms clipped to `clip_grad` (None: not
    clipped), autocast to `amp_dtype` when `amp`, at most `max_nonfinite_steps` updates skipped for a non-finite
    loss in the run, the progress bar `desc` refreshed every `print_freq` batches."""
    updates: int
    accumulation: int = 1
    schedule_per: str = 'update'
    clip_grad: Optional[float] = None
    amp: bool = False
    amp_dtype: str = 'float16'
    max_nonfinite_steps: int = 0
    print_freq: int = 10
    desc: str = ''


@dataclass
class EpochResult:
    loss: float
    lr: float
    images: int
    seconds: float
    stopped: bool


PLAIN_PROGRESS_SECONDS = 60.0


class Progress:
    """Progress over `total` steps: a live bar when stderr is a terminal, else a plain `engine` log line every
    `interval` seconds (default `PLAIN_PROGRESS_SECONDS`), so a log file or a pipe gets whole lines instead of bar
    fragments. `enabled=False` (ranks other than 0) shows nothing.
    """

    def __init__(self, total: int, desc: str, *, initial: int = 0, enabled: bool = True,
                 interval: Optional[float] = None):
        self.total, self.desc, self.count = total, desc, initial
        self.interval = PLAIN_PROGRESS_SECONDS if interval is None else interval
        self.live = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.live
        self.postfix: Dict[str, str] = {}
        self.start = self.last = time.perf_counter()
        self.initial = initial
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not self.live, dynamic_ncols=True,
                        leave=False, mininterval=0.5)

    def update(self, n: int = 1) -> None:
        self.count += n
        self.bar.update(n)
        now = time.perf_counter()
        if self.plain and now - self.last >= self.interval:
            self.last = now
            logger.info(self.line(now))

    def set_postfix(self, **values: str) -> None:
        self.postfix = values
        self.bar.set_postfix(values)

    def line(self, now: float) -> str:
        """`desc count/total (pct%), key value ..., elapsed / remaining time`."""
        elapsed = now - self.start
        done = self.count - self.initial
        remaining = elapsed / done * (self.total - self.count) if done > 0 else float('nan')
        values = ''.join(f', {k} {v}' for k, v in self.postfix.items())
        percent = 100.0 * self.count / max(self.total, 1)
        return (f"{self.desc} {self.count}/{self.total} ({percent:.0f}%){values}, {_duration(elapsed)} elapsed, "
                f"{_duration(remaining)} left")

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> 'Progress':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return '?'
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f'{hours}:{minutes:02d}:{secs:02d}' if hours else f'{minutes}:{secs:02d}'


def autocast(device: torch.device, enabled: bool, dtype: str):
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[dtype], enabled=enabled)


def train_one_epoch(
        model: nn.Module,
        loader: DataLoader,
        criterion: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        scaler: torch.amp.GradScaler,
        state: TrainState,
        info: DistInfo,
        options: EpochOptions,
        *,
        batch_augmentation: Optional[Callable] = None,
        ema=None,
        stop_requested: Callable[[], bool] = lambda: False,
        compile_timer: Optional[CompileTimer] = None,
) -> EpochResult:
    """Train the batches of `state.epoch` from `state.epoch_batches` up to `options.updates * options.accumulation`.

    After each optimizer update the schedule moves on (`step_schedule`) and the EMA follows the model. When
    `stop_requested()` is true on any process at an update boundary, the epoch ends early with `stopped` set.
    An update whose loss is non-finite on any process is skipped on all of them (no backward, and weights,
    optimizer, scaler, EMA and schedule stay as they were); once more than `options.max_nonfinite_steps`
    updates were skipped in this run, `NonFiniteLossError` is raised on every process. `model` may be compiled
    (inside DDP or not); `compile_timer` gets the time of each batch's step.
    """
    model.train()
    total = options.updates * options.accumulation
    loss_meter = AverageMeter()
    parameters = [p for p in model.parameters() if p.requires_grad]
    # second-order optimizers (timm's AdaHessian) differentiate the gradients, as timm's train.py lets them
    second_order = getattr(optimizer, 'is_second_order', False)
    lr = optimizer.param_groups[0]['lr']
    stopped = update_skipped = False
    start, images = time.perf_counter(), 0
    with Progress(total, options.desc, initial=state.epoch_batches, enabled=info.is_main) as bar:
        for images_batch, targets in loader:
            if state.epoch_batches >= total:
                break
            step_start = time.perf_counter()
            images_batch = images_batch.to(info.device, non_blocking=True)
            targets = targets.to(info.device, non_blocking=True)
            if batch_augmentation is not None:  # mixup / CutMix (and erasing after it)
                images_batch, targets = batch_augmentation(images_batch, targets)
            update = (state.epoch_batches + 1) % options.accumulation == 0
            if state.epoch_batches % options.accumulation == 0:
                update_skipped = False
            sync = contextlib.nullcontext()
            if isinstance(model, DistributedDataParallel) and not update:
                sync = model.no_sync()
            with sync:
                with autocast(info.device, options.amp, options.amp_dtype):
                    loss = criterion(model(images_batch), targets)
                loss_value = loss.item()
                # every process must take the same branch (a backward on some processes only would hang DDP), and
                # the sum over processes is non-finite exactly when a process's loss is
                finite = math.isfinite(all_reduce_sum([loss_value], info.device)[0])
                if finite and not update_skipped:
                    scaler.scale(loss / options.accumulation).backward(create_graph=second_order)
            if not finite and not update_skipped:
                update_skipped = True
                state.skipped_steps += 1
                where = f"step {state.step} (epoch {state.epoch}, batch {state.epoch_batches})"
                if state.skipped_steps > options.max_nonfinite_steps:
                    raise NonFiniteLossError(
                        f"the training loss is not finite at {where} after {state.skipped_steps - 1} skipped "
                        f"step(s) (TRAIN.MAX_NONFINITE_STEPS {options.max_nonfinite_steps}); expected a finite loss: "
                        f"lower the learning rate or set TRAIN.CLIP_GRAD")
                if info.is_main:
                    logger.warning(f"skipping {where}: the training loss is not finite "
                                   f"({state.skipped_steps}/{options.max_nonfinite_steps} skipped)")
            if not update_skipped:
                loss_meter.update(loss_value, images_batch.shape[0])
            state.epoch_batches += 1
            images += images_batch.shape[0] * info.world_size
            if update:
                lr = optimizer.param_groups[0]['lr']
                if update_skipped:
                    optimizer.zero_grad(set_to_none=True)
                else:
                    if options.clip_grad is not None:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(parameters, options.clip_grad)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                    state.step += 1
                    if ema is not None:
                        ema.update(plain_module(model))
                step_schedule(scheduler, state, options.updates, options.accumulation, options.schedule_per)
                if any_rank(stop_requested(), info.device):
                    stopped = True
            if compile_timer is not None:
                compile_timer.record(time.perf_counter() - step_start)
            if state.epoch_batches % options.print_freq == 0:
                rate = images / max(time.perf_counter() - start, 1e-9)
                shown = loss_meter.avg if loss_meter.count else math.nan  # every update so far skipped
                bar.set_postfix(loss=f'{shown:.4f}', lr=f'{lr:.3e}', img_s=f'{rate:.0f}')
            bar.update(1)
            if stopped:
                break
    loss_sum, count = all_reduce_sum([loss_meter.sum, loss_meter.count], info.device)
    state.epoch_loss_sum += loss_sum
    state.epoch_loss_count += count
    # an epoch whose every update was skipped has no loss to report; NaN says so where 0 would read as a perfect fit
    loss = state.epoch_loss_sum / state.epoch_loss_count if state.epoch_loss_count else math.nan
    return EpochResult(loss=loss, lr=lr, images=images, seconds=time.perf_counter() - start, stopped=stopped)


def _nothing_read(loader: DataLoader) -> UsageError:
    """The error for an evaluation in which no process read an image: every file was left out as unreadable
    (`DATA.BAD_IMAGES` 'skip'), which would otherwise report accuracy over no image."""
    skipped = sorted(getattr(loader, 'skipped', ()))
    first = f", the first here: {skipped[0]}" if skipped else ''
    return UsageError(f"the evaluation read no image: DATA.BAD_IMAGES 'skip' left out every file as unreadable "
                      f"({len(skipped)} on this process{first}); expected a split with images that can be read "
                      f"(--check-data lists the files that cannot)")


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, info: DistInfo, *, amp: bool = False,
             amp_dtype: str = 'float16', desc: str = '',
             compile_timer: Optional[CompileTimer] = None) -> Dict[str, float]:
    """Top-1 / top-5 (%) and mean cross-entropy over the whole set: each process counts its own shard (no
    padding) and the counts are summed, so the result is exact for any world size. `compile_timer` gets the
    time of each batch's forward."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction='sum')
    correct1 = correct5 = loss_sum = count = 0.0
    progress = Progress(len(loader), desc, enabled=info.is_main)
    for images, targets in loader:
        images = images.to(info.device, non_blocking=True)
        targets = targets.to(info.device, non_blocking=True)
        begin = time.perf_counter()
        with autocast(info.device, amp, amp_dtype):
            output = model(images)
        output = output.float()
        if compile_timer is not None:
            compile_timer.record(time.perf_counter() - begin)
        n = targets.shape[0]
        top1, top5 = accuracy(output, targets, topk=(1, 5))
        correct1 += round(top1.item() * n / 100)  # timm reports percentages of this batch
        correct5 += round(top5.item() * n / 100)
        loss_sum += criterion(output, targets).item()
        count += n
        progress.update()
    progress.close()
    correct1, correct5, loss_sum, count = all_reduce_sum([correct1, correct5, loss_sum, count], info.device)
    if not count:
        raise _nothing_read(loader)
    return dict(top1=100.0 * correct1 / count, top5=100.0 * correct5 / count, loss=loss_sum / count,
                count=int(count))


@torch.no_grad()
def measure_throughput(model: nn.Module, images: torch.Tensor, info: DistInfo, *, amp: bool = False,
                       amp_dtype: str = 'float16', warmup: int = 50, timed: int = 30,
                       compile_timer: Optional[CompileTimer] = None) -> float:
    """Images per second of `model` on one batch: `warmup` forwards, then `timed` forwards timed (official).

    The first warm-up forward is logged with its rate and the time the whole measurement will take, so a slow
    device shows a first result within one forward. A model still to compile (an enabled `compile_timer`, which
    gets the time of each untimed forward) runs one forward more first, which compiles it, so that neither the
    estimate nor the timed forwards include the compilation, whatever the number of warm-up forwards.
    """
    model.eval()
    images = images.to(info.device)
    compiling = compile_timer is not None and compile_timer.enabled

    def sync():
        if info.device.type == 'cuda':
            torch.cuda.synchronize(info.device)

    with autocast(info.device, amp, amp_dtype), Progress(compiling + warmup + timed, 'throughput',
                                                         enabled=info.is_main, interval=10.0) as progress:
        for i in range(-1 if compiling else 0, warmup):
            begin = time.perf_counter()
            model(images)
            if compile_timer is not None:
                sync()
                compile_timer.record(time.perf_counter() - begin)
            if i == 0:
                sync()
                first = time.perf_counter() - begin
                if info.is_main:
                    which = 'first forward after compiling' if compiling else 'first forward'
                    logger.info(f"{which}: {images.shape[0] / first:.1f} images/s; {warmup} warm-up and "
                                f"{timed} timed forwards of {images.shape[0]} images take about "
                                f"{_duration(first * (warmup + timed - 1))}")
            progress.update()
        sync()
        start = time.perf_counter()
        for _ in range(timed):
            model(images)
            progress.update()
        sync()
    return timed * images.shape[0] / (time.perf_counter() - start)
