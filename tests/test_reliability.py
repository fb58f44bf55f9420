"""Reliability of training: a non-finite loss skips the update or stops the run with a one-line error and the last
checkpoint intact; SIGTERM / SIGINT save and exit with 128 + the signal (and resume exactly with DataLoader workers),
a second signal stops at once and saves nothing; a bad torchrun environment is one line; every attention trains under
float16 autocast with the gradient scaler; a run killed with SIGKILL resumes to exactly the weights and metrics of an
uninterrupted run, keeps `best.pth` and leaves no temp files or lock behind; one run at a time per output folder; an
unwritable or full output folder is one line; a resume with another batch split never retrains a finished epoch; a
rank that dies ends the others."""
import errno
import io
import glob
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from timm.utils import ModelEmaV3
from torch import nn

import engine.checkpoint
import engine.loops
import engine.trainer
from engine.build import create_criterion, create_model, create_optimizer, create_scheduler
from engine.checkpoint import OutputLock, TrainingCheckpoint
from engine.cli import eval_main, train_main
from engine.config import config_from_yaml_string, load_config, scaled_lrs
from engine.data import build_train_loader, load_split, train_transform
from engine.distributed import DistInfo, cleanup_distributed, each_node_first, init_distributed, main_process_first
from engine.errors import USAGE_EXIT_CODE, NonFiniteLossError, UsageError, run_cli
from engine.loops import EpochOptions, TrainState, train_one_epoch
from models.attention import list_attentions

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml')
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu'))
ATTENTIONS = list_attentions()
# 22 updates per epoch instead of 89: the runs below only need a few.
SHORT = ['DATA.BATCH_SIZE', '64']
TIMING = ('epoch_seconds', 'images_per_second')


def records(output: Path):
    with open(output / 'log.jsonl') as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


class RecordingScheduler:
    def __init__(self):
        self.updates = []

    def step_update(self, num_updates: int) -> None:
        self.updates.append(num_updates)


def nan_at(criterion: nn.Module, calls: set):
    """`criterion` whose result is NaN on the given (0-based) calls."""
    count = [0]

    def loss(output, target):
        value = criterion(output, target)
        count[0] += 1
        return value * float('nan') if count[0] - 1 in calls else value

    return loss


def linear_run(batches, bad_calls: set, max_nonfinite_steps: int, accumulation: int = 1):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ema = ModelEmaV3(model, decay=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = RecordingScheduler()
    state = TrainState()
    options = EpochOptions(updates=len(batches) // accumulation, accumulation=accumulation,
                           max_nonfinite_steps=max_nonfinite_steps)
    train_one_epoch(model, batches, nan_at(nn.CrossEntropyLoss(), bad_calls), optimizer, scheduler,
                    torch.amp.GradScaler('cpu', enabled=False), state, CPU, options, ema=ema)
    return model, ema, optimizer, scheduler, state


def linear_batches(n: int):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(n)]


def assert_same_training(a, b) -> None:
    model_a, ema_a, optimizer_a, scheduler_a, state_a = a
    model_b, ema_b, optimizer_b, scheduler_b, state_b = b
    for x, y in zip([*model_a.parameters(), *ema_a.module.parameters()],
                    [*model_b.parameters(), *ema_b.module.parameters()]):
        assert torch.equal(x, y)
    assert state_a.step == state_b.step
    for index, values in optimizer_a.state_dict()['state'].items():
        for name, value in values.items():
            assert torch.equal(value, optimizer_b.state_dict()['state'][index][name]), (index, name)


def test_a_skipped_update_changes_nothing():
    batches = linear_batches(5)
    skipped = linear_run(batches, {1, 3}, max_nonfinite_steps=2)
    clean = linear_run([batches[0], batches[2], batches[4]], set(), max_nonfinite_steps=0)
    assert skipped[4].skipped_steps == 2 and skipped[4].epoch_batches == 5
    # the schedule follows the position in the epoch, as timm's and Swin's loops step it: a skipped update has
    # still passed its data, and the run ends at the schedule's end
    assert skipped[3].updates == [1, 2, 3, 4, 5] and clean[3].updates == [1, 2, 3]
    assert_same_training(skipped, clean)


def test_a_non_finite_micro_batch_drops_its_whole_accumulated_update():
    batches = linear_batches(6)
    skipped = linear_run(batches, {2}, max_nonfinite_steps=1, accumulation=2)  # batches 2 and 3 are one update
    clean = linear_run(batches[:2] + batches[4:], set(), max_nonfinite_steps=0, accumulation=2)
    assert skipped[4].skipped_steps == 1 and skipped[4].step == 2
    assert skipped[3].updates == [1, 2, 3] and clean[3].updates == [1, 2]
    assert_same_training(skipped, clean)


def test_an_epoch_of_skipped_updates_reports_no_loss():
    """The mean training loss of an epoch whose every update was skipped is NaN (nothing measured), not 0."""
    model = nn.Linear(4, 3)
    options = EpochOptions(updates=3, max_nonfinite_steps=3)
    run = dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=RecordingScheduler(),
               scaler=torch.amp.GradScaler('cpu', enabled=False), info=CPU, options=options)
    criterion = nn.CrossEntropyLoss()
    skipped = train_one_epoch(model, linear_batches(3), nan_at(criterion, {0, 1, 2}), state=TrainState(), **run)
    assert math.isnan(skipped.loss) and skipped.images == 24
    clean = train_one_epoch(model, linear_batches(3), criterion, state=TrainState(), **run)
    assert math.isfinite(clean.loss) and clean.loss > 0


def test_the_log_stays_strict_json_with_a_loss_that_is_not_finite(tmp_path):
    """Python's json writes NaN, which JSON has not: a reader other than Python refused the line."""
    log = tmp_path / 'log.jsonl'
    engine.trainer._append_log(str(log), dict(epoch=0, train_loss=math.nan, val_loss=0.5, val_top1=10.0))
    line = log.read_text()
    assert line == '{"epoch": 0, "train_loss": null, "val_loss": 0.5, "val_top1": 10.0}\n'
    json.loads(line, parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}"))


def test_more_non_finite_steps_than_allowed_raise_naming_the_step():
    with pytest.raises(NonFiniteLossError, match=r"^the training loss is not finite at step 2 \(epoch 0, batch 3\) "
                                                 r"after 1 skipped step\(s\) \(TRAIN.MAX_NONFINITE_STEPS 1\)"):
        linear_run(linear_batches(5), {1, 3}, max_nonfinite_steps=1)


@pytest.fixture(scope='module')
def one_epoch(tmp_path_factory, digits) -> Path:
    """The output folder of a run paused after epoch 0 (22 updates)."""
    output = tmp_path_factory.mktemp('one_epoch')
    assert run_cli(train_main, [*train_argv(output, digits), 'TRAIN.EPOCHS_PER_RUN', '1']) == 0
    return output


def train_argv(output: Path, digits: Path):
    return ['--cfg', TINY, '--output', str(output), '--data-path', str(digits), '--opts', *SHORT]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, digits) -> Path:
    """The output folder of a run of both epochs without a stop, where a stopped or killed run must end too."""
    output = tmp_path_factory.mktemp('uninterrupted')
    assert run_cli(train_main, train_argv(output, digits)) == 0
    return output


def test_a_non_finite_loss_stops_training_with_exit_status_2_and_keeps_last_checkpoint(
        tmp_path, digits, one_epoch, monkeypatch, capsys):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    last = output / 'last.pth'
    saved = last.read_bytes()
    assert torch.load(last, weights_only=True)['step'] == 22

    real_create_criterion = engine.trainer.create_criterion
    monkeypatch.setattr(engine.trainer, 'create_criterion', lambda cfg: nan_at(real_create_criterion(cfg), {5}))
    capsys.readouterr()
    assert run_cli(train_main, train_argv(output, digits)) == USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert 'Traceback' not in err  # the progress bar clears its line; the message is the last one
    assert err.splitlines()[-1] == ("error: the training loss is not finite at step 27 (epoch 1, batch 5) after 0 "
                                    "skipped step(s) (TRAIN.MAX_NONFINITE_STEPS 0); expected a finite loss: lower "
                                    "the learning rate or set TRAIN.CLIP_GRAD")
    assert last.read_bytes() == saved
    assert [r['epoch'] for r in records(output)] == [0]
    assert sorted(p.name for p in output.iterdir()) == ['best.pth', 'config.yaml', 'last.pth', 'log.jsonl',
                                                        'train.log']


