"""What a user sees of a run: whole progress lines when the output is not a terminal, an end-of-run summary, one
line for each thing `--pretrained` changed, checkpoints timm's own loader reads, and a first throughput result after
one forward."""
import json
import re
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import engine.evaluation
import engine.loops
import engine.trainer
from engine.cli import eval_main, train_main
from engine.config import load_config
from engine.data import prepare_digits
from engine.errors import USAGE_EXIT_CODE, run_cli

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml')
TINY_MODEL_OPTS = [item for key, value in load_config(TINY).MODEL.KWARGS.items()
                   for item in (f'MODEL.KWARGS.{key}', str(value))] + ['DATA.IMG_SIZE', '16', 'TEST.CROP_PCT', '1.0']


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory) -> Path:
    """The tiny demo trained for its two epochs, with a plain progress line after every batch."""
    root = tmp_path_factory.mktemp('run')
    digits = prepare_digits(str(root / 'digits'))
    patch = pytest.MonkeyPatch()
    patch.setattr(engine.loops, 'PLAIN_PROGRESS_SECONDS', 0.0)
    try:
        assert train_main(['--cfg', TINY, '--output', str(root / 'out'), '--data-path', digits]) == 0
    finally:
        patch.undo()
    return root / 'out'


def test_progress_is_whole_log_lines_when_the_output_is_not_a_terminal(finished_run):
    log = (finished_run / 'train.log').read_text()
    assert '\r' not in log
    lines = log.splitlines()
    epoch0 = [line for line in lines if re.search(r'\] epoch 0/2 \d+/89 ', line)]
    assert len(epoch0) == 89  # 1,437 images in full batches of 16, one line per batch at interval 0
    assert re.search(r'\] epoch 0/2 89/89 \(100%\), loss \d\.\d{4}, lr \d\.\d{3}e-\d\d, img_s \d+, '
                     r'\d+:\d\d elapsed, 0:00 left$', epoch0[-1])
    assert any(re.search(r'\] val 15/15 \(100%\), \d+:\d\d elapsed, 0:00 left$', line) for line in lines)


def test_a_finished_run_ends_with_its_best_and_last_epoch(finished_run):
    records = [json.loads(line) for line in (finished_run / 'log.jsonl').read_text().splitlines()]
    best = max(records, key=lambda r: r['val_top1'])
    last_line = (finished_run / 'train.log').read_text().splitlines()[-1]
    assert last_line.endswith(
        f"] finished 2 epochs: best val top-1 {best['val_top1']:.2f} at epoch {best['epoch']} "
        f"({finished_run / 'best.pth'}), last {records[-1]['val_top1']:.2f} ({finished_run / 'last.pth'}); "
        f"log {finished_run / 'log.jsonl'}")


def test_timm_reads_the_weights_and_their_ema_from_a_run_checkpoint(finished_run):
    """`timm.create_model(name, checkpoint_path=…)` and `timm.models.load_checkpoint`, what timm's own scripts call,
    find the trained weights and their moving average in a run's checkpoint: the average by timm's default, the
    weights with `use_ema=False` (timm's validate.py without --use-ema)."""
    cfg = load_config(str(finished_run / 'config.yaml'))
    best = finished_run / 'best.pth'
    stored = torch.load(best, weights_only=True)
    model = timm.create_model(cfg.MODEL.NAME, checkpoint_path=str(best), img_size=cfg.DATA.IMG_SIZE,
                              num_classes=cfg.MODEL.NUM_CLASSES, **cfg.MODEL.KWARGS)
    for weights in ('model_ema', 'model'):
        if weights == 'model':
            timm.models.load_checkpoint(model, str(best), use_ema=False)
        loaded = model.state_dict()
        assert loaded.keys() == stored[weights].keys()
        assert all(torch.equal(loaded[k], v) for k, v in stored[weights].items())
    assert not torch.equal(stored['model']['head.weight'], stored['model_ema']['head.weight'])


def train_recording_the_start(argv: List[str]) -> Dict[str, torch.Tensor]:
    """Run train.py with `argv` (status 0 expected) and return the weights its first epoch starts from."""
    started: Dict[str, torch.Tensor] = {}
    real_train_one_epoch = engine.trainer.train_one_epoch

    def record_start(model, *args, **kwargs):
        if not started:
            started.update({k: v.clone() for k, v in model.state_dict().items()})
        return real_train_one_epoch(model, *args, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.trainer, 'train_one_epoch', record_start)
        assert train_main(argv) == 0
    return started