def signals_at(monkeypatch, *sends, workers_too: bool = False):
    """Make the loop's per-update stop check send (call number, signal) pairs to this process (`workers_too`: and
    to its DataLoader workers, as a signal to the process group reaches them); a signal sent during update u is seen
    at the end of update u + 1."""
    real_any_rank = engine.loops.any_rank
    calls = []

    def any_rank(flag, device):
        calls.append(flag)
        for call, signum in sends:
            if len(calls) == call:
                for worker in multiprocessing.active_children() if workers_too else ():
                    os.kill(worker.pid, signum)
                os.kill(os.getpid(), signum)
        return real_any_rank(flag, device)

    monkeypatch.setattr(engine.loops, 'any_rank', any_rank)


def checkpoints(output: Path):
    """The bytes of every checkpoint and of the metrics log in `output` (a resumed run rewrites its config and
    appends to train.log)."""
    return {p.name: p.read_bytes() for p in output.iterdir() if p.suffix == '.pth' or p.name == 'log.jsonl'}


def saved_steps(output: Path) -> Dict[str, int]:
    """The training step each checkpoint in `output` was saved at, read whole."""
    return {p.name: TrainingCheckpoint.read(str(p))['step'] for p in output.iterdir() if p.suffix == '.pth'}


# Loaded at the start of every Python process that has its folder on PYTHONPATH: sends the process SIGINT, as
# Ctrl-C in a terminal does, when the import of a module matching INTERRUPT_AT begins.
INTERRUPTING_SITECUSTOMIZE = """
import importlib.abc, os, re, signal, sys

class InterruptAtImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if re.fullmatch(os.environ['INTERRUPT_AT'], name):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAtImport())
"""


@pytest.mark.parametrize('script, module', [(script, 'torch') for script in ['train.py', 'eval.py'] + sorted(
    os.path.relpath(path, REPO) for path in glob.glob(str(REPO / 'scripts' / '*.py')))] + [
    ('train.py', 'timm'), ('train.py', r'numpy\.lib\._?nanfunctions(_impl)?')])
def test_ctrl_c_while_the_modules_load_exits_130_without_a_traceback(tmp_path, script, module):
    """The first seconds of a command import torch, timm and the models (about 4 s on two cores): Ctrl-C there
    printed a 67-line KeyboardInterrupt traceback through the imports, in the training and evaluation commands and
    in every script; inside numpy's imports the interrupt turned into a RecursionError, or was lost."""
    (tmp_path / 'sitecustomize.py').write_text(INTERRUPTING_SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), INTERRUPT_AT=module)
    # Ctrl-C as a terminal delivers it, also where this test runs with SIGINT ignored (a job started in the
    # background without job control), which the command would inherit
    done = subprocess.run([sys.executable, str(REPO / script), '--help'], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (done.returncode, done.stdout, done.stderr) == (130, '', '')


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGHUP])
def test_sigint_and_sighup_save_after_the_current_step_and_exit_with_128_plus_the_signal(
        tmp_path, digits, one_epoch, monkeypatch, capsys, signum):
    """...and SIGHUP, which a closed terminal or ssh session sends (and torchrun passes on), as SIGTERM: it ended
    the run at once with status 129, without saving, losing the steps since the last save."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    signals_at(monkeypatch, (3, signum))
    original = signal.getsignal(signum)
    # a suite run under nohup ignores SIGHUP, which a run then keeps ignoring
    handler = signal.SIG_DFL if original is signal.SIG_IGN else original
    signal.signal(signum, handler)
    capsys.readouterr()
    try:
        assert run_cli(train_main, train_argv(output, digits)) == 128 + signum
        assert signal.getsignal(signum) is handler  # the run put back the handler it found
    finally:
        signal.signal(signum, original)
    name = signal.Signals(signum).name
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: stopped by {name} after saving {output / 'last.pth'}; "
                                                        f"run the same command again to resume")
    stopped = torch.load(output / 'last.pth', weights_only=True)
    assert (stopped['epoch'], stopped['epoch_batches'], stopped['step']) == (1, 4, 26)
    assert f'received {name}: saving a checkpoint after this step' in (output / 'train.log').read_text()
    assert not (output / '.train.lock').exists()

    # in the middle of an epoch, another batch size would point elsewhere in it: refused before any training
    saved = checkpoints(output)
    monkeypatch.undo()
    assert run_cli(train_main, [*train_argv(output, digits), 'DATA.BATCH_SIZE', '32']) == USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert err == (f"error: checkpoint {str(output / 'last.pth')!r} stopped in the middle of epoch 1 (batch 4) with "
                   f"DATA.BATCH_SIZE 64 (this run: 32); expected the same values until that epoch ends\n")
    assert checkpoints(output) == saved


def test_a_run_started_with_sighup_ignored_outlives_a_hangup(tmp_path, digits, one_epoch, monkeypatch, capsys):
    """`nohup python train.py ... &` ignores SIGHUP so that the run outlives its terminal; the run set its own
    handler over that, saved and stopped with status 129 when the terminal closed."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    signals_at(monkeypatch, (3, signal.SIGHUP))
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert run_cli(train_main, train_argv(output, digits)) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert [r['epoch'] for r in records(output)] == [0, 1]
    assert 'received SIGHUP' not in (output / 'train.log').read_text()


@pytest.mark.parametrize('how', ['TRAIN.AUTO_RESUME False', 'MODEL.RESUME of another run'])
def test_a_fresh_run_into_a_folder_holding_a_run_is_refused_and_replaces_nothing(tmp_path, digits, one_epoch, capsys,
                                                                                how):
    output, other = tmp_path / 'run', tmp_path / 'other'
    shutil.copytree(one_epoch, output)
    shutil.copytree(one_epoch, other)
    before = checkpoints(output)
    opts = ['TRAIN.AUTO_RESUME', 'False'] if how.startswith('TRAIN') else ['MODEL.RESUME', str(other / 'last.pth')]
    assert run_cli(train_main, train_argv(output, digits) + opts) == USAGE_EXIT_CODE
    source = 'TRAIN.AUTO_RESUME is False' if how.startswith('TRAIN') else f"MODEL.RESUME is {str(other / 'last.pth')}"
    assert capsys.readouterr().err == (
        f"error: output folder {str(output)!r} holds the checkpoints of a run ({output / 'last.pth'}) that this run "
        f"would replace, since {source}; expected a folder without one: choose another --output, or resume that run "
        f"({'TRAIN.AUTO_RESUME True' if how.startswith('TRAIN') else 'without --resume'})\n")
    assert checkpoints(output) == before


@pytest.mark.parametrize('opts, changes', [
    (['MODEL.NAME', 'softmax_deit_tiny'], "MODEL.NAME 'inline_deit_tiny' (this run: 'softmax_deit_tiny')"),
    (['MODEL.KWARGS.depth', '3'], "MODEL.KWARGS.depth 2 (this run: 3)"),
    (['DATA.IMG_SIZE', '32'], "DATA.IMG_SIZE 16 (this run: 32)"),
])
def test_a_run_of_another_model_is_not_resumed_and_is_refused_before_the_data_is_read(tmp_path, one_epoch, capsys,
                                                                                     opts, changes):
    """Another model with the same tensor shapes (softmax, SimA and linear DeiT share every one) went on from the
    stored model's weights, optimizer and epoch, where a config change is only reported; another image size was
    blamed on 'another model' with the very name and keywords of this run. The data path does not exist: the
    refusal comes before any scan."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    before = checkpoints(output)
    assert run_cli(train_main, [*train_argv(output, tmp_path / 'no-data'), *opts]) == USAGE_EXIT_CODE
    last = str(output / 'last.pth')
    assert capsys.readouterr().err == (
        f"error: checkpoint {last!r} holds a run of another model: {changes}; expected that model to resume it "
        f"(another model: another --output; to start from its weights: --pretrained {last} with another --output)\n")
    assert checkpoints(output) == before


@pytest.mark.parametrize('opts, changes', [
    (['TRAIN.OPTIMIZER.NAME', 'adan'], "TRAIN.OPTIMIZER.NAME 'adamw' (this run: 'adan')"),
    (['TRAIN.OPTIMIZER.NAME', 'lamb'], "TRAIN.OPTIMIZER.NAME 'adamw' (this run: 'lamb')"),
    (['TRAIN.BACKBONE_LR_SCALE', '0.1'], "TRAIN.BACKBONE_LR_SCALE 1.0 (this run: 0.1)"),
])
def test_a_run_resumed_under_another_optimizer_is_refused_before_the_data_is_read(tmp_path, one_epoch, capsys, opts,
                                                                                 changes):
    """torch loads one optimizer's state into another without a check: AdamW's moments went on under LAMB (and
    Lion, SGD) without a word, and Adan failed at its first update with a bare KeyError, after the config was
    rewritten. The data path does not exist: the refusal comes before any scan, and nothing is written."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    before = checkpoints(output)
    config = (output / 'config.yaml').read_bytes()
    assert run_cli(train_main, [*train_argv(output, tmp_path / 'no-data'), *opts]) == USAGE_EXIT_CODE
    last = str(output / 'last.pth')
    assert capsys.readouterr().err == (
        f"error: checkpoint {last!r} holds an optimizer state this run would not use: {changes}; expected the same "
        f"optimizer to resume it, with TRAIN.BACKBONE_LR_SCALE 1 in both runs or in neither (another optimizer: "
        f"--pretrained {last} with another --output)\n")
    assert checkpoints(output) == before and (output / 'config.yaml').read_bytes() == config


def test_weights_to_start_from_are_refused_for_a_run_that_resumes(tmp_path, one_epoch, capsys):
    """--pretrained into a folder whose run is resumed was ignored without a word, and recorded in its config."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    other = str(one_epoch / 'best.pth')
    assert run_cli(train_main, [*train_argv(output, tmp_path / 'no-data'), 'MODEL.PRETRAINED', other]) == 2
    assert capsys.readouterr().err == (
        f"error: MODEL.PRETRAINED {other!r} would not be loaded: this run resumes {str(output / 'last.pth')!r}, "
        f"which started from random weights; expected another --output to start from {other!r}, or "
        f"--pretrained '' (no MODEL.PRETRAINED) to resume the run\n")


def test_a_run_resumed_without_its_weights_still_resumes_with_them_named(tmp_path, digits, one_epoch, capsys):
    """Each resumption saved its own config: resumed once without --pretrained, the run was then said to have
    started from random weights, and its own first command was refused."""
    output, start = tmp_path / 'run', str(one_epoch / 'last.pth')
    started = [*train_argv(output, digits), 'TRAIN.EPOCHS', '2', 'TRAIN.EPOCHS_PER_RUN', '1']
    assert run_cli(train_main, ['--pretrained', start, *started]) == 0
    assert run_cli(train_main, started) == 0
    assert config_from_yaml_string(torch.load(output / 'last.pth', weights_only=True)['config']).MODEL.PRETRAINED \
        == start
    assert saved_steps(output)['last.pth'] == 2 * 22
    capsys.readouterr()
    # both epochs are trained: the first command, run again, is compared with the run it resumes, then has nothing
    # to train
    assert run_cli(train_main, ['--pretrained', start, *started]) == 0, capsys.readouterr().err
    assert 'nothing to train' in capsys.readouterr().out


def test_a_best_checkpoint_without_a_last_one_is_not_replaced_and_resumes(tmp_path, digits, one_epoch, capsys):
    """With last.pth deleted to save space, a new run wrote over best.pth and emptied log.jsonl; a fine-tune whose
    --pretrained file lay in its own output folder replaced it. Resuming best.pth itself goes on."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    (output / 'last.pth').unlink()
    before = checkpoints(output)
    for opts in ([], ['MODEL.PRETRAINED', str(output / 'best.pth')]):
        assert run_cli(train_main, [*train_argv(output, digits), *opts]) == USAGE_EXIT_CODE
        assert capsys.readouterr().err == (
            f"error: output folder {str(output)!r} holds the checkpoints of a run ({output / 'best.pth'}) that this "
            f"run would replace, since there is no last.pth beside it to resume; expected a folder without one: "
            f"choose another --output\n")
    assert checkpoints(output) == before
    assert run_cli(train_main, ['--resume', str(output / 'best.pth'), *train_argv(output, digits)]) == 0
    assert [r['epoch'] for r in records(output)] == [0, 1]