def test_pretrained_weights_say_what_they_changed(finished_run, tmp_path):
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        for label in range(3):
            folder = tmp_path / 'data' / split / str(label)
            folder.mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode='L').save(folder / f'{i}.png')
    best = finished_run / 'best.pth'
    assert train_main(['--cfg', TINY, '--output', str(tmp_path / 'out'), '--data-path', str(tmp_path / 'data'),
                       '--pretrained', str(best), '--opts', 'DATA.DATASET', 'imagefolder', 'MODEL.NUM_CLASSES', '3',
                       'DATA.IMG_SIZE', '32', 'DATA.BATCH_SIZE', '4', 'TRAIN.EPOCHS', '1']) == 0
    said = [line.split('] ', 1)[1] for line in (tmp_path / 'out' / 'train.log').read_text().splitlines()
            if line.split('] ', 1)[1].startswith(str(best))]
    assert said == [f"{best}: re-initialised the classifier for 3 classes (the weights have 10)",
                    f"{best}: resized pos_embed from (1, 17, 64) to (1, 65, 64)"]


def test_pretrained_weights_of_another_attention_start_a_run_only_when_asked(finished_run, tmp_path, capsys):
    """Softmax weights for the tiny InLine demo: refused by default, naming the missing keys and the way out; with
    MODEL.PRETRAINED_STRICT False every shared tensor loads, and the log names the new and dropped keys."""
    softmax = tmp_path / 'softmax.pth'
    # the demo's own weights without InLine's residual convolutions: a softmax DeiT of the same size
    weights = torch.load(finished_run / 'best.pth', weights_only=True)['model']
    torch.save({'model': {k: v for k, v in weights.items() if '.residual.' not in k}}, softmax)
    digits = str(finished_run.parent / 'digits')
    argv = ['--cfg', TINY, '--data-path', digits, '--pretrained', str(softmax), '--opts', 'TRAIN.EPOCHS', '1']
    assert run_cli(train_main, ['--output', str(tmp_path / 'strict')] + argv) == USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {softmax}: checkpoint does not match DeiT: missing: blocks.0.attn.residual.0.weight")
    assert err.endswith("; to start from the tensors the checkpoint shares with the model (such as another "
                        "attention's weights), set MODEL.PRETRAINED_STRICT False\n") and err.count('\n') == 1

    output = tmp_path / 'partial'
    started = train_recording_the_start(['--output', str(output)] + argv + ['MODEL.PRETRAINED_STRICT', 'False'])
    new = [f'blocks.{i}.attn.residual.{j}.{p}' for i in range(2) for j in (0, 2) for p in ('weight', 'bias')]
    assert {k for k in started if k not in weights or '.residual.' in k} == set(new)
    assert all(torch.equal(started[k], v) for k, v in weights.items() if '.residual.' not in k)
    said = [line.split('] ', 1)[1] for line in (output / 'train.log').read_text().splitlines()
            if line.split('] ', 1)[1].startswith(str(softmax))]
    assert said == [f"{softmax}: loaded {len(weights) - len(new)} tensors; new (initialised, not loaded): "
                    f"{', '.join(new)}; dropped: none"]


def test_a_start_from_another_attentions_checkpoint_of_the_same_shapes_names_its_model(finished_run, tmp_path):
    """Linear DeiT's weights have softmax DeiT's shapes, so they start a softmax run strictly (fine-tuning across
    attentions); the log said only the file's name, not that its run trained another model."""
    linear = load_config(TINY, ['MODEL.NAME', 'linear_deit_tiny'])
    path = tmp_path / 'linear.pth'
    torch.save({'model': timm.create_model('linear_deit_tiny', num_classes=10, img_size=16,
                                           **linear.MODEL.KWARGS).state_dict(), 'config': linear.dump()}, path)
    output = tmp_path / 'out'
    started = train_recording_the_start(['--cfg', TINY, '--output', str(output), '--data-path',
                                         str(finished_run.parent / 'digits'), '--pretrained', str(path), '--opts',
                                         'TRAIN.EPOCHS', '1', 'MODEL.NAME', 'softmax_deit_tiny'])
    assert torch.equal(started['blocks.0.attn.qkv.weight'], torch.load(path)['model']['blocks.0.attn.qkv.weight'])
    assert (f"started from the model weights of {path} (MODEL.PRETRAINED_EMA False); its run trained another model: "
            f"MODEL.NAME 'linear_deit_tiny' (this run: 'softmax_deit_tiny')") in (output / 'train.log').read_text()