def test_an_unreadable_last_checkpoint_says_how_to_go_on(tmp_path, one_epoch, capsys):
    """The error named the cut file only; resuming best.pth was refused as replacing it."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    (output / 'last.pth').write_bytes((output / 'last.pth').read_bytes()[:100_000])
    assert run_cli(train_main, train_argv(output, tmp_path / 'no-data')) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {str(output / 'last.pth')!r} is truncated or corrupt")
    assert err.endswith(f"; move it out of the output folder, then --resume {output / 'best.pth'} goes on from the "
                        f"best epoch\n") and err.count('\n') == 1


def test_a_run_resumed_from_another_folder_goes_on_when_its_command_runs_again(tmp_path, digits, one_epoch, capsys):
    """'Run the same command again' after a pause or a stop: a run started with --resume OTHER/last.pth was refused
    the second time, since its folder then held a checkpoint that was not OTHER/last.pth (it now holds the run that
    command started, which goes on, as the official engine's auto-resume does)."""
    output = tmp_path / 'continued'
    source = checkpoints(one_epoch)
    argv = ['--cfg', TINY, '--output', str(output), '--data-path', str(digits), '--resume',
            str(one_epoch / 'last.pth'), '--opts', *SHORT, 'TRAIN.EPOCHS', '3', 'TRAIN.EPOCHS_PER_RUN', '1']
    for _ in range(2):
        assert run_cli(train_main, argv) == 0, capsys.readouterr().err
    assert [(r['epoch'], r['step']) for r in records(output)] == [(1, 44), (2, 66)]
    assert f"resumed from {output / 'last.pth'} at epoch 2" in capsys.readouterr().out
    assert checkpoints(one_epoch) == source


def test_a_run_resumed_from_another_folder_names_no_best_pth_it_did_not_save(tmp_path, digits, one_epoch, capsys,
                                                                             monkeypatch):
    """A run resumed from another folder's checkpoint saves best.pth only once it beats that checkpoint's best; its
    last line named a best.pth of this folder that did not exist."""
    output = tmp_path / 'continued'
    resumed_best = records(one_epoch)[-1]['max_val_top1']
    monkeypatch.setattr(engine.trainer, 'evaluate', lambda *args, **kwargs: dict(top1=0.0, top5=0.0, loss=9.0,
                                                                                 count=360))
    argv = ['--cfg', TINY, '--output', str(output), '--data-path', str(digits), '--resume',
            str(one_epoch / 'last.pth'), '--opts', *SHORT, 'TRAIN.EPOCHS', '2']
    assert run_cli(train_main, argv) == 0
    assert not (output / 'best.pth').exists()
    last = capsys.readouterr().out.splitlines()[-1]
    assert (f"finished 2 epochs: best val top-1 0.00 at epoch 1 (not above the {resumed_best:.2f} of the checkpoint "
            f"it resumed from, so no best.pth here), last 0.00 ({output / 'last.pth'})") in last


def test_resuming_a_finished_epoch_with_another_batch_size_keeps_its_record(tmp_path, digits, one_epoch, capsys):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    first = (output / 'log.jsonl').read_text()
    # 22 batches of 64 finished epoch 0; at 32 they would be 22 of its 44 batches
    assert run_cli(train_main, [*train_argv(output, digits), 'DATA.BATCH_SIZE', '32']) == 0
    # the change is said once; another output folder and no TRAIN.EPOCHS_PER_RUN change nothing trained
    said = [line.split('] ', 1)[1] for line in capsys.readouterr().out.splitlines() if 'another config' in line]
    assert said == [f"{output / 'last.pth'} was written under another config: DATA.BATCH_SIZE 64 (this run: 32); the "
                    f"run goes on with this run's values, its learning-rate schedule included"]
    assert (output / 'log.jsonl').read_text().startswith(first)
    assert [(r['epoch'], r['step']) for r in records(output)] == [(0, 22), (1, 66)]
    # epoch 1 follows this run's schedule of 44 updates per epoch: its last update is the schedule's 88th
    cfg = load_config(TINY, ['DATA.BATCH_SIZE', '32'])
    lrs = scaled_lrs(cfg, world_size=1)
    optimizer = torch.optim.AdamW(nn.Linear(1, 1).parameters(), lr=lrs['lr'])
    scheduler, _ = create_scheduler(cfg, optimizer, lrs, updates_per_epoch=44)
    scheduler.step_update(num_updates=44 + 43)
    assert records(output)[1]['lr'] == pytest.approx(optimizer.param_groups[0]['lr'], rel=1e-12)


def test_a_log_record_cut_by_a_kill_is_dropped_when_the_run_resumes(tmp_path, digits, one_epoch, capsys):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    first = (output / 'log.jsonl').read_text()
    with open(output / 'log.jsonl', 'a') as f:  # the process died while appending epoch 1's record
        f.write(first.replace('"epoch": 0', '"epoch": 1')[:40])
    assert run_cli(train_main, train_argv(output, digits)) == 0
    assert (output / 'log.jsonl').read_text().startswith(first)
    assert [r['epoch'] for r in records(output)] == [0, 1]
    out = capsys.readouterr().out
    assert f"dropped the cut last line of {output / 'log.jsonl'}" in out
    assert 'another config' not in out  # the same config: nothing said


@pytest.mark.parametrize('foreign, number', [('not a record', 1), ('{"loss": 1.5}', 1), ('[0, 1]', 2)])
def test_a_log_with_a_foreign_line_is_one_line_and_left_as_it_is(tmp_path, digits, one_epoch, capsys, foreign,
                                                                 number):
    """A line that is no epoch record before the end, or one that is whole JSON but no record at the end (a cut
    record is never valid JSON)."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    record = (output / 'log.jsonl').read_text()
    log = foreign + '\n' + record if number == 1 else record + foreign + '\n'
    (output / 'log.jsonl').write_text(log)
    assert run_cli(train_main, train_argv(output, digits)) == 2
    assert capsys.readouterr().err == (f"error: line {number} of {output / 'log.jsonl'} is not a JSON record of an "
                                       f"epoch; expected the log this run writes, one record per line\n")
    assert (output / 'log.jsonl').read_text() == log


def renamed_class(digits: Path, folder: Path, old: str, new: str) -> Path:
    """A copy of the digits at `folder` with class folder `old` named `new` in both splits: as many classes as the
    run was trained on, in another order."""
    shutil.copytree(digits, folder)
    for split in ('train', 'val'):
        (folder / split / old).rename(folder / split / new)
    return folder


def test_a_run_resumed_on_other_classes_is_refused_before_training(tmp_path, digits, one_epoch, capsys):
    """The same number of class folders, one of them renamed: its images would train another output than they
    did; the checkpoint keeps the class names and the resumed run compares them."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    saved = (output / 'last.pth').read_bytes()
    other = renamed_class(digits, tmp_path / 'other', '3', 'three')
    assert torch.load(output / 'last.pth', weights_only=True)['classes'] == [str(c) for c in range(10)]
    assert run_cli(train_main, train_argv(output, other)) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {str(output / 'last.pth')!r} was trained on other classes than {other / 'train'} holds "
        f"(only in the checkpoint: 3; only in {other / 'train'}: three); expected the class folders it was trained "
        f"on\n")
    assert (output / 'last.pth').read_bytes() == saved


def test_evaluating_a_checkpoint_on_other_classes_is_refused_and_one_without_class_names_still_evaluates(
        tmp_path, digits, one_epoch, capsys):
    other = renamed_class(digits, tmp_path / 'other', '3', 'three')
    best = one_epoch / 'best.pth'
    assert run_cli(eval_main, ['--checkpoint', str(best), '--data-path', str(other)]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: checkpoint {str(best)!r} was trained on other classes than {other / 'val'} holds (only in the "
        f"checkpoint: 3; only in {other / 'val'}: three); expected the class folders it was trained on\n")
    # a checkpoint written before the class names were kept is evaluated on the class count alone
    stored = torch.load(best, weights_only=True)
    del stored['classes']
    unnamed = tmp_path / 'unnamed.pth'
    torch.save(stored, unnamed)
    assert run_cli(eval_main, ['--checkpoint', str(unnamed), '--data-path', str(digits)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])['count'] == 360


# The ImageNet recipes' random augmentation (RandAugment, random erasing), loaded by 2 DataLoader workers.
WORKERS = ['DATA.NUM_WORKERS', '2', 'AUG.AUTO_AUGMENT', 'rand-m9-mstd0.5-inc1', 'AUG.REPROB', '0.25']


def test_a_signal_during_validation_resumes_at_the_next_epoch_to_the_uninterrupted_result(tmp_path, digits,
                                                                                          uninterrupted, monkeypatch):
    """SIGTERM while epoch 0 is validated: the run saves after the validation and stops; running again trains
    epoch 1 and ends where an uninterrupted run ends (the saved epoch was counted twice: the resumed run skipped
    epoch 1 and ended at step 22 of 44)."""
    output = tmp_path / 'stopped'
    real_evaluate, calls = engine.trainer.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(kwargs.get('desc'))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(engine.trainer, 'evaluate', evaluate)
    assert run_cli(train_main, train_argv(output, digits)) == 128 + signal.SIGTERM
    assert calls == ['val', 'val ema'] and len(records(output)) == 1  # epoch 0 validated whole, then the stop
    monkeypatch.undo()
    assert run_cli(train_main, train_argv(output, digits)) == 0
    assert records(output) == records(uninterrupted)
    assert_same_end(output, uninterrupted)


def assert_same_end(output: Path, reference: Path) -> None:
    """The last checkpoints of a resumed and an uninterrupted run hold the same step, weights, EMA and optimizer
    state."""
    resumed = torch.load(output / 'last.pth', weights_only=True)
    reference = torch.load(reference / 'last.pth', weights_only=True)
    assert resumed['step'] == reference['step'] == 44
    for key in ('model', 'model_ema'):
        for name, value in reference[key].items():
            assert torch.equal(resumed[key][name], value), (key, name)
    for index, state in reference['optimizer']['state'].items():
        for name, value in state.items():
            assert torch.equal(resumed['optimizer']['state'][index][name], value), (index, name)


def test_sigterm_with_dataloader_workers_resumes_to_the_uninterrupted_weights(tmp_path, digits, monkeypatch):
    reference = tmp_path / 'uninterrupted'
    assert run_cli(train_main, [*train_argv(reference, digits), *WORKERS]) == 0
    output = tmp_path / 'stopped'
    signals_at(monkeypatch, (27, signal.SIGTERM))
    assert run_cli(train_main, [*train_argv(output, digits), *WORKERS]) == 128 + signal.SIGTERM
    stopped = torch.load(output / 'last.pth', weights_only=True)
    # the workers had loaded batches beyond this one, which the resumed run loads again
    assert (stopped['epoch'], stopped['epoch_batches'], stopped['step']) == (1, 6, 28)
    monkeypatch.undo()
    assert run_cli(train_main, [*train_argv(output, digits), *WORKERS]) == 0
    resumed, uninterrupted = records(output), records(reference)
    # epoch 1's mean loss covers the 6 batches before the stop too (only the last 16 before): the same sums, taken
    # in two parts
    assert resumed[1].pop('train_loss') == pytest.approx(uninterrupted[1].pop('train_loss'), rel=1e-12)
    assert resumed == uninterrupted
    assert_same_end(output, reference)


def test_sigterm_to_the_process_group_saves_as_one_to_the_process_alone(tmp_path, digits, monkeypatch):
    """torchrun stops each process with a signal to its process group, as `timeout` and batch schedulers do, so the
    DataLoader workers got SIGTERM too and died: the run failed on its next batch ('DataLoader worker ... is
    killed by signal: Terminated'), without saving. The workers outlast one SIGTERM; the loader ends them."""
    output = tmp_path / 'stopped'
    signals_at(monkeypatch, (27, signal.SIGTERM), workers_too=True)
    assert run_cli(train_main, [*train_argv(output, digits), *WORKERS]) == 128 + signal.SIGTERM
    stopped = torch.load(output / 'last.pth', weights_only=True)
    assert (stopped['epoch'], stopped['epoch_batches'], stopped['step']) == (1, 6, 28)
    assert not multiprocessing.active_children()


# Sends the given (update, signal) pairs to itself, as `signals_at` does, then trains: a second signal ends the
# process itself, so the run cannot share the test's.
SIGNALS_AT = '''
import os
import sys

import engine.loops
from engine.cli import train_main
from engine.errors import run_cli

any_rank, calls = engine.loops.any_rank, []


def any_rank_sending(flag, device):
    calls.append(flag)
    for call, signum in {sends}:
        if len(calls) == call:
            os.kill(os.getpid(), signum)
    return any_rank(flag, device)


engine.loops.any_rank = any_rank_sending
sys.exit(run_cli(train_main))
'''


def assert_lock_taken_over(output: Path, digits: Path) -> None:
    """The next command goes on in `output`, which a process stopped at once left with its lock: with one epoch in
    all, it takes the lock, reads last.pth, then has nothing to train."""
    assert run_cli(train_main, [*train_argv(output, digits), 'TRAIN.EPOCHS', '1']) == 0
    assert 'took over the lock of a run that has ended' in log_text(output)


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once_without_saving(tmp_path, digits, one_epoch, signum):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    saved = checkpoints(output)
    script = tmp_path / 'script.py'
    script.write_text(SIGNALS_AT.format(sends=[(3, int(signum)), (4, int(signum))]))
    result = subprocess.run([sys.executable, str(script), *train_argv(output, digits)], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 128 + signum, result.stderr[-3000:]
    assert 'Traceback' not in result.stderr
    assert result.stderr.splitlines()[-1] == (f"error: stopped at once by a second {signal.Signals(signum).name}, "
                                              f"without saving; the checkpoints saved before are unchanged")
    assert checkpoints(output) == saved
    assert_lock_taken_over(output, digits)


# A first SIGINT at update 3, and a second one while the checkpoint it asks for is being written (its bytes are
# out, it is neither synced nor renamed yet).
SECOND_SIGNAL_MID_WRITE = SIGNALS_AT.format(sends=[(3, int(signal.SIGINT))]).replace(
    'engine.loops.any_rank = any_rank_sending', """engine.loops.any_rank = any_rank_sending
import signal
import torch

save = torch.save


def save_then_signal(obj, f, *args, **kwargs):
    save(obj, f, *args, **kwargs)
    if len(calls) >= 3:
        os.kill(os.getpid(), signal.SIGINT)


torch.save = save_then_signal""")


def test_a_second_signal_during_a_checkpoint_write_leaves_no_temporary_file(tmp_path, digits, one_epoch):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    saved = checkpoints(output)
    script = tmp_path / 'script.py'
    script.write_text(SECOND_SIGNAL_MID_WRITE)
    result = subprocess.run([sys.executable, str(script), *train_argv(output, digits)], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith('error: stopped at once by a second SIGINT')
    assert checkpoints(output) == saved
    assert not [p.name for p in output.iterdir() if p.name.endswith('.tmp')]
    assert_lock_taken_over(output, digits)


def test_the_copy_of_a_signal_that_torchrun_passes_on_is_not_a_second_one(tmp_path, digits, one_epoch, monkeypatch,
                                                                           capsys):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'none')
    signals_at(monkeypatch, (3, signal.SIGINT), (3, signal.SIGINT))  # from the terminal, then from torchrun
    capsys.readouterr()
    assert run_cli(train_main, train_argv(output, digits)) == 128 + signal.SIGINT
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: stopped by SIGINT after saving "
                                                        f"{output / 'last.pth'}; run the same command again to resume")
    assert TrainingCheckpoint.read(str(output / 'last.pth'))['epoch_batches'] == 4


@pytest.mark.parametrize('env, message', [
    (dict(RANK='one'), "environment variable RANK='one' is not an integer"),
    (dict(RANK='2', WORLD_SIZE='2'), "environment RANK=2, WORLD_SIZE=2, LOCAL_RANK=0: expected WORLD_SIZE >= 1, "
                                     "0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0 (torchrun sets them)"),
    (dict(WORLD_SIZE='0'), "environment RANK=0, WORLD_SIZE=0, LOCAL_RANK=0: expected WORLD_SIZE >= 1"),
    (dict(LOCAL_RANK='-1'), "environment RANK=0, WORLD_SIZE=1, LOCAL_RANK=-1: expected"),
])
def test_a_bad_process_environment_is_one_line(tmp_path, digits, monkeypatch, capsys, env, message):
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert run_cli(train_main, train_argv(tmp_path / 'run', digits)) == USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith(f'error: {message}'), err
    assert not (tmp_path / 'run').exists()


def test_nccl_on_the_cpu_is_one_line(tmp_path, digits, monkeypatch, capsys):
    """Under torchrun on the CPU, DIST.BACKEND nccl failed in every process with torch's traceback."""
    for name, value in dict(RANK='0', WORLD_SIZE='2', LOCAL_RANK='0').items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    argv = train_argv(tmp_path / 'run', digits) + ['DEVICE', 'cpu', 'DIST.BACKEND', 'nccl']
    assert run_cli(train_main, argv) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == ("error: DIST.BACKEND is 'nccl', which joins CUDA devices, but this run is on "
                                       "the CPU; expected DIST.BACKEND 'gloo' or '' (gloo on the CPU)\n")
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('attn', ATTENTIONS)
def test_every_attention_trains_50_steps_under_float16_autocast(attn, digits):
    cfg = load_config(TINY, ['MODEL.KWARGS.attn_type', attn, 'AMP.ENABLED', 'True', 'AMP.DTYPE', 'float16',
                             'DATA.DATA_PATH', str(digits)])
    torch.manual_seed(0)
    model = create_model(cfg)
    lrs = scaled_lrs(cfg, 1)
    optimizer = create_optimizer(cfg, model, lrs['lr'])
    scheduler, _ = create_scheduler(cfg, optimizer, lrs, 50)
    scaler = torch.amp.GradScaler('cpu')
    loader = build_train_loader(cfg, load_split(str(digits), 'train', train_transform(cfg), 10), CPU)
    loader.sampler.set_epoch(0)
    losses = []
    state = TrainState()
    criterion = create_criterion(cfg)

    def recorded(output, target):
        loss = criterion(output, target)
        losses.append(loss.item())
        return loss

    train_one_epoch(model, loader, recorded, optimizer, scheduler, scaler, state, CPU,
                    EpochOptions(updates=50, amp=True, amp_dtype='float16'))
    assert state.step == 50 and state.skipped_steps == 0 and len(losses) == 50
    assert all(math.isfinite(loss) for loss in losses)
    # the scaler starts at 2**16 and halves on each update it skips for inf/NaN gradients (no growth in 50)
    assert math.log2(2 ** 16 / scaler.get_scale()) <= 3
    assert sum(losses[-10:]) < sum(losses[:10])


def wait_for(process: subprocess.Popen, ready, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.02)


def log_text(output: Path) -> str:
    path = output / 'train.log'
    return path.read_text() if path.exists() else ''


def start_training(output: Path, digits: Path, *opts: str) -> subprocess.Popen:
    command = [sys.executable, str(REPO / 'train.py'), *train_argv(output, digits), *opts]
    # one thread, as in the tests' own process: the run shares the machine with them
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.Popen(command, cwd=output.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def test_a_run_killed_with_sigkill_resumes_to_the_uninterrupted_result(tmp_path, digits, one_epoch, uninterrupted):
    killed_output = tmp_path / 'killed'
    shutil.copytree(one_epoch, killed_output)
    killed = start_training(killed_output, digits)
    # epoch 0 logged and saved, and the run has resumed from it: it is in epoch 1
    wait_for(killed, lambda: log_text(killed_output).count('updates per epoch') == 2)
    time.sleep(0.2)  # some way into epoch 1 (of about 4 s)
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert torch.load(killed_output / 'last.pth', weights_only=True)['epoch'] == 0  # killed before epoch 1's save

    assert run_cli(train_main, train_argv(killed_output, digits)) == 0  # resumes from last.pth on its own
    assert records(killed_output) == records(uninterrupted)
    assert [r['epoch'] for r in records(killed_output)] == [0, 1]
    resumed = torch.load(killed_output / 'last.pth', weights_only=True)
    reference = torch.load(uninterrupted / 'last.pth', weights_only=True)
    assert resumed['step'] == reference['step'] == 44
    for key in ('model', 'model_ema'):
        assert resumed[key].keys() == reference[key].keys()
        for name in reference[key]:
            assert torch.equal(resumed[key][name], reference[key][name]), (key, name)


# Rank 1 leaves abruptly at its 10th update, as a process killed by the OS or a failed device would.
DYING_RANK = '''
import os
import sys

import engine.loops
from engine.cli import train_main
from engine.errors import run_cli

if os.environ['RANK'] == '1':
    any_rank, calls = engine.loops.any_rank, []

    def any_rank_then_exit(flag, device):
        calls.append(flag)
        if len(calls) == 10:
            os._exit(3)
        return any_rank(flag, device)

    engine.loops.any_rank = any_rank_then_exit
sys.exit(run_cli(train_main))
'''


def torchrun_script(tmp_path: Path, digits: Path, text: str, *opts: str):
    """Run `text` as the training script of a 2-process torchrun; return the result and the seconds it took."""
    script = tmp_path / 'script.py'
    script.write_text(text)
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(script),
               *train_argv(tmp_path / 'out', digits), *opts]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS='1')
    start = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - start