@pytest.mark.parametrize('ema', [False, True])
def test_pretrained_checkpoint_starts_from_the_weights_asked_for_and_says_which(finished_run, tmp_path, ema):
    """A checkpoint holds model and EMA weights: --pretrained takes the model's, --pretrained-ema the EMA's
    (MODEL.PRETRAINED_EMA, as eval.py --ema), and the log names the one taken."""
    best = finished_run / 'best.pth'
    stored = torch.load(best, weights_only=True)
    output = tmp_path / 'out'
    started = train_recording_the_start(['--cfg', TINY, '--output', str(output), '--data-path',
                                         str(finished_run.parent / 'digits'), '--pretrained', str(best)]
                                        + ['--pretrained-ema'] * ema + ['--opts', 'TRAIN.EPOCHS', '1'])
    weights = stored['model_ema' if ema else 'model']
    assert started.keys() == weights.keys() and all(torch.equal(started[k], v) for k, v in weights.items())
    log = (output / 'train.log').read_text()
    assert f"started from the {'EMA' if ema else 'model'} weights of {best} (MODEL.PRETRAINED_EMA {ema})\n" in log


def test_pretrained_ema_of_weights_without_an_ema_is_refused_before_the_data_is_read(finished_run, tmp_path,
                                                                                     capsys):
    plain = tmp_path / 'plain.pth'
    torch.save({'model': torch.load(finished_run / 'best.pth', weights_only=True)['model']}, plain)
    argv = ['--cfg', TINY, '--data-path', str(tmp_path / 'no-data'), '--output', str(tmp_path / 'out'),
            '--pretrained-ema']
    assert run_cli(train_main, argv + ['--pretrained', str(plain)]) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == (f"error: checkpoint {str(plain)!r} has no EMA weights; expected one of the keys "
                                       f"model_ema, state_dict_ema (set MODEL.PRETRAINED_EMA False to use the model "
                                       f"weights)\n")
    assert run_cli(train_main, argv + ['--pretrained', 'softmax_deit_tiny']) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == ("error: MODEL.PRETRAINED_EMA True takes the EMA weights of a checkpoint file, "
                                       "but MODEL.PRETRAINED 'softmax_deit_tiny' is no file; expected a checkpoint "
                                       "with EMA weights, or MODEL.PRETRAINED_EMA False\n")
    assert not (tmp_path / 'out').exists()


def test_pretrained_weights_of_another_family_are_named_as_such_not_offered_a_partial_start(finished_run, tmp_path,
                                                                                             capsys):
    """DeiT weights for a Swin model were offered MODEL.PRETRAINED_STRICT False, which loaded 4 of 63 tensors and
    trained from scratch under the name of a fine-tune."""
    digits = str(finished_run.parent / 'digits')
    best = finished_run / 'best.pth'
    swin = tmp_path / 'swin.yaml'
    swin.write_text('DATA: {DATASET: digits, IMG_SIZE: 16}\nMODEL: {NAME: softmax_swin_tiny, NUM_CLASSES: 10, KWARGS: '
                    '{embed_dim: 16, depths: [2, 2], num_heads: [1, 2], window_size: 2}}\n')
    assert run_cli(train_main, ['--cfg', str(swin), '--data-path', digits, '--pretrained', str(best), '--output',
                                str(tmp_path / 'swin')]) == USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {best}: checkpoint does not match SwinTransformer: missing: ") and err.endswith(
        "; it shares 6 of the model's 63 tensors by name, so it holds weights of another architecture; expected "
        "weights of softmax_swin_tiny (or of it with another attention)\n") and err.count('\n') == 1, err
    assert not (tmp_path / 'swin').exists()  # matched with the model before the data scan and the output folder


def test_throughput_shows_a_first_result_after_one_forward_and_keeps_stdout_for_results(capsys):
    code = run_cli(eval_main, ['--model', 'inline_deit_tiny', '--throughput', '--batch-size', '4',
                               '--warmup-forwards', '2', '--timed-forwards', '3', '--opts'] + TINY_MODEL_OPTS)
    out, err = capsys.readouterr()
    assert code == 0
    assert re.search(r'\] first forward: \d+\.\d images/s; 2 warm-up and 3 timed forwards of 4 images take about '
                     r'\d+:\d\d$', err, re.M)
    text, result = out.strip().splitlines()
    assert re.fullmatch(r'batch_size 4 throughput \d+\.\d images/s', text)
    assert {k: json.loads(result)[k] for k in ('batch_size', 'warmup', 'timed')} == dict(batch_size=4, warmup=2,
                                                                                          timed=3)