def test_a_rank_that_dies_ends_the_other_rank_with_a_non_zero_exit(tmp_path, digits):
    result, seconds = torchrun_script(tmp_path, digits, DYING_RANK)
    assert result.returncode != 0 and seconds < 90  # not DIST.TIMEOUT_MIN (30 minutes)
    # torchrun names rank 1 as the first failure and lists rank 0, which it ended, as failed too
    root_cause = result.stderr.split('Root Cause')[-1]
    assert 'rank      : 1' in root_cause and 'exitcode  : 3' in root_cause, result.stderr[-3000:]
    assert 'rank      : 0' in result.stderr.split('Root Cause')[0], result.stderr[-3000:]
    assert not (tmp_path / 'out' / 'log.jsonl').exists()  # rank 0 never finished an epoch
    # rank 0's failed collective is one line (when torchrun has not ended it first), not a traceback
    assert '[rank0]: Traceback' not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize('world_size, rank, debug', [('2', '0', False), ('2', '1', False), ('1', '0', False),
                                                     ('2', '0', True)])
def test_a_collective_failed_by_a_peer_that_ended_is_one_line_from_rank_0(monkeypatch, capsys, world_size, rank,
                                                                          debug):
    """The other rank of a run whose process failed on bad input (its own one-line error) or died met a failed
    collective: rank 0 says so on one line, exit status 1; the others say nothing; alone, or with --debug, the
    error keeps its traceback."""
    monkeypatch.setenv('WORLD_SIZE', world_size)
    monkeypatch.setenv('RANK', rank)
    gone = RuntimeError('[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:14518: '
                        'Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the '
                        'application.')

    def main(argv):
        raise gone

    if world_size == '1' or debug:
        with pytest.raises(RuntimeError):
            run_cli(main, ['--debug'] if debug else [])
        return
    assert run_cli(main, []) == 1
    said = ("error: a collective with the other processes failed (Read error [127.0.0.1]:14518: Connection reset by "
            "peer): another process ended or stopped answering; its own output says why\n")
    assert capsys.readouterr().err == (said if rank == '0' else '')


def record_what_each_rank_gets(env: Dict[str, str], folder: Path) -> None:
    """Join the process group `env` describes, as a rank under torchrun; record what `main_process_first` gave this
    rank, with and without `per_node`, then what `each_node_first` gave it: the action fails, or returns."""
    os.environ.update(env)
    info = init_distributed('cpu')
    outcomes = []
    for first in ('main', 'main per node', 'each node'):
        for action in ('fails', 'returns'):
            def run(action=action):
                if action == 'fails':
                    raise UsageError(f'rank {info.rank} could not')
                return f'done by rank {info.rank}'
            try:
                if first == 'each node':
                    outcomes.append(repr(each_node_first(info, run, 'do it')))
                else:
                    outcomes.append(repr(main_process_first(info, run, 'do it', per_node=first == 'main per node')))
            except UsageError as e:
                outcomes.append(str(e))
    (folder / f'rank{info.rank}.txt').write_text('\n'.join(outcomes))
    cleanup_distributed()


@pytest.mark.parametrize('nodes', [1, 2])
def test_what_the_main_process_does_alone_reaches_every_rank(tmp_path, nodes):
    """`main_process_first` runs the action on rank 0 alone (with `per_node`, on each node's first process): its
    error stops those with that error and the others with a line of their own, so that none waits at a collective
    another never reaches; its result stays where it ran. `each_node_first` fails as the per-node form, and then
    runs the action on the others too, each with its own result. Two ranks as one node or as two nodes of one
    process."""
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    # forked from this process, as DataLoader workers are: the ranks join at once, where a new interpreter would
    # first import torch for seconds
    fork = multiprocessing.get_context('fork')
    ranks = []
    try:
        for rank in range(2):
            env = dict(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), WORLD_SIZE='2', RANK=str(rank),
                       LOCAL_RANK=str(rank if nodes == 1 else 0))
            ranks.append(fork.Process(target=record_what_each_rank_gets, args=(env, tmp_path)))
            ranks[-1].start()
        for process in ranks:
            process.join(timeout=300)
        assert [process.exitcode for process in ranks] == [0, 0]  # a rank's error is in the captured stderr
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    main, other = ['rank 0 could not', "'done by rank 0'"], ['another process could not do it', 'None']
    own = ['rank 1 could not', "'done by rank 1'"]
    assert (tmp_path / 'rank0.txt').read_text().splitlines() == main + main + main
    assert (tmp_path / 'rank1.txt').read_text().splitlines() == other + (other if nodes == 1 else own) + (
        ['another process could not do it', "'done by rank 1'"] if nodes == 1 else own)


def test_a_digits_cache_the_main_process_cannot_write_is_one_line_under_torchrun(tmp_path):
    (tmp_path / 'cache').write_text('not a folder')
    data = tmp_path / 'cache' / 'digits'
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
               str(REPO / 'train.py'), '--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH',
               str(data)]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
    assert result.returncode != 0 and errors == [
        f"error: cannot write the digits cache {str(data)!r} ({str(tmp_path / 'cache')!r} is a file, not a folder); "
        f"expected a folder this user can write: set DATA.DATA_PATH, or XDG_CACHE_HOME for the default place"
    ], result.stderr[-3000:]
    assert 'OSError' not in result.stderr and 'NotADirectoryError' not in result.stderr


# Only rank 1 sees a NaN loss, at its 6th and 9th batches.
NAN_ON_RANK_1 = '''
import os
import sys

import engine.trainer
from engine.cli import train_main
from engine.errors import run_cli

if os.environ['RANK'] == '1':
    create_criterion, calls = engine.trainer.create_criterion, []

    def nan_at_sixth_and_ninth_calls(cfg):
        criterion = create_criterion(cfg)

        def loss(output, target):
            calls.append(None)
            return criterion(output, target) * (float('nan') if len(calls) in (6, 9) else 1.0)

        return loss

    engine.trainer.create_criterion = nan_at_sixth_and_ninth_calls
sys.exit(run_cli(train_main))
'''


def test_a_non_finite_loss_on_one_rank_skips_then_stops_every_rank(tmp_path, digits):
    result, seconds = torchrun_script(tmp_path, digits, NAN_ON_RANK_1, 'TRAIN.MAX_NONFINITE_STEPS', '1')
    assert result.returncode != 0 and seconds < 90
    # both ranks skipped batch 5 and went on together; rank 0, whose own loss was finite, prints the message
    # (only rank 0 prints) and exits with status 2
    assert "skipping step 5 (epoch 0, batch 5): the training loss is not finite (1/1 skipped)" in result.stdout
    assert ("error: the training loss is not finite at step 7 (epoch 0, batch 8) after 1 skipped step(s)"
            in result.stderr), result.stdout[-3000:] + result.stderr[-3000:]
    assert 'exitcode  : 2' in result.stderr.split('Root Cause')[-1], result.stderr[-3000:]
    assert not (tmp_path / 'out' / 'last.pth').exists()


def test_sigterm_to_train_py_saves_exits_143_and_the_run_resumes(tmp_path, digits):
    output = tmp_path / 'run'
    process = start_training(output, digits, 'TRAIN.EPOCHS', '1')
    wait_for(process, lambda: 'updates per epoch' in log_text(output))  # the next line installs the handler
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.splitlines()[-1] == (f"error: stopped by SIGTERM after saving {output / 'last.pth'}; run the same "
                                    f"command again to resume")
    assert log_text(output).count('received SIGTERM') == 1
    assert TrainingCheckpoint.read(str(output / 'last.pth'))['step'] > 0
    assert run_cli(train_main, [*train_argv(output, digits), 'TRAIN.EPOCHS', '1']) == 0
    assert [(r['epoch'], r['step']) for r in records(output)] == [(0, 22)]


def test_ctrl_c_with_dataloader_workers_is_one_line_and_exits_130(tmp_path, digits):
    output = tmp_path / 'run'
    command = [sys.executable, str(REPO / 'train.py'), *train_argv(output, digits), 'DATA.NUM_WORKERS', '2']
    # a terminal's Ctrl-C signals the whole process group: the run and its DataLoader workers
    process = subprocess.Popen(command, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS='1'),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(process, lambda: descendants(process.pid) >= 2)  # the workers have started
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, err[-3000:]
    assert log_text(output).count('received SIGINT') == 1
    assert err.splitlines()[-1].startswith('error: stopped by SIGINT after saving')


def torchrun_training(output: Path, digits: Path) -> subprocess.Popen:
    """A two-rank run long enough (20 epochs) that signals sent seconds after a start or a resume find it training:
    with the demo's 2 epochs a resumed run could end before them."""
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
               str(REPO / 'train.py'), *train_argv(output, digits), 'DATA.BATCH_SIZE', '16', 'DATA.NUM_WORKERS', '2',
               'TRAIN.EPOCHS', '20']
    return subprocess.Popen(command, cwd=output.parent, env=dict(os.environ, OMP_NUM_THREADS='1'),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def descendants(pid: int) -> int:
    """How many processes descend from `pid` (Linux /proc)."""
    children: Dict[int, List[int]] = {}
    for stat in Path('/proc').glob('[0-9]*/stat'):
        try:
            fields = stat.read_text().rsplit(')', 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = 0, [pid]
    while pending:
        below = children.get(pending.pop(), [])
        found += len(below)
        pending += below
    return found


def test_ctrl_c_under_torchrun_is_one_line_per_rank_and_a_second_one_no_rank_traceback(tmp_path, digits):
    output = tmp_path / 'run'
    process = torchrun_training(output, digits)
    # both ranks train, with their DataLoader workers (2 each), which they start inside the signal handler's block;
    # a fixed wait after the start's log line was too short on a loaded machine
    wait_for(process, lambda: descendants(process.pid) >= 2 + 2 * 2)
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: torchrun, the ranks and their workers
    out, err = process.communicate(timeout=120)
    # torchrun passes the signal on to the ranks, and reports it itself with a traceback and exit status 1
    assert 'SignalException' in err and process.returncode == 1
    assert out.count('received SIGINT') == 2  # one line per rank, none from the 4 workers
    assert [line for line in err.splitlines() if line.startswith('error: ')] == [
        f"error: stopped by SIGINT after saving {output / 'last.pth'}; run the same command again to resume"]
    assert '[rank' not in err
    # saved after the update during which the signal came: mid-epoch, or at the epoch's end on a fast machine
    assert TrainingCheckpoint.read(str(output / 'last.pth'))['step'] > 0
    first_steps = saved_steps(output)

    process = torchrun_training(output, digits)
    wait_for(process, lambda: log_text(output).count('updates per epoch') == 2 and descendants(process.pid) >= 6)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith('error: ')]
    # one line either way: the second signal stops the ranks at once, or comes after they saved and stopped
    assert len(errors) == 1 and errors[0].startswith(('error: stopped at once', 'error: stopped by SIGINT after '
                                                                                'saving')), err[-3000:]
    assert '[rank' not in err
    # the resumed run may have finished its epoch, or saved after the first signal, before the second one: every
    # checkpoint is then whole and at least as far as the same file was, or, written by the resumed run, as the
    # last.pth it started from (best.pth can be an epoch behind last.pth); none is half written
    assert not [p.name for p in output.iterdir() if p.name.endswith('.tmp')]
    for name, step in saved_steps(output).items():
        assert step >= first_steps.get(name, first_steps['last.pth']), name


class Died(BaseException):
    """The process dies here: nothing after it runs."""


def test_a_run_killed_between_the_checkpoint_writes_keeps_the_best_weights(tmp_path, digits, one_epoch,
                                                                           monkeypatch):
    output = tmp_path / 'run'
    argv = [*train_argv(output, digits), 'TRAIN.EPOCHS_PER_RUN', '1']
    real_save, saves = engine.checkpoint.atomic_save, []

    def save_then_die(obj, path):
        real_save(obj, path)
        saves.append(path)
        if len(saves) == 2:
            raise Died

    monkeypatch.setattr(engine.checkpoint, 'atomic_save', save_then_die)
    with pytest.raises(Died):
        # the training state of epoch 0 is saved before validation; the run dies after the first file of the save
        # after it, which is the best so far
        run_cli(train_main, argv)
    monkeypatch.undo()
    assert [Path(p).name for p in saves] == ['last.pth', 'best.pth']
    assert TrainingCheckpoint.read(str(output / 'best.pth'))['epoch'] == 0
    assert TrainingCheckpoint.read(str(output / 'last.pth'))['metrics'] is None
    assert run_cli(train_main, argv) == 0  # last.pth without metrics: epoch 0's validation again
    best = torch.load(output / 'best.pth', weights_only=True)
    reference = torch.load(one_epoch / 'best.pth', weights_only=True)
    assert best['metrics']['val_top1'] == max(r['val_top1'] for r in records(output))
    for name in reference['model']:
        assert torch.equal(best['model'][name], reference['model'][name]), name


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, '-c', ''])
    process.wait()
    return process.pid