def test_a_compiled_throughput_estimates_the_run_from_a_forward_after_compiling(capsys, monkeypatch):
    """The estimate took the first forward, which compiles the model: minutes of compilation times the forwards,
    and with no warm-up forward the timed ones included the compilation. A compiled run now compiles in one
    forward more, then estimates from the first warm-up forward, after the compile time is logged."""
    calls = []
    real_compile = engine.evaluation.compile_model

    class SlowFirstCall(torch.nn.Module):
        def __init__(self, model, *args):
            super().__init__()
            self.compiled = real_compile(model, *args)

        def forward(self, images):
            calls.append(images.shape[0])
            if len(calls) == 1:
                time.sleep(1.0)  # the compilation
            return self.compiled(images)
    monkeypatch.setattr(engine.evaluation, 'compile_model', SlowFirstCall)
    code = run_cli(eval_main, ['--model', 'inline_deit_tiny', '--throughput', '--batch-size', '4', '--compile',
                               '--warmup-forwards', '3', '--timed-forwards', '2', '--opts',
                               'TRAIN.COMPILE_BACKEND', 'eager'] + TINY_MODEL_OPTS)
    err = capsys.readouterr().err
    assert code == 0 and len(calls) == 6
    compiled_line = next(i for i, line in enumerate(err.splitlines()) if 'torch.compile: the forward pass' in line)
    estimate = next(i for i, line in enumerate(err.splitlines()) if 'images/s; 3 warm-up' in line)
    assert estimate > compiled_line
    match = re.search(r'\] first forward after compiling: (\d+\.\d) images/s; 3 warm-up and 2 timed forwards of 4 '
                      r'images take about 0:0[0-3]$', err, re.M)
    assert match and float(match.group(1)) > 4.0, err  # a forward of 4 images well under the 1 s compilation
    for warmup in (0, 1):
        calls.clear()
        code = run_cli(eval_main, ['--model', 'inline_deit_tiny', '--throughput', '--batch-size', '4', '--compile',
                                   '--warmup-forwards', str(warmup), '--timed-forwards', '2', '--opts',
                                   'TRAIN.COMPILE_BACKEND', 'eager'] + TINY_MODEL_OPTS)
        out = capsys.readouterr().out
        assert code == 0 and len(calls) == 3 + warmup
        assert json.loads(out.splitlines()[-1])['throughput'] > 8.0  # 2 timed forwards of 4 images within 1 s


@pytest.mark.parametrize('argv, message', [
    (['--timed-forwards', '0'], '--warmup-forwards 50 --timed-forwards 0: expected at least 0 warm-up and 1 timed '
                                'forward'),
    (['--batch-size', '0'], '--batch-size 0: expected at least 1 image'),  # timed DATA.BATCH_SIZE's images
])
def test_throughput_needs_a_timed_forward_of_an_image(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        eval_main(['--model', 'inline_deit_tiny', '--throughput', *argv])
    assert exited.value.code == USAGE_EXIT_CODE
    assert capsys.readouterr().err.strip().splitlines()[-1] == f'eval.py: error: {message}'


def test_a_run_stopped_by_an_error_says_so_at_the_end_of_its_log(finished_run, tmp_path, capsys):
    """An error after the run took its folder (a download that fails; here, more accumulation steps than the data
    has batches) left an empty train.log: the error went to the console alone."""
    digits = str(finished_run.parent / 'digits')
    argv = ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--data-path', digits,
            '--opts', 'TRAIN.ACCUMULATION_STEPS', '1000']
    assert run_cli(train_main, argv) == USAGE_EXIT_CODE
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith('error: TRAIN.ACCUMULATION_STEPS 1000 exceeds the ')
    log = tmp_path / 'out' / 'train.log'
    assert log.read_text().splitlines()[-1].endswith(f"] {error}")
    # an error before the run takes the folder belongs to no run of it: the earlier run's log stays as it was
    written = log.read_text()
    assert run_cli(train_main, [*argv, 'MODEL.NUM_CLASSES', '11']) == USAGE_EXIT_CODE
    assert 'MODEL.NUM_CLASSES' in capsys.readouterr().err and log.read_text() == written


def test_a_run_stopped_by_an_unexpected_error_names_it_at_the_end_of_its_log(finished_run, tmp_path, monkeypatch):
    """Any exception, not only bad input (here one that a collective with a rank that ended would raise)."""
    def fail(*args, **kwargs):
        raise RuntimeError('Connection closed by peer [127.0.0.1]:1234. More details follow.\nTrace')

    monkeypatch.setattr(engine.trainer, 'train_one_epoch', fail)
    argv = ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--data-path', str(finished_run.parent / 'digits')]
    with pytest.raises(RuntimeError):
        train_main(argv)
    assert (tmp_path / 'out' / 'train.log').read_text().splitlines()[-1].endswith(
        "] error: RuntimeError: Connection closed by peer [127.0.0.1]:1234")