def test_a_lock_and_temp_files_left_by_a_killed_run_are_cleared(tmp_path, digits, one_epoch):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    pid = dead_pid()
    (output / '.train.lock').write_text(f"host {socket.gethostname()} pid {pid}\n")
    stale, live = output / f'.last.pth.{pid}.0123abcd.tmp', output / f'.best.pth.{os.getpid()}.89abcdef.tmp'
    stale.write_bytes(b'partial')
    live.write_bytes(b'being written')
    config = (output / 'config.yaml').read_text()
    # one epoch in all is already done: the run checks the folder, then has nothing to train
    assert run_cli(train_main, [*train_argv(output, digits), 'TRAIN.EPOCHS', '1', 'TRAIN.BASE_LR', '0.5']) == 0
    # the config beside the checkpoints stays theirs: it was rewritten with values nothing was trained with
    assert (output / 'config.yaml').read_text() == config
    log = log_text(output)
    assert f"took over the lock of a run that has ended (host {socket.gethostname()} pid {pid})" in log
    assert f"removed 1 temporary file(s) of checkpoint writes killed before they finished: {stale.name}" in log
    assert (f"{output / 'last.pth'} has trained 1 epoch(s) and TRAIN.EPOCHS is 1: nothing to train (a larger "
            f"TRAIN.EPOCHS goes on from it)") in log
    assert not stale.exists() and live.exists() and not (output / '.train.lock').exists()


def test_a_second_run_into_a_locked_output_folder_is_refused(tmp_path, digits, one_epoch, capsys):
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    saved = checkpoints(output)
    lock = OutputLock(str(output))
    assert lock.acquire() is None
    try:
        capsys.readouterr()
        assert run_cli(train_main, train_argv(output, digits)) == USAGE_EXIT_CODE
        assert (output / '.train.lock').read_text() == f"host {socket.gethostname()} pid {os.getpid()}\n"
    finally:
        lock.release()
    assert capsys.readouterr().err == (
        f"error: output folder {str(output)!r} is in use by another run (host {socket.gethostname()} pid "
        f"{os.getpid()}, lock file {output / '.train.lock'}); expected one run per output folder: wait for it to end "
        f"or choose another --output\n")
    assert checkpoints(output) == saved and not (output / '.train.lock').exists()


def test_an_output_path_that_is_a_file_or_read_only_is_one_line_before_training(tmp_path, digits, monkeypatch,
                                                                                capsys):
    file = tmp_path / 'file'
    file.write_text('not a folder')
    capsys.readouterr()
    assert run_cli(train_main, train_argv(file, digits)) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == (f"error: output folder {str(file)!r} is a file; expected a folder "
                                       f"(OUTPUT / --output)\n")
    assert run_cli(train_main, train_argv(file / 'run', digits)) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == (f"error: output folder {str(file / 'run')!r} cannot be made: {str(file)!r} "
                                       f"is a file; expected a folder (OUTPUT / --output)\n")

    read_only = tmp_path / 'read_only'
    read_only.mkdir()
    read_only.chmod(0o555)
    real_open = os.open

    def open_without_privilege(path, flags, *args, **kwargs):
        # what a user meets in a 0o555 folder, which the superuser running the tests would write into
        if os.path.dirname(str(path)) == str(read_only) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, 'open', open_without_privilege)
    try:
        assert run_cli(train_main, train_argv(read_only, digits)) == USAGE_EXIT_CODE
    finally:
        monkeypatch.undo()
        read_only.chmod(0o755)
    assert capsys.readouterr().err == (f"error: output folder {str(read_only)!r} is not writable (Permission denied); "
                                       f"expected a folder this user can write (OUTPUT / --output)\n")
    assert list(read_only.iterdir()) == []


def test_a_log_file_that_cannot_be_written_is_said_once_not_as_a_traceback_per_record(tmp_path, capsys):
    """A full disk under train.log printed logging's 20-line 'Logging error' traceback for every record."""
    engine.trainer.setup_logging(CPU, str(tmp_path))
    file_handler = next(h for h in logging.getLogger('engine').handlers if isinstance(h, logging.FileHandler))

    class FullDisk(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    file_handler.stream = FullDisk()
    for epoch in range(3):
        logging.getLogger('engine').info(f'epoch {epoch}')
    out, err = capsys.readouterr()
    assert err == (f"warning: cannot write {str(tmp_path / 'train.log')!r} (No space left on device); the log goes "
                   f"on on the console alone\n")
    assert [line.split('] ', 1)[1] for line in out.splitlines()] == ['epoch 0', 'epoch 1', 'epoch 2']
    engine.trainer.setup_logging(CPU)


@pytest.mark.parametrize('file', ['log.jsonl', 'config.yaml'])
def test_a_full_disk_at_the_log_or_the_config_is_one_line_and_the_run_resumes(tmp_path, digits, one_epoch, monkeypatch,
                                                                               capsys, file):
    """The epoch's record appended to log.jsonl, or the config written at the start, on a full disk: a 30-line
    traceback and status 1. Now one line naming the file, status 2, and the same command goes on once there is
    room."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    real_fsync = os.fsync

    def full_for(fd):
        if file in os.readlink(f'/proc/self/fd/{fd}'):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, 'fsync', full_for)
    capsys.readouterr()
    assert run_cli(train_main, train_argv(output, digits)) == USAGE_EXIT_CODE
    monkeypatch.undo()
    assert capsys.readouterr().err.split('\r')[-1] == (
        f"error: cannot write {str(output / file)!r} (No space left on device); expected free space on its disk\n")
    assert run_cli(train_main, train_argv(output, digits)) == 0
    assert [r['epoch'] for r in records(output)] == [0, 1]


def test_a_full_standard_output_is_named_as_such(capsys):
    """A table printed into a full pipe or file (`zoo_table.py > /dev/full`) said 'cannot write None'."""
    def prints_a_table(argv):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as print() to a full stdout raises it

    assert run_cli(prints_a_table, []) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == ("error: cannot write to the standard output or error (No space left on "
                                       "device); expected free space on its disk\n")


@pytest.mark.parametrize('reported_by', ['the file', "torch's zip writer"])
def test_a_full_disk_at_a_save_keeps_the_checkpoints_and_names_the_space(tmp_path, digits, one_epoch, monkeypatch,
                                                                         capsys, reported_by):
    """torch's zip writer turns the OSError of a full disk into a RuntimeError of its own ('unexpected pos'),
    which went out as a 40-line traceback."""
    output = tmp_path / 'run'
    shutil.copytree(one_epoch, output)
    saved = {name: data for name, data in checkpoints(output).items() if name.endswith('.pth')}
    real_save = torch.save

    def fill_the_disk(obj, f):
        real_save(obj, f)
        f.truncate(1000)
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if reported_by == 'the file':
            raise full
        try:
            raise full
        except OSError:
            raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0')

    monkeypatch.setattr(torch, 'save', fill_the_disk)
    capsys.readouterr()
    assert run_cli(train_main, train_argv(output, digits)) == USAGE_EXIT_CODE
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: cannot write checkpoint '{re.escape(str(output))}/(best|last)\.pth': No space left "
                        rf"on device \(the checkpoint takes about \d+\.\d MB beside the previous one; \d+\.\d MB are "
                        rf"free\); the checkpoints saved before are kept; expected a writable output folder with room "
                        rf"for it\n", err.split('\r')[-1]), err
    assert {name: data for name, data in checkpoints(output).items() if name.endswith('.pth')} == saved
    assert sorted(p.name for p in output.iterdir()) == ['best.pth', 'config.yaml', 'last.pth', 'log.jsonl',
                                                        'train.log']
