"""Engine parts: the digits cache, data checks, evaluation preprocessing and exact counts, schedule, optimizer
groups, atomic checkpoints, RNG state, the training checkpoint's round trip, and one-line errors with exit status 2
from the command lines."""
import datetime
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import timm
import timm.models._hub
import torch
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError
from PIL import Image
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import list_optimizers
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from yacs.config import CfgNode

import engine.analysis
import engine.build
import engine.trainer
import engine.data
import engine.evaluation
from engine.build import (check_pretrained, create_criterion, create_model, create_optimizer, create_scheduler,
                          import_model_modules, read_weights)
from engine.checkpoint import TrainingCheckpoint, atomic_save, atomic_write_text, rng_state, set_rng_state
from engine.cli import eval_main, train_main
from engine.config import ConfigError, get_default_config, load_config
from engine.data import (DIGITS_STAMP, ShardSampler, eval_transform, image_mode, load_split, prepare_digits)
from engine.distributed import DistInfo, match_gradient_strides
from engine.errors import USAGE_EXIT_CODE, UsageError, run_cli
from engine.loops import EpochOptions, TrainState, evaluate, step_schedule, train_one_epoch
from models._files import UNFINISHED_FILES, files_taken_together
from models.checkpoint import CheckpointError, has_released_weights, released_weights_file

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml')
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu'))


@pytest.fixture
def tiny_cfg(digits):
    return load_config(TINY, ['DATA.DATA_PATH', str(digits)])


def test_digits_cache_is_a_stratified_split_of_the_real_digits(digits):
    from sklearn.datasets import load_digits
    data = load_digits()
    files = {split: sorted((digits / split).glob('*/*.png')) for split in ('train', 'val')}
    assert (len(files['train']), len(files['val'])) == (1437, 360)
    assert sorted(p.name for p in digits.iterdir()) == [DIGITS_STAMP, 'train', 'val']
    indices = {split: {int(p.stem) for p in paths} for split, paths in files.items()}
    assert not indices['train'] & indices['val'] and len(indices['train'] | indices['val']) == 1797
    val_counts = Counter(int(p.parent.name) for p in files['val'])
    all_counts = Counter(data.target.tolist())
    assert all(abs(val_counts[c] - 0.2 * all_counts[c]) <= 1 for c in range(10))  # stratified 80/20
    for path in files['val'][::45]:
        i = int(path.stem)
        assert int(path.parent.name) == data.target[i]
        pixels = np.asarray(Image.open(path))
        assert pixels.shape == (8, 8)
        np.testing.assert_array_equal(pixels, np.round(data.images[i] * 255 / 16).astype(np.uint8))
    stamp = (digits / DIGITS_STAMP).stat().st_mtime_ns
    prepare_digits(str(digits))  # already there: nothing is rewritten
    assert (digits / DIGITS_STAMP).stat().st_mtime_ns == stamp


def test_a_killed_digits_writer_leaves_no_cache(tmp_path, monkeypatch):
    def crash(root):
        (Path(root) / 'train' / '0').mkdir(parents=True)
        (Path(root) / 'train' / '0' / '0000.png').write_bytes(b'partial')
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.data, '_write_digits', crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_digits(str(tmp_path / 'cache'))
    assert list(tmp_path.iterdir()) == []


def test_a_digits_writer_killed_outright_leaves_a_folder_the_next_writer_removes(tmp_path):
    """SIGTERM or SIGKILL while the digits are written runs no clean-up: the staging folder stayed for good. The
    next writer on the host removes those of processes that no longer run, and leaves a running writer's."""
    finished = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    host = socket.gethostname()
    killed = tmp_path / f'.digits-{host}.{finished.stdout.strip()}.0123abcd'
    running = tmp_path / f'.digits-{host}.{os.getpid()}.4567cdef'
    for folder in (killed, running):
        (folder / 'train' / '0').mkdir(parents=True)
    prepare_digits(str(tmp_path / 'digits'))
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, 'digits']


@pytest.mark.parametrize('cause', ['a file on the path', 'a full disk', 'a full disk under an image library'])
def test_a_digits_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, cause):
    """...naming the file where the error does, and no 'None' where it does not (Pillow's writes)."""
    root = tmp_path / 'cache' / 'digits'
    if cause == 'a file on the path':
        (tmp_path / 'cache').write_text('not a folder')
        detail = f"{str(tmp_path / 'cache')!r} is a file, not a folder)"
    else:
        def full_disk(folder):
            (Path(folder) / 'train').mkdir()
            name = None if cause.endswith('library') else str(Path(folder) / 'train' / '0000.png')
            raise OSError(28, 'No space left on device', name)
        monkeypatch.setattr(engine.data, '_write_digits', full_disk)
        detail = 'No space left on device: ' if cause == 'a full disk' else 'No space left on device); '
    with pytest.raises(UsageError) as failure:
        prepare_digits(str(root))
    message = str(failure.value)
    assert message.startswith(f"cannot write the digits cache {str(root)!r} ({detail}") and '\n' not in message
    assert message.endswith("expected a folder this user can write: set DATA.DATA_PATH, or XDG_CACHE_HOME for the "
                            "default place")
    assert [p.name for p in tmp_path.iterdir()] == ['cache']  # nothing half-written stays


def test_digits_refuses_a_folder_of_other_files(tmp_path):
    (tmp_path / 'mine.txt').write_text('keep me')
    with pytest.raises(UsageError, match='holds files but no digits cache'):
        prepare_digits(str(tmp_path))


def test_dataset_folder_errors_name_the_folder(tmp_path, digits):
    with pytest.raises(UsageError, match='does not exist'):
        load_split(str(tmp_path / 'nope'), 'train', None)
    (tmp_path / 'train').mkdir()
    with pytest.raises(UsageError, match=r"has no val/ folder; expected val/<class>/<images>"):
        load_split(str(tmp_path), 'val', None)
    with pytest.raises(UsageError, match='is empty; expected one folder of images per class'):
        load_split(str(tmp_path), 'train', None)
    (tmp_path / 'train' / 'ILSVRC2012_val_00000001.JPEG').write_bytes(b'')  # a flat split, as ImageNet's val ships
    with pytest.raises(UsageError, match=r"holds 1 image files but no class folders; expected .*train/<class>/<images> "
                                         r"\(sort a flat split into its class folders first\)"):
        load_split(str(tmp_path), 'train', None)
    (tmp_path / 'train' / 'cat').mkdir()
    with pytest.raises(UsageError, match='class folder without images'):
        load_split(str(tmp_path), 'train', None)
    with pytest.raises(UsageError, match=r'has 10 class folders but the model has 1000 classes \(MODEL.NUM_CLASSES\)'):
        load_split(str(digits), 'val', None, num_classes=1000)


@pytest.mark.parametrize('size, crop_mode, resize', [(224, 'center', 256), (288, 'squash', 329), (384, 'squash', 438)])
def test_eval_preprocessing_is_the_official_resize_then_centre_crop(size, crop_mode, resize):
    cfg = load_config(None, ['DATA.IMG_SIZE', str(size), 'TEST.CROP_MODE', crop_mode])
    assert resize == int(size * 256 / 224)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (300, 500, 3), dtype=np.uint8))
    if crop_mode == 'squash':
        scaled = image.resize((resize, resize), Image.Resampling.BICUBIC)
    else:  # shorter side to `resize`, keeping the aspect ratio
        scaled = image.resize((int(resize * 500 / 300), resize), Image.Resampling.BICUBIC)
    left, top = (scaled.width - size) // 2, (scaled.height - size) // 2
    crop = np.asarray(scaled.crop((left, top, left + size, top + size)), dtype=np.float32) / 255
    expected = (torch.from_numpy(crop).permute(2, 0, 1) - torch.tensor(cfg.DATA.MEAN)[:, None, None]) \
        / torch.tensor(cfg.DATA.STD)[:, None, None]
    torch.testing.assert_close(eval_transform(cfg)(image), expected, atol=2e-2, rtol=0)  # PIL vs tensor rounding


def test_shard_sampler_gives_each_sample_to_exactly_one_rank():
    shards = [list(ShardSampler(10, rank, 3)) for rank in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    assert [len(s) for s in shards] == [4, 3, 3]


def test_evaluation_counts_are_exact_when_the_set_does_not_divide_by_the_world_size():
    torch.manual_seed(0)
    logits = torch.randn(11, 7)
    targets = torch.randint(0, 7, (11,))
    dataset = TensorDataset(logits, targets)
    model = nn.Identity()
    order = logits.argsort(dim=1, descending=True)
    top1 = (order[:, 0] == targets).sum().item()
    top5 = (order[:, :5] == targets[:, None]).any(dim=1).sum().item()
    loss = nn.functional.cross_entropy(logits, targets, reduction='sum').item()
    correct1 = correct5 = total = loss_sum = 0.0
    for rank in range(3):  # what the all-reduce sums over three processes
        info = DistInfo(rank=rank, world_size=3, local_rank=rank, device=torch.device('cpu'))
        loader = DataLoader(dataset, batch_size=2, sampler=ShardSampler(len(dataset), rank, 3))
        result = evaluate(model, loader, info)
        correct1 += result['top1'] * result['count'] / 100
        correct5 += result['top5'] * result['count'] / 100
        loss_sum += result['loss'] * result['count']
        total += result['count']
    assert total == 11
    assert round(correct1) == top1 and round(correct5) == top5
    assert loss_sum == pytest.approx(loss)
    whole = evaluate(model, DataLoader(dataset, batch_size=4), CPU)
    assert whole['top1'] == pytest.approx(100 * top1 / 11) and whole['top5'] == pytest.approx(100 * top5 / 11)


@pytest.mark.parametrize('name', ['softmax_pvt_v2_b2_li', 'softmax_cswin_tiny', 'sima_nano_12_p16'])
def test_gradients_reach_ddp_in_their_parameters_strides(name):
    """Depthwise and pointwise convolutions on channels-last images give weight gradients whose strides differ from
    the weights' in size-1 dimensions, and so does the class token at one image per process: DDP warned at every
    run that performance may suffer (the two-process test checks the warning is gone). Restrided, they are the same
    numbers."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10)
    gradients = {}
    for restrided in (False, True):
        if restrided:
            match_gradient_strides(model)
        for batch in (1, 2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(batch)
            model(torch.randn(batch, 3, 32, 32)).sum().backward()
            gradients[restrided, batch] = {key: p.grad for key, p in model.named_parameters()}
    for batch in (1, 2):
        differing = [key for key, p in model.named_parameters() if gradients[False, batch][key].stride() != p.stride()]
        assert differing  # the case this covers
        for key, p in model.named_parameters():
            assert gradients[True, batch][key].stride() == p.stride(), key
            assert torch.equal(gradients[True, batch][key], gradients[False, batch][key]), key


def test_schedule_warms_up_then_follows_the_cosine_per_update_and_cools_down():
    cfg = load_config(None, ['TRAIN.EPOCHS', '4', 'TRAIN.WARMUP_EPOCHS', '1', 'TRAIN.COOLDOWN_EPOCHS', '2',
                             'TRAIN.LR_SCHEDULER.STEP', 'update'])
    lr, warmup_lr, min_lr, per_epoch = 1e-3, 1e-6, 1e-5, 5
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler, epochs = create_scheduler(cfg, optimizer, dict(lr=lr, warmup_lr=warmup_lr, min_lr=min_lr), per_epoch)
    assert epochs == 6
    for step in range(epochs * per_epoch):
        scheduler.step_update(num_updates=step)
        if step < per_epoch:
            expected = warmup_lr + step * (lr - warmup_lr) / per_epoch
        elif step < 4 * per_epoch:  # the cosine counts from update 0 (no warm-up prefix)
            expected = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * step / (4 * per_epoch)))
        else:
            expected = min_lr
        assert optimizer.param_groups[0]['lr'] == pytest.approx(expected, rel=1e-12), step


def test_sync_bn_converts_batchnorm_on_gpus_and_says_it_cannot_on_the_cpu(caplog):
    """TRAIN.SYNC_BN (the SimA recipe's SyncBatchNorm): on a CUDA device the BatchNorm layers become SyncBatchNorm
    with the same parameters, buffers and keys (in evaluation the same function); torch's SyncBatchNorm has no CPU
    kernel, so there rank 0 says the statistics stay per process; a model without BatchNorm is left alone."""
    torch.manual_seed(0)
    model = timm.create_model('sima_nano_12_p16', img_size=32, depth=1, num_classes=5).eval()
    batchnorms = [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    parameters, state = [id(p) for p in model.parameters()], model.state_dict()
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    gpu = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device('cuda'))
    assert engine.build.synchronize_batchnorm(model, gpu) is model
    modules = dict(model.named_modules())
    assert len(batchnorms) == 5 and all(type(modules[n]) is nn.SyncBatchNorm for n in batchnorms)
    assert [id(p) for p in model.parameters()] == parameters and model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(model(x), expected)
    for rank in (0, 1):
        cpu_model = timm.create_model('sima_nano_12_p16', img_size=32, depth=1)
        with caplog.at_level('WARNING', logger='engine'):
            engine.build.synchronize_batchnorm(cpu_model, DistInfo(rank, 2, rank, torch.device('cpu')))
        assert not any(isinstance(m, nn.SyncBatchNorm) for m in cpu_model.modules())
    assert [r.getMessage() for r in caplog.records] == [
        "TRAIN.SYNC_BN: torch's SyncBatchNorm runs on CUDA, XPU and HPU devices only; on cpu each process keeps "
        "BatchNorm statistics of its own batches"]
    caplog.clear()
    deit = timm.create_model('sima_deit_small_ls', img_size=32, patch_size=16, depth=1)
    assert engine.build.synchronize_batchnorm(deit, DistInfo(0, 2, 0, torch.device('cpu'))) is deit
    assert not caplog.records


def test_sync_bn_with_compile_is_refused_before_any_data_is_read_where_it_would_synchronize(tmp_path):
    """torch.compile(fullgraph=True) cannot trace SyncBatchNorm's collectives: the SimA recipe with --compile under
    several GPU processes stops on one line before reading data; on the CPU (no SyncBatchNorm) or one process, or for
    a model without BatchNorm, it compiles."""
    def train_with(model: str, info: DistInfo) -> None:
        cfg = load_config(str(REPO / 'configs' / 'base' / 'sima_xcit.yaml'),
                          ['MODEL.NAME', model, 'TRAIN.COMPILE', 'True', 'DATA.DATA_PATH', str(tmp_path / 'absent'),
                           'OUTPUT', str(tmp_path / 'out')])
        engine.trainer.train(cfg, info)

    refusal = (r"^TRAIN.SYNC_BN with TRAIN.COMPILE: torch.compile\(fullgraph=True\) cannot trace the collectives of "
               r"torch's SyncBatchNorm as one graph; expected one of them off \(TRAIN.SYNC_BN False keeps BatchNorm "
               r"statistics per process\)$")
    with pytest.raises(UsageError, match=refusal):
        train_with('sima_nano_12_p16', DistInfo(0, 2, 0, torch.device('cuda')))
    for model, info in (('sima_nano_12_p16', DistInfo(0, 2, 0, torch.device('cpu'))),
                        ('sima_nano_12_p16', DistInfo(0, 1, 0, torch.device('cuda'))),
                        ('sima_deit_small_ls', DistInfo(0, 2, 0, torch.device('cuda')))):
        with pytest.raises(UsageError, match='does not exist'):  # past the check, at the data
            train_with(model, info)


def test_no_weight_decay_on_norms_biases_and_position_embeddings(tiny_cfg):
    model = create_model(tiny_cfg)
    optimizer = create_optimizer(tiny_cfg, model, lr=2e-3)
    assert isinstance(optimizer, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g['weight_decay']: {names[id(p)] for p in g['params']} for g in optimizer.param_groups}
    assert set(groups) == {0.0, 0.05}
    no_decay, decay = groups[0.0], groups[0.05]
    assert {'pos_embed', 'cls_token', 'norm.weight', 'norm.bias', 'head.bias', 'blocks.0.attn.qkv.bias'} <= no_decay
    assert {'blocks.0.attn.qkv.weight', 'blocks.0.mlp.fc1.weight', 'head.weight'} <= decay
    assert all(not n.endswith('.bias') and 'norm' not in n for n in decay)
    assert no_decay | decay == set(names.values())
    assert all(g['lr'] == 2e-3 and g['eps'] == 1e-8 for g in optimizer.param_groups)


def test_backbone_lr_scale_splits_each_weight_decay_group_and_scales_the_backbone_schedule(tiny_cfg):
    """TRAIN.BACKBONE_LR_SCALE (CSwin's --lr-scale): the classifier's parameters follow BASE_LR's schedule and every
    other parameter the same schedule from `scale` times the peak, to the same warm-up start and minimum (CSwin's
    timm scheduler keeps one peak per group); weight decay is the unscaled optimizer's, parameter for parameter.
    AdamW's first step moves each weight by its group's learning rate."""
    cfg = load_config(TINY, ['TRAIN.BACKBONE_LR_SCALE', '0.05', 'TRAIN.WARMUP_EPOCHS', '2', 'TRAIN.EPOCHS', '6',
                             'TRAIN.WARMUP_LR', '1e-6', 'TRAIN.MIN_LR', '1e-5', 'TRAIN.LR_SCHEDULER.STEP', 'epoch'])
    torch.manual_seed(0)
    model = create_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    plain = create_optimizer(tiny_cfg, model, lr=2e-3)
    decay_of = {names[id(p)]: g['weight_decay'] for g in plain.param_groups for p in g['params']}
    optimizer = create_optimizer(cfg, model, lr=2e-3)
    assert len(optimizer.param_groups) == 4 and [g['lr'] for g in optimizer.param_groups] == [2e-3, 2e-3, 1e-4, 1e-4]
    grouped = [names[id(p)] for g in optimizer.param_groups for p in g['params']]
    assert sorted(grouped) == sorted(names.values())
    assert {names[id(p)] for g in optimizer.param_groups[:2] for p in g['params']} == {'head.weight', 'head.bias'}
    assert {n: g['weight_decay'] for g in optimizer.param_groups for n in (names[id(p)] for p in g['params'])} \
        == decay_of

    lrs = dict(lr=2e-3, warmup_lr=1e-6, min_lr=1e-5)
    scheduler, _ = create_scheduler(cfg, optimizer, lrs, updates_per_epoch=3)
    seen = []
    for epoch in range(6):
        step_schedule(scheduler, TrainState(epoch=epoch), 3, 1, 'epoch')
        seen.append([g['lr'] for g in optimizer.param_groups])
    assert seen[0] == [1e-6] * 4  # the warm-up starts every group at WARMUP_LR
    for peak, index in ((2e-3, 0), (1e-4, 2)):
        assert seen[1][index] == pytest.approx(1e-6 + (peak - 1e-6) / 2, rel=1e-12)
        cosine = 1e-5 + 0.5 * (peak - 1e-5) * (1 + math.cos(math.pi * 3 / 6))
        assert seen[3][index] == pytest.approx(cosine, rel=1e-12)
    step_schedule(scheduler, TrainState(epoch=6), 3, 1, 'epoch')
    assert [g['lr'] for g in optimizer.param_groups] == pytest.approx([1e-5] * 4, rel=1e-12)

    no_decay = load_config(TINY, ['TRAIN.BACKBONE_LR_SCALE', '0.05', 'TRAIN.WEIGHT_DECAY', '0'])
    model = model.double()
    optimizer = create_optimizer(no_decay, model, lr=2e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.sign(torch.randn_like(p)) * (1 + torch.rand_like(p))
    optimizer.step()
    for n, p in model.named_parameters():
        lr = 2e-3 if n.startswith('head.') else 1e-4
        torch.testing.assert_close((p.detach() - before[n]).abs(), torch.full_like(p, lr), rtol=1e-7, atol=0)


@pytest.mark.parametrize('name', ['adamw', 'sgd'])
def test_the_fused_update_is_the_per_tensor_update(tiny_cfg, name):
    """Three steps of the fused kernel and of torch's per-tensor loop from the same float64 weights and gradients
    end at the same weights and optimizer state."""
    torch.manual_seed(0)
    model = create_model(tiny_cfg).double()
    gradients = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
    states = {}
    for fused in (True, False):
        cfg = load_config(None, ['TRAIN.OPTIMIZER.NAME', name, 'TRAIN.OPTIMIZER.FUSED', str(fused)])
        copy = create_model(tiny_cfg).double()
        copy.load_state_dict(model.state_dict())
        optimizer = create_optimizer(cfg, copy, lr=2e-3)
        assert all(bool(g['fused']) is fused for g in optimizer.param_groups)
        for step in gradients:
            for p, g in zip(copy.parameters(), step):
                p.grad = g.clone()
            optimizer.step()
        states[fused] = [p.detach() for p in copy.parameters()], optimizer.state_dict()['state']
    (fused_weights, fused_state), (loop_weights, loop_state) = states[True], states[False]
    assert max((a - b).abs().max().item() for a, b in zip(fused_weights, loop_weights)) < 1e-12
    assert all(not torch.equal(a, p) for a, p in zip(fused_weights, model.parameters()))  # every weight moved
    for index, buffers in loop_state.items():
        for key, value in buffers.items():
            torch.testing.assert_close(fused_state[index][key].double(), value.double(), rtol=1e-12, atol=1e-12)


class _UnusedScheduler:
    def step_update(self, num_updates: int) -> None:
        pass


@pytest.mark.parametrize('name', list_optimizers())
def test_every_timm_optimizer_trains_or_is_refused_before_any_data_is_read(name):
    """TRAIN.OPTIMIZER.NAME takes any timm optimizer with its own betas and eps: the engine passed (0.9, 0.999) and
    1e-8 to all of them (the Adan family, which takes three betas, failed with an IndexError; Lion and LAMB trained
    with other values than their own) and backpropagated without the graph AdaHessian differentiates. Those that
    cannot be built here (bitsandbytes' and APEX's need CUDA) are one config error."""
    cfg = load_config(None, ['TRAIN.OPTIMIZER.NAME', name])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    start = [p.detach().clone() for p in model.parameters()]
    try:
        optimizer = create_optimizer(cfg, model, lr=1e-2)
    except ConfigError as e:
        assert not torch.cuda.is_available() and name.startswith(('bnb', 'fused'))
        assert str(e).startswith(f"config key TRAIN.OPTIMIZER.NAME is {name!r}, which cannot be built here (")
        return
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator))
               for _ in range(2)]
    train_one_epoch(model, batches, nn.CrossEntropyLoss(), optimizer, _UnusedScheduler(),
                    torch.amp.GradScaler('cpu', enabled=False), TrainState(), CPU, EpochOptions(updates=2))
    for before, after in zip(start, model.parameters()):
        assert not torch.equal(before, after) and torch.isfinite(after).all()


@pytest.mark.parametrize('name, betas, eps', [('adamw', (0.9, 0.999), 1e-8), ('lamb', (0.9, 0.999), 1e-6),
                                              ('lion', (0.9, 0.99), None), ('adan', (0.98, 0.92, 0.99), 1e-8)])
def test_an_optimizer_keeps_its_own_betas_and_eps_unless_the_config_gives_them(name, betas, eps):
    model = nn.Linear(4, 3)
    group = create_optimizer(load_config(None, ['TRAIN.OPTIMIZER.NAME', name]), model, lr=1e-3).param_groups[0]
    assert tuple(group['betas']) == betas and group.get('eps') == eps
    given = [round(b - 0.05, 2) for b in betas]
    opts = ['TRAIN.OPTIMIZER.NAME', name, 'TRAIN.OPTIMIZER.BETAS', str(given)]
    if eps is not None:
        opts += ['TRAIN.OPTIMIZER.EPS', '1e-5']
    group = create_optimizer(load_config(None, opts), model, lr=1e-3).param_groups[0]
    assert list(group['betas']) == given and group.get('eps') == (eps and 1e-5)


@pytest.mark.parametrize('opts, message', [
    (['TRAIN.OPTIMIZER.NAME', 'adan', 'TRAIN.OPTIMIZER.BETAS', '[0.9, 0.99]'],
     "config key TRAIN.OPTIMIZER.BETAS is [0.9, 0.99]; 'adan' takes 3 betas (its own: [0.98, 0.92, 0.99], or None "
     "for its own)"),
    (['TRAIN.OPTIMIZER.BETAS', '[0.9, 0.99, 0.999]'],
     "config key TRAIN.OPTIMIZER.BETAS is [0.9, 0.99, 0.999]; 'adamw' takes 2 betas (its own: [0.9, 0.999], or None "
     "for its own)"),
])
def test_betas_an_optimizer_cannot_take_are_refused_before_any_data_is_read(tmp_path, capsys, opts, message):
    assert run_cli(train_main, ['--cfg', TINY, '--data-path', str(tmp_path / 'absent'), '--output',
                                str(tmp_path / 'out'), '--opts', *opts]) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == f"error: {message}\n"


def test_eps_and_betas_are_left_out_for_an_optimizer_that_takes_none_as_timm_does():
    """A run's config.yaml holds EPS and BETAS (1e-8 and [0.9, 0.999] before they defaulted to None): SGD built
    from it, and Lion (no eps), build as timm's factory builds them, without those keywords."""
    model = nn.Linear(4, 3)
    given = ['TRAIN.OPTIMIZER.EPS', '1e-8', 'TRAIN.OPTIMIZER.BETAS', '[0.9, 0.999]']
    sgd = create_optimizer(load_config(None, ['TRAIN.OPTIMIZER.NAME', 'sgd', *given]), model, lr=1e-3)
    lion = create_optimizer(load_config(None, ['TRAIN.OPTIMIZER.NAME', 'lion', *given]), model, lr=1e-3)
    assert 'eps' not in sgd.param_groups[0] and 'betas' not in sgd.param_groups[0]
    assert 'eps' not in lion.param_groups[0] and tuple(lion.param_groups[0]['betas']) == (0.9, 0.999)


def test_the_fused_update_skips_what_the_gradient_scaler_skips(tiny_cfg):
    """Under float16 AMP the scaler hands the fused kernel its scale and inf flag instead of skipping the call:
    over three steps, the second with an infinite gradient, the fused run ends at the per-tensor run's weights,
    with two updates counted, and the scaler halved once by both."""
    torch.manual_seed(0)
    model = create_model(tiny_cfg).double()
    gradients = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
    gradients[1][0][0] = float('inf')
    runs = {}
    for fused in (True, False):
        copy = create_model(tiny_cfg).double()
        copy.load_state_dict(model.state_dict())
        optimizer = create_optimizer(load_config(None, ['TRAIN.OPTIMIZER.FUSED', str(fused)]), copy, lr=2e-3)
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
        for step in gradients:
            scale = scaler.scale(torch.ones((), dtype=torch.float64))  # the scaled loss's factor
            for p, g in zip(copy.parameters(), step):
                p.grad = g * scale
            scaler.step(optimizer)
            scaler.update()
        steps = {float(s['step']) for s in optimizer.state.values()}
        runs[fused] = [p.detach() for p in copy.parameters()], steps, scaler.get_scale()
    (fused_weights, fused_steps, fused_scale), (loop_weights, loop_steps, loop_scale) = runs[True], runs[False]
    assert fused_steps == loop_steps == {2.0} and fused_scale == loop_scale == 2.0 ** 9
    assert max((a - b).abs().max().item() for a, b in zip(fused_weights, loop_weights)) < 1e-12


def test_optimizers_without_a_fused_kernel_on_every_device_keep_their_own(tiny_cfg):
    model = create_model(tiny_cfg)
    for name in ('adagrad', 'lamb', 'nadamw'):  # Adagrad's fused kernel runs on the CPU only
        optimizer = create_optimizer(load_config(None, ['TRAIN.OPTIMIZER.NAME', name]), model, lr=1e-3)
        assert not optimizer.defaults.get('fused'), name


def test_loss_follows_mixup_and_smoothing():
    assert isinstance(create_criterion(load_config(None)), SoftTargetCrossEntropy)
    smoothing = create_criterion(load_config(None, ['AUG.MIXUP', '0.0', 'AUG.CUTMIX', '0.0']))
    assert isinstance(smoothing, LabelSmoothingCrossEntropy) and smoothing.smoothing == 0.1
    plain = load_config(None, ['AUG.MIXUP', '0.0', 'AUG.CUTMIX', '0.0', 'MODEL.LABEL_SMOOTHING', '0.0'])
    assert type(create_criterion(plain)) is nn.CrossEntropyLoss


def test_model_errors_name_the_model_and_the_keyword(tiny_cfg):
    cfg = tiny_cfg.clone()
    cfg.defrost()
    cfg.MODEL.NAME = 'inline_deit_tinny'
    with pytest.raises(UsageError, match=r"unknown model 'inline_deit_tinny'.*did you mean inline_deit_tiny"):
        create_model(cfg)
    cfg.MODEL.NAME = 'local-dir:saved'  # a model saved for the hub: its weights go elsewhere
    with pytest.raises(UsageError, match=r"^model 'local-dir:saved' is a saved model, not an architecture; expected "
                                         r"the architecture's registered name, with --pretrained local-dir:saved "
                                         r"\(train\.py\) for its weights, or --model local-dir:saved \(eval\.py\) "
                                         r"alone$"):
        create_model(cfg)
    cfg.MODEL.NAME = 'inline_deit_tiny'
    cfg.MODEL.KWARGS.depthz = 3
    with pytest.raises(ConfigError, match=r"does not accept the keyword 'depthz' \(MODEL.KWARGS.depthz\); "
                       r"expected the constructor's own argument names$"):
        create_model(cfg)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / 'last.pth'
    atomic_save({'step': 1}, str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    real_save = torch.save

    def crash(obj, f):
        real_save({'step': 2}, f)
        f.truncate(10)  # a half-written file, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, 'save', crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({'step': 2}, str(path))
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {'step': 1}
    assert [p.name for p in tmp_path.iterdir()] == ['last.pth']


def test_atomic_write_text_keeps_the_old_file_when_a_signal_comes_mid_write(tmp_path, monkeypatch):
    path = tmp_path / 'table.md'
    atomic_write_text(str(path), 'the last table\n')
    real_fsync = os.fsync

    def stopped(fd):  # the bytes are written, not yet synced or renamed
        raise KeyboardInterrupt

    monkeypatch.setattr(os, 'fsync', stopped)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(str(path), 'a new table\n')
    monkeypatch.setattr(os, 'fsync', real_fsync)
    assert path.read_text() == 'the last table\n' and [p.name for p in tmp_path.iterdir()] == ['table.md']
    atomic_write_text(str(path), 'a new table, ü\n')
    assert path.read_text(encoding='utf-8') == 'a new table, ü\n'


def test_files_taken_together_take_their_names_at_the_end_and_a_signal_waits_for_all(tmp_path, monkeypatch):
    """A stop inside the block leaves every previous file and no temporary one; SIGINT while the names change is
    delivered after the last, so a run stopped there leaves every new file."""
    paths = [tmp_path / name for name in ('t.csv', 't.md')]
    for path in paths:
        atomic_write_text(str(path), 'old\n')
    with pytest.raises(KeyboardInterrupt):
        with files_taken_together():
            atomic_write_text(str(paths[0]), 'new\n')
            assert paths[0].read_text() == 'old\n'
            raise KeyboardInterrupt
    assert [p.read_text() for p in paths] == ['old\n', 'old\n'] and sorted(os.listdir(tmp_path)) == ['t.csv', 't.md']
    assert not UNFINISHED_FILES
    with pytest.raises(KeyboardInterrupt):  # a block inside another joins it
        with files_taken_together():
            with files_taken_together():
                atomic_write_text(str(paths[0]), 'new\n')
            atomic_write_text(str(paths[1]), 'new\n')
            raise KeyboardInterrupt
    assert [p.read_text() for p in paths] == ['old\n', 'old\n'] and sorted(os.listdir(tmp_path)) == ['t.csv', 't.md']
    atomic_write_text(str(paths[0]), 'written at once\n')  # no block left open
    assert paths[0].read_text() == 'written at once\n'
    real_replace = os.replace

    def signalled(source, target):  # SIGINT as a terminal sends it, between the two renames
        if target == str(paths[0]):
            os.kill(os.getpid(), signal.SIGINT)
        real_replace(source, target)

    monkeypatch.setattr(os, 'replace', signalled)
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # also where pytest ignores SIGINT
    try:
        with pytest.raises(KeyboardInterrupt):
            with files_taken_together():
                for path in paths:
                    atomic_write_text(str(path), 'new\n')
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    assert [p.read_text() for p in paths] == ['new\n', 'new\n'] and sorted(os.listdir(tmp_path)) == ['t.csv', 't.md']
    assert not UNFINISHED_FILES


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # leaves a cached Gaussian in NumPy's state
    atomic_save({'rng': [rng_state()]}, str(tmp_path / 'rng.pth'))
    draws = (random.random(), random.gauss(0, 1), np.random.rand(3), np.random.normal(), torch.rand(3))
    set_rng_state(torch.load(tmp_path / 'rng.pth', weights_only=True)['rng'][0])
    again = (random.random(), random.gauss(0, 1), np.random.rand(3), np.random.normal(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and draws[3] == again[3]
    np.testing.assert_array_equal(draws[2], again[2])
    assert torch.equal(draws[4], again[4])


def test_corrupt_and_foreign_checkpoints_fail_with_one_line(tmp_path):
    good = tmp_path / 'good.pth'
    torch.save({'model': {'w': torch.ones(3)}}, good)
    broken = tmp_path / 'broken.pth'
    broken.write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match='truncated or corrupt'):
        read_weights(str(broken))
    with pytest.raises(CheckpointError, match='not a training checkpoint of this engine: it lacks optimizer'):
        TrainingCheckpoint.read(str(good))
    with pytest.raises(CheckpointError, match='has no EMA weights'):
        read_weights(str(good), ema=True)
    # a file of another code (a release) gives the weights its download gives, EMA first; ours, its model weights
    both = tmp_path / 'both.pth'
    torch.save({'state_dict': {'w': torch.ones(1)}, 'state_dict_ema': {'module.w': torch.zeros(1)}}, both)
    assert torch.equal(read_weights(str(both))['w'], torch.zeros(1))
    assert torch.equal(read_weights(str(both), ema=True)['w'], torch.zeros(1))
    ours = tmp_path / 'ours.pth'
    torch.save({'model': {'w': torch.ones(1)}, 'model_ema': {'w': torch.zeros(1)}, 'config': 'MODEL: {}\n'}, ours)
    assert torch.equal(read_weights(str(ours))['w'], torch.ones(1))
    assert torch.equal(read_weights(str(ours), ema=True)['w'], torch.zeros(1))


def test_checkpoints_whose_pickle_is_damaged_fail_with_one_line(tmp_path):
    """A damaged pickle fails inside torch's unpickler with KeyError, IndexError, AssertionError or TypeError, not
    only the errors a cut-off file gives: each was a bare traceback through eval.py, train.py --pretrained and
    load_pretrained_into."""
    good = tmp_path / 'good.pth'
    torch.save({'model': {'w': torch.zeros(3), 'b': torch.ones(2)}}, good)
    data = bytearray(good.read_bytes())
    data[64] = 0x68  # an opcode of the archive's data.pkl: a memo lookup of an entry never stored
    damaged = {'flipped.pth': bytes(data), 'memo.pth': b'\x80\x02h\x00.'}
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError) as raised:
            read_weights(str(tmp_path / name))
        message = str(raised.value)
        assert message.startswith(f"checkpoint {str(tmp_path / name)!r} is truncated or corrupt (") and \
            '\n' not in message, message


@pytest.mark.parametrize('key', ['model_ema', 'state_dict_ema'])
def test_a_checkpoint_of_ema_weights_alone_gives_them_as_its_weights(tmp_path, key):
    """Without --ema, a file that holds only EMA weights (a release of its EMA, as SimA's) gives those: it was
    refused as 'entry ... is a dict, not a tensor'."""
    path = tmp_path / 'ema.pth'
    torch.save({key: {'module.w': torch.full((2,), 3.0)}, 'epoch': 5}, path)
    assert torch.equal(read_weights(str(path))['w'], torch.full((2,), 3.0))
    assert torch.equal(read_weights(str(path), ema=True)['w'], torch.full((2,), 3.0))


@pytest.mark.parametrize('content, held', [([torch.ones(1)], 'a list'),
                                           ({'w': torch.ones(1), 'step': 3}, "'step', an int")])
def test_a_checkpoint_that_is_no_state_dict_is_named_on_one_line(tmp_path, content, held):
    path = tmp_path / 'odd.pth'
    torch.save(content, path)
    with pytest.raises(CheckpointError) as raised:
        read_weights(str(path))
    message = str(raised.value)
    assert message.startswith(f"checkpoint {str(path)!r} holds {held}") and '\n' not in message, message


def _training_objects(output: Path, state: TrainState, info: DistInfo = CPU, seed: int = 0) -> TrainingCheckpoint:
    """The trainer's live objects around a small model (EMA, AdamW, a warm-up and cosine schedule per update, an
    enabled gradient scaler), in a `TrainingCheckpoint` writing to `output`."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler, _ = create_scheduler_v2(optimizer, sched='cosine', num_epochs=4, warmup_epochs=1, warmup_lr=1e-3,
                                       step_on_epochs=False, updates_per_epoch=5)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** (seed + 4))
    return TrainingCheckpoint(str(output), info, state, model, optimizer, scheduler, scaler,
                              ModelEmaV3(model, decay=0.5), config='MODEL:\n  NAME: linear\n',
                              classes=['cat', 'dog', 'fox'])


def _assert_same(a, b, where: str = 'checkpoint') -> None:
    """`a` and `b` hold the same keys in the same order and equal values, tensor for tensor."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f'{where}[{key!r}]')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f'{where}[{i}]')
    else:
        assert a == b, where


def test_a_training_checkpoint_restores_every_field(tmp_path):
    saved = _training_objects(tmp_path / 'saved', TrainState(epoch=1, epoch_batches=3, step=8, max_accuracy=62.5,
                                                             max_ema_accuracy=60.0, epoch_loss_sum=12.5,
                                                             epoch_loss_count=16.0, skipped_steps=1))
    for step in range(6, 9):  # optimizer moments, a grown scaler, a moved EMA and schedule (epoch 0 made 5 updates)
        loss = saved.model(torch.randn(8, 4)).logsumexp(1).mean()
        saved.scaler.scale(loss).backward()
        saved.scaler.step(saved.optimizer)
        saved.scaler.update()
        saved.optimizer.zero_grad()
        saved.scheduler.step_update(num_updates=step)
        saved.ema.update(saved.model)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved.save(best=True)  # mid-epoch: no metrics
    draws = (random.random(), np.random.rand(3), torch.rand(3))
    stored = TrainingCheckpoint.read(saved.last_path)
    # the keys (and their order) of the format that earlier checkpoints were written in, then `train_record`,
    # `classes` and `epoch_loss`
    assert list(stored) == ['model', 'model_ema', 'optimizer', 'scheduler', 'scaler', 'epoch', 'epoch_batches',
                            'step', 'max_accuracy', 'max_ema_accuracy', 'rng', 'world_size', 'config', 'metrics',
                            'train_record', 'classes', 'epoch_loss']
    assert stored['classes'] == ['cat', 'dog', 'fox']
    _assert_same(TrainingCheckpoint.read(saved.best_path), stored)

    restored = _training_objects(tmp_path / 'restored', TrainState(), seed=1)
    restored.restore(stored, saved.last_path, batches_per_epoch=5)
    assert restored.state == TrainState(epoch=1, epoch_batches=3, step=8, max_accuracy=62.5, max_ema_accuracy=60.0,
                                        epoch_loss_sum=12.5, epoch_loss_count=16.0)
    restored.save()  # nothing drew a random number since the restore
    _assert_same(TrainingCheckpoint.read(restored.last_path), stored)
    again = (random.random(), np.random.rand(3), torch.rand(3))
    assert draws[0] == again[0] and np.array_equal(draws[1], again[1]) and torch.equal(draws[2], again[2])

    # a finished epoch goes on at the next one, the schedule (not the stored learning rate) sets the learning rate
    # where this run's epochs put it (two of 3 batches: update 6), and another world size keeps this process's
    # random streams
    stored['optimizer']['param_groups'][0]['lr'] = 1.0
    two = _training_objects(tmp_path / 'two', TrainState(), DistInfo(rank=0, world_size=2, local_rank=0,
                                                                     device=torch.device('cpu')))
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger('engine').addHandler(handler)
    torch.manual_seed(4)
    expected = torch.rand(3)
    torch.manual_seed(4)
    try:
        two.restore(stored, saved.last_path, batches_per_epoch=3)
    finally:
        logging.getLogger('engine').removeHandler(handler)
    assert torch.equal(torch.rand(3), expected)
    assert (two.state.epoch, two.state.epoch_batches, two.state.step) == (2, 0, 8)
    schedule = _training_objects(tmp_path / 'schedule', TrainState())
    schedule.scheduler.step_update(num_updates=6)
    assert two.optimizer.param_groups[0]['lr'] == schedule.optimizer.param_groups[0]['lr'] \
        != saved.optimizer.param_groups[0]['lr']
    assert f"{saved.last_path} was written by 1 processes, not 2: random streams restart from the seed" in warnings
    second = _training_objects(tmp_path / 'second', TrainState(), DistInfo(rank=1, world_size=2, local_rank=1,
                                                                          device=torch.device('cpu')))
    warnings.clear()
    logging.getLogger('engine').addHandler(handler)
    try:
        second.restore(stored, saved.last_path, batches_per_epoch=3)
    finally:
        logging.getLogger('engine').removeHandler(handler)
    assert not [w for w in warnings if 'random streams restart' in w]  # said once, by the first process

    # an epoch saved after its training, before its validation, stays at that epoch, fully trained, under any split
    saved.save(train_record=dict(train_loss=1.5, lr=1e-3, epoch_seconds=2.0, images_per_second=4.0))
    trained = TrainingCheckpoint.read(saved.last_path)
    TrainingCheckpoint.check_resumable(trained, saved.last_path, batch_size=7, accumulation=3, world_size=2)
    validating = _training_objects(tmp_path / 'validating', TrainState())
    validating.restore(trained, saved.last_path, batches_per_epoch=9)
    assert (validating.state.epoch, validating.state.epoch_batches, validating.state.step) == (1, 9, 8)


def test_a_run_shorter_than_its_warm_up_says_so(tmp_path, digits, capsys):
    """Warm-up inside TRAIN.EPOCHS (no WARMUP_PREFIX) as long as the run: the learning rate never reaches its base,
    which the run used to do in silence."""
    code, out, err = _run(train_main, ['--cfg', TINY, '--data-path', str(digits), '--output', str(tmp_path / 'run'),
                                       '--opts', 'TRAIN.EPOCHS', '1', 'TRAIN.WARMUP_EPOCHS', '1'], capsys)
    assert code == 0, err
    assert ("TRAIN.WARMUP_EPOCHS 1 >= TRAIN.EPOCHS 1: the learning rate stays in its warm-up for the whole run, below "
            "TRAIN.BASE_LR") in out + err
    record = json.loads((tmp_path / 'run' / 'log.jsonl').read_text().splitlines()[-1])
    assert record['lr'] < load_config(TINY).TRAIN.BASE_LR


def test_a_minimum_learning_rate_above_the_peak_says_so(tmp_path, digits, capsys):
    """DeiT's recipe scales BASE_LR by the total batch / 512 and keeps MIN_LR: at a small batch the cosine schedule
    rose from its peak to MIN_LR, which the run did in silence."""
    cfg = load_config(TINY)
    batch = cfg.DATA.BATCH_SIZE
    code, out, err = _run(train_main, ['--cfg', TINY, '--data-path', str(digits), '--output', str(tmp_path / 'run'),
                                       '--opts', 'TRAIN.EPOCHS', '1', 'TRAIN.MIN_LR', '0.5'], capsys)
    assert code == 0, err
    peak = cfg.TRAIN.BASE_LR * batch / 512 if cfg.TRAIN.LR_SCALING != 'none' else cfg.TRAIN.BASE_LR
    assert (f"TRAIN.MIN_LR 5.000e-01 is above the learning rate {peak:.3e} (TRAIN.BASE_LR {cfg.TRAIN.BASE_LR:g} at "
            f"total batch {batch}, TRAIN.LR_SCALING {cfg.TRAIN.LR_SCALING}): the schedule rises to it instead of "
            f"decaying") in out + err


def test_a_training_checkpoint_missing_keys_fails_with_one_line(tmp_path):
    saved = _training_objects(tmp_path, TrainState())
    saved.save()
    partial = torch.load(saved.last_path, weights_only=True)
    del partial['scaler'], partial['rng']
    path = str(tmp_path / 'partial.pth')
    torch.save(partial, path)
    with pytest.raises(CheckpointError) as error:
        TrainingCheckpoint.read(path)
    assert str(error.value) == (f"checkpoint {path!r} is not a training checkpoint of this engine: it lacks scaler, "
                                f"rng; expected a last.pth that train.py wrote (to start from the weights of another "
                                f"file: --pretrained {path})")
    torch.save([partial], path)
    with pytest.raises(CheckpointError, match=r"holds a list, not a training checkpoint$"):
        TrainingCheckpoint.read(path)


@pytest.mark.parametrize('change, message', [
    (dict(epoch='3'), "epoch is '3'; expected an integer >= 0"),
    (dict(step=-1), "step is -1; expected an integer >= 0"),
    (dict(rng=[]), "rng is []; expected a list of random states, one per process"),
    (dict(optimizer={'state': {}, 'param_groups': []}),
     "optimizer is a mapping with the keys state, param_groups; expected an optimizer state dict: 'state' and a "
     "non-empty list of 'param_groups'"),
    (dict(model={'weight': 'w'}), "model is a mapping with the keys weight; expected a state dict of tensors"),
    (dict(world_size=2), "rng holds 1 random state(s) but world_size is 2; expected one per process"),
])
def test_a_malformed_training_checkpoint_field_fails_with_one_line(tmp_path, change, message):
    saved = _training_objects(tmp_path, TrainState())
    saved.save()
    stored = torch.load(saved.last_path, weights_only=True)
    stored.update(change)
    path = str(tmp_path / 'malformed.pth')
    torch.save(stored, path)
    with pytest.raises(CheckpointError) as error:
        TrainingCheckpoint.read(path)
    assert str(error.value) == f"checkpoint {path!r} is malformed: {message}"


def test_a_stored_state_the_live_objects_refuse_fails_with_one_line(tmp_path):
    saved = _training_objects(tmp_path / 'saved', TrainState())
    saved.save()
    stored = TrainingCheckpoint.read(saved.last_path)
    stored['optimizer']['param_groups'].append(dict(stored['optimizer']['param_groups'][0], params=[7]))
    with pytest.raises(CheckpointError) as error:
        _training_objects(tmp_path / 'restored', TrainState()).restore(stored, 'two_groups.pth', 5)
    assert str(error.value) == ("checkpoint 'two_groups.pth' has an optimizer state that this run cannot load "
                                "(ValueError: loaded state dict has a different number of parameter groups); "
                                "expected one of the same model and TRAIN.OPTIMIZER.NAME, with "
                                "TRAIN.BACKBONE_LR_SCALE 1 in both runs or in neither")
    stored = TrainingCheckpoint.read(saved.last_path)
    del stored['rng'][0]['torch']
    with pytest.raises(CheckpointError) as error:
        _training_objects(tmp_path / 'restored', TrainState()).restore(stored, 'no_torch_rng.pth', 5)
    assert str(error.value) == ("checkpoint 'no_torch_rng.pth' has a random state that this run cannot load "
                                "(KeyError: 'torch'); expected the states of torch, CUDA, NumPy and random that this "
                                "engine saves")


def test_a_file_that_is_no_checkpoint_is_named_so_before_unpickling(tmp_path):
    image = tmp_path / 'digit.png'
    Image.new('L', (8, 8)).save(image)
    with pytest.raises(CheckpointError) as error:
        read_weights(str(image))
    assert str(error.value) == (f"{str(image)!r} is not a checkpoint: it starts with b'\\x89PNG\\r\\n\\x1a\\n'; "
                                f"expected a file written by torch.save (a zip archive or a pickle) or a safetensors "
                                f"file")
    empty = tmp_path / 'empty.pth'
    empty.write_bytes(b'')
    with pytest.raises(CheckpointError, match=r"empty.pth' is not a checkpoint: it is empty; expected"):
        TrainingCheckpoint.read(str(empty))
    # a real checkpoint holding an object outside the allow-list: refused without torch's advice to load it anyway
    dated = tmp_path / 'dated.pth'
    torch.save({'model': {'w': torch.ones(1)}, 'date': datetime.date(2020, 1, 1)}, dated)
    with pytest.raises(CheckpointError) as error:
        read_weights(str(dated))
    assert str(error.value) == (f"checkpoint {str(dated)!r} is refused: it pickles objects outside the allow-list of "
                                f"tensors and plain containers (Unsupported global: GLOBAL datetime.date was not an "
                                f"allowed global by default); nothing of it ran")


def _tiny_checkpoint(tmp_path, cfg, num_classes=10, official=False) -> str:
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.NUM_CLASSES = num_classes
    state = create_model(cfg).state_dict()
    path = tmp_path / f'tiny{num_classes}{"_official" if official else ""}.pth'
    if official:  # an InLine/FLatten training file: weights under 'model', the yacs config pickled
        torch.save({'model': state, 'config': CfgNode({'MODEL': {'TYPE': 'x'}}), 'epoch': 300}, path)
    else:
        torch.save({'model': state}, path)
    return str(path)


def _run(main, argv, capsys):
    code = run_cli(main, argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# `--model inline_deit_tiny` shrunk to the architecture and preprocessing of the tiny demo config
TINY_MODEL_OPTS = [item for key, value in load_config(TINY).MODEL.KWARGS.items()
                   for item in (f'MODEL.KWARGS.{key}', str(value))] + ['DATA.IMG_SIZE', '16', 'TEST.CROP_PCT', '1.0']


def test_command_line_errors_are_one_line_with_exit_status_2(tmp_path, digits, tiny_cfg, capsys):
    only_train = tmp_path / 'only_train'
    (only_train / 'train' / 'a').mkdir(parents=True)
    empty = tmp_path / 'empty'
    empty.mkdir()
    image = tmp_path / 'digit.png'
    Image.new('L', (8, 8)).save(image)
    malformed = tmp_path / 'malformed.pth'
    saved = _training_objects(tmp_path, TrainState())
    saved.save()
    torch.save(dict(torch.load(saved.last_path, weights_only=True), epoch='1'), malformed)
    latin1 = tmp_path / 'latin1.yaml'
    latin1.write_bytes(f'BASE: [{TINY}]\nTRAIN:\n  EPOCHS: 3  # résumé\n'.encode('latin-1'))
    base = ['--cfg', TINY, '--output', str(tmp_path / 'out')]
    deit = ['--cfg', str(REPO / 'configs' / 'base' / 'deit.yaml'), '--output', str(tmp_path / 'out')]
    cases = [
        (train_main, base + ['--opts', 'MODEL.NAME', 'inline_deit_tny', 'DATA.DATA_PATH', str(digits)],
         "unknown model 'inline_deit_tny'"),
        (train_main, base + ['--opts', 'TRAIN.EPOCHZ', '3'], 'unknown config key TRAIN.EPOCHZ'),
        (train_main, base + ['--opts', 'TRAIN.EPOCHS', 'two'], "TRAIN.EPOCHS expects an integer"),
        (train_main, deit + ['--data-path', str(tmp_path / 'nope')], 'does not exist'),
        (train_main, deit, 'no dataset given'),
        (train_main, deit + ['--data-path', str(only_train)], "has no val/ folder"),
        (train_main, deit + ['--data-path', str(empty)], "has no train/ folder"),
        (train_main, base + ['--opts', 'MODEL.NUM_CLASSES', '5', 'DATA.DATA_PATH', str(digits)],
         'has 10 class folders but the model has 5 classes'),
        (eval_main, ['--cfg', TINY, '--checkpoint', str(tmp_path / 'missing.pth')],
         f"--checkpoint {str(tmp_path / 'missing.pth')!r} does not exist or is not a file; expected a checkpoint"),
        (train_main, base + ['--resume', str(tmp_path / 'missing.pth'), '--data-path', str(digits)],
         f"MODEL.RESUME {str(tmp_path / 'missing.pth')!r} (--resume) does not exist or is not a file; expected a "
         f"training checkpoint"),
        (eval_main, ['--cfg', TINY, '--checkpoint', _tiny_checkpoint(tmp_path, tiny_cfg, 7), '--data-path',
                     str(digits)], 'has a 7-class classifier but MODEL.NUM_CLASSES is 10'),
        (eval_main, ['--model', 'inline_deit_tiny', '--checkpoint', _tiny_checkpoint(tmp_path, tiny_cfg, 7),
                     '--data-path', str(digits), '--opts'] + TINY_MODEL_OPTS,
         'is for 7 classes but'),
        (eval_main, ['--model', 'inline_deit_tiny', '--checkpoint', _tiny_checkpoint(tmp_path, tiny_cfg, 0),
                     '--data-path', str(digits), '--opts'] + TINY_MODEL_OPTS,
         "holds no classifier (head.weight); expected the weights of a model that classifies"),
        (eval_main, ['--checkpoint', _tiny_checkpoint(tmp_path, tiny_cfg)], 'stores no config of this engine'),
        (eval_main, ['--cfg', TINY, '--checkpoint', str(image), '--data-path', str(digits)],
         f"{str(image)!r} is not a checkpoint: it starts with b'\\x89PNG"),
        (train_main, base + ['--resume', str(image), '--data-path', str(digits)], 'is not a checkpoint'),
        (train_main, base + ['--resume', str(malformed), '--data-path', str(digits)],
         "is malformed: epoch is '1'; expected an integer >= 0"),
        (train_main, ['--cfg', str(latin1), '--output', str(tmp_path / 'out')], 'is not UTF-8 text: byte 0xe9 on '
                                                                              'line 3'),
    ]
    for main, argv, expected in cases:
        code, out, err = _run(main, argv, capsys)
        assert code == USAGE_EXIT_CODE, (argv, err)
        assert err.startswith('error: ') and err.count('\n') == 1 and expected in err, (argv, err)
        assert 'Traceback' not in err + out
    with pytest.raises(UsageError):
        run_cli(train_main, base + ['--debug', '--opts', 'MODEL.NAME', 'nope', 'DATA.DATA_PATH', str(digits)])


def test_a_checkpoint_of_another_model_of_the_same_shapes_is_refused_by_name(tmp_path, digits, tiny_cfg, capsys):
    """Linear attention's weights have softmax's shapes: `eval.py --model softmax_deit_tiny --checkpoint` (or `--cfg`
    of a softmax model) of a linear run loaded them without a word and evaluated them in softmax attention. The
    checkpoint's config names the model it was trained as; the same model, and the checkpoint alone, evaluate, and
    so do keywords that change no weight (stochastic depth, dropout)."""
    cfg = tiny_cfg.clone()
    cfg.defrost()
    cfg.MODEL.NAME = 'linear_deit_tiny'
    cfg.MODEL.KWARGS.drop_path_rate = 0.1
    path = tmp_path / 'linear.pth'
    torch.save({'model': create_model(cfg).state_dict(), 'config': cfg.dump()}, path)
    argv = ['--checkpoint', str(path), '--data-path', str(digits)]
    refusal = (f"error: checkpoint {str(path)!r} was trained as another model: MODEL.NAME 'linear_deit_tiny' (this "
               f"run: 'softmax_deit_tiny'); expected the checkpoint alone (its stored config builds its model), or a "
               f"model name or config and MODEL.KWARGS that build the same\n")
    code, _, err = _run(eval_main, ['--model', 'softmax_deit_tiny', *argv, '--opts', *TINY_MODEL_OPTS], capsys)
    assert (code, err) == (USAGE_EXIT_CODE, refusal)
    code, _, err = _run(eval_main, ['--cfg', TINY, *argv, '--opts', 'MODEL.NAME', 'softmax_deit_tiny'], capsys)
    assert code == USAGE_EXIT_CODE and err.startswith(refusal.split(' (this run')[0]), err
    without_depth = [item for pair in zip(TINY_MODEL_OPTS[::2], TINY_MODEL_OPTS[1::2])
                     if pair[0] != 'MODEL.KWARGS.depth' for item in pair]
    code, _, err = _run(eval_main, ['--model', 'linear_deit_tiny', *argv, '--opts', *without_depth], capsys)
    assert code == USAGE_EXIT_CODE and "MODEL.KWARGS.depth 2 (this run: unset)" in err, err
    # the same attentions however spelled: an explicit attn_type (a list of one name), img_size, in_chans
    spelled = ['MODEL.KWARGS.attn_type', "['linear']", 'MODEL.KWARGS.img_size', '16', 'MODEL.KWARGS.in_chans', '3']
    for given in (['--model', 'linear_deit_tiny', *argv, '--opts', *TINY_MODEL_OPTS], argv,
                  ['--cfg', TINY, *argv, '--opts', 'MODEL.NAME', 'linear_deit_tiny'],
                  ['--cfg', TINY, *argv, '--opts', 'MODEL.NAME', 'linear_deit_tiny', *spelled]):
        code, out, err = _run(eval_main, given, capsys)
        assert code == 0, err
        assert json.loads(out.splitlines()[-1])['count'] == 360
        assert out.splitlines()[0].startswith('linear_deit_tiny with MODEL.KWARGS {')  # the human line


HEADS_LEFT_SPLIT = """
import torch.nn.functional as F
from models.attention import Mixer, register_attention
from models.attention.layout import split_heads


@register_attention('heads_left_split')
class HeadsLeftSplit(Mixer):
    forms_scores = reduces_keys = True

    def forward(self, q, k, v, ctx):
        h = self.num_heads
        return F.scaled_dot_product_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h))
"""


def test_an_attention_of_ones_own_returning_another_shape_stops_training_in_one_line(tmp_path, digits):
    """It was a 66-line traceback ending in the projection's "mat1 and mat2 shapes cannot be multiplied"."""
    (tmp_path / 'heads_left_split.py').write_text(HEADS_LEFT_SPLIT)
    run = subprocess.run([sys.executable, str(REPO / 'train.py'), '--cfg', TINY, '--output', str(tmp_path / 'out'),
                          '--data-path', str(digits), '--opts', 'MODEL.IMPORTS', "['heads_left_split']",
                          'MODEL.KWARGS.attn_type', 'heads_left_split'],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    message = ("error: attention 'heads_left_split': HeadsLeftSplit.forward returned shape (16, 4, 17, 16) for queries "
               "of shape (16, 17, 64); expected the queries' shape (B', n, C), heads merged back "
               "(models.attention.layout.merge_heads)")
    assert (run.returncode, run.stderr.splitlines()[-1]) == (USAGE_EXIT_CODE, message), run.stderr[-2000:]
    assert 'Traceback' not in run.stderr and message in (tmp_path / 'out' / 'train.log').read_text()


UNKNOWN_TAG = ("unknown pretrained tag 'in22k' of 'inline_deit_tiny'; expected inline_deit_tiny.in1k, or the name "
               "without a tag")


@pytest.mark.parametrize('entry', ['train MODEL.NAME', 'train --pretrained', 'eval --model'])
def test_an_unknown_pretrained_tag_is_one_line_before_any_data_is_read(tmp_path, capsys, monkeypatch, entry):
    monkeypatch.setattr(engine.hub, 'start_weights_file', lambda source: pytest.fail('downloaded'))
    data = tmp_path / 'digits'
    train = ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH', str(data)]
    argv = {'train MODEL.NAME': (train_main, train + ['MODEL.NAME', 'inline_deit_tiny.in22k']),
            'train --pretrained': (train_main, ['--pretrained', 'inline_deit_tiny.in22k'] + train),
            'eval --model': (eval_main, ['--model', 'inline_deit_tiny.in22k', '--data-path', str(data)])}[entry]
    code, _, err = _run(*argv, capsys)
    pretrained = entry == 'train --pretrained'
    message = f"MODEL.PRETRAINED 'inline_deit_tiny.in22k': {UNKNOWN_TAG}" if pretrained else UNKNOWN_TAG
    assert (code, err) == (USAGE_EXIT_CODE, f"error: {message}\n")
    assert not data.exists() and not (tmp_path / 'out').exists()


@pytest.mark.parametrize('content, problem', [(b'not weights\n', 'is not a checkpoint'),
                                               (b'PK\x03\x04cut', 'truncated or corrupt')])
def test_a_pretrained_file_that_holds_no_weights_is_one_line_before_any_data_is_read(tmp_path, capsys, content,
                                                                                    problem):
    """A text file or a cut one given to start from was found out after the training and validation folders were
    scanned (minutes on ImageNet), and left behind an output folder with an empty train.log."""
    weights = tmp_path / 'weights.pth'
    weights.write_bytes(content)
    data = tmp_path / 'digits'  # the digits demo would write its data here first
    code, _, err = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--pretrained', str(weights),
                                     '--opts', 'DATA.DATA_PATH', str(data)], capsys)
    assert code == USAGE_EXIT_CODE and str(weights) in err and problem in err, err
    assert err.count('\n') == 1
    assert not data.exists() and not (tmp_path / 'out').exists()


def test_released_weights_of_an_unknown_tag_are_a_checkpoint_error():
    with pytest.raises(CheckpointError, match=f"^{re.escape(UNKNOWN_TAG)}$"):
        released_weights_file('inline_deit_tiny.in22k')
    assert not has_released_weights('inline_deit_tiny.in22k') and has_released_weights('inline_deit_tiny.in1k')


@pytest.mark.parametrize('opts, embed_dim, img_size, problem', [
    (['MODEL.KWARGS.embed_dim', '-8'], -8, 16, 'embed_dim -8 is out of range; expected an integer > 0'),
    (['DATA.IMG_SIZE', '30'], 64, 30, 'img_size 30x30 must have sides that are positive multiples of 4'),
])
def test_a_model_setting_out_of_range_is_named_by_its_config_key_before_any_data_is_read(tmp_path, capsys, opts,
                                                                                        embed_dim, img_size, problem):
    """The error listed MODEL.KWARGS alone, where DATA.IMG_SIZE, which the model takes as img_size, was the bad
    value."""
    data = tmp_path / 'digits'  # the digits demo would write its data here first
    code, _, err = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH',
                                     str(data), *opts], capsys)
    assert code == USAGE_EXIT_CODE
    assert err == (f"error: cannot build model 'inline_deit_tiny' from MODEL.NUM_CLASSES 10, DATA.IMG_SIZE "
                   f"{img_size}, MODEL.DROP_PATH_RATE 0.0, MODEL.KWARGS.patch_size 4, MODEL.KWARGS.embed_dim "
                   f"{embed_dim}, MODEL.KWARGS.depth 2, MODEL.KWARGS.num_heads 4: {problem}\n")
    assert not data.exists() and not (tmp_path / 'out').exists()


def test_a_model_too_large_for_memory_is_named_by_its_settings(tmp_path, capsys):
    """torch's allocator refused the position embedding of DATA.IMG_SIZE 8000000 (1 PB, beyond any address space)
    with a traceback and exit status 1. The output folder keeps the run's log, which says why, and no lock."""
    data = tmp_path / 'digits'
    code, _, err = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH',
                                     str(data), 'DATA.IMG_SIZE', '8000000'], capsys)
    assert code == USAGE_EXIT_CODE
    assert err == ("error: cannot build model 'inline_deit_tiny' from MODEL.NUM_CLASSES 10, DATA.IMG_SIZE 8000000, "
                   "MODEL.DROP_PATH_RATE 0.0, MODEL.KWARGS.patch_size 4, MODEL.KWARGS.embed_dim 64, "
                   "MODEL.KWARGS.depth 2, MODEL.KWARGS.num_heads 4: not enough memory for its parameters (one tensor "
                   "needs 953674.3 GiB); expected settings of a model that fits\n")
    assert [p.name for p in (tmp_path / 'out').iterdir()] == ['train.log']
    assert err[:-1] in (tmp_path / 'out' / 'train.log').read_text()


@pytest.mark.parametrize('attn_type, refusal', [
    ('cosine', ": bad attn_type 'cosine' (not a name or pattern); expected an attention name ("),
    ("['cosine']", ": unknown attention 'cosine'; expected one of softmax, multimax, "),
])
def test_an_attention_not_registered_points_at_model_imports(tmp_path, capsys, attn_type, refusal):
    """An attention of the user's own, named before its module is imported (as a local-dir: model saved with it
    is), was refused as a bad name or pattern without the way to register it; named in a list, without the hint."""
    code, _, err = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH',
                                     str(tmp_path / 'digits'), 'MODEL.KWARGS.attn_type', attn_type], capsys)
    assert code == USAGE_EXIT_CODE and err.count('\n') == 1
    assert refusal in err
    assert err.endswith("; an attention of your own is registered by importing its module first: --opts "
                        "MODEL.IMPORTS \"['your_module']\"\n")


def test_a_misspelled_attention_and_a_module_that_registers_none_are_named(tmp_path, capsys, monkeypatch):
    """A misspelled name had no "did you mean" (model names and attn_kwargs had), and a module of MODEL.IMPORTS that
    registers nothing was answered with the advice to import a module through MODEL.IMPORTS."""
    argv = ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH', str(tmp_path / 'digits')]
    code, _, err = _run(train_main, argv + ['MODEL.KWARGS.attn_type', 'softmx'], capsys)
    assert code == USAGE_EXIT_CODE and ": bad attn_type 'softmx' (not a name or pattern; did you mean 'softmax'?); " \
        "expected an attention name (" in err and err.endswith("e.g. 'IIMS2'\n")  # no advice to register it
    code, _, err = _run(train_main, argv + ['MODEL.KWARGS.attn_type', "['sima_']"], capsys)
    assert code == USAGE_EXIT_CODE and ": unknown attention 'sima_' (did you mean 'sima'?); expected one of " in err
    (tmp_path / 'registers_nothing.py').write_text('CONSTANT = 1\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _run(train_main, argv + ['MODEL.IMPORTS', "['registers_nothing']", 'MODEL.KWARGS.attn_type',
                                            'cosine'], capsys)
    assert code == USAGE_EXIT_CODE and err.endswith(
        "; the modules of MODEL.IMPORTS ['registers_nothing'] register no attention 'cosine': expected "
        "@register_attention('cosine') on its mixer class\n")


GREY_NEEDS_ONE_MEAN = ("error: config key DATA.MEAN holds 3 values but the model takes 1 channel "
                       "(MODEL.KWARGS.in_chans 1); expected one mean and one std per channel, e.g. DATA.MEAN [0.5] "
                       "DATA.STD [0.5] for grey-scale images\n")


@pytest.mark.parametrize('opts, message', [
    (['MODEL.KWARGS.in_chans', '1'], GREY_NEEDS_ONE_MEAN),
    (['MODEL.KWARGS.in_chans', '2', 'DATA.MEAN', '[0.5, 0.5]', 'DATA.STD', '[0.5, 0.5]'],
     "error: config key DATA.MEAN is [0.5, 0.5]; expected one or three finite numbers\n"),
    (['MODEL.KWARGS.in_chans', '4'], "error: config key MODEL.KWARGS.in_chans is 4; expected 1 (grey-scale images, "
                                     "read as 'L') or 3 (RGB)\n"),
])
def test_a_channel_count_the_data_cannot_feed_fails_before_any_data_is_read(tmp_path, capsys, opts, message):
    """in_chans=1 with the RGB normalisation met (B, 3, H, W) batches at the first forward, as a shape traceback; it
    is refused with the config, as any count other than grey-scale's and RGB's."""
    data = tmp_path / 'digits'
    code, _, err = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--opts', 'DATA.DATA_PATH',
                                     str(data), *opts], capsys)
    assert (code, err) == (USAGE_EXIT_CODE, message)
    assert not data.exists() and not (tmp_path / 'out').exists()


@pytest.mark.parametrize('main, argv', [
    (train_main, ['--cfg', TINY, '--opts', 'TRAIN.EPOCHS', '1', '--output', 'out']),
    (train_main, ['--cfg', TINY, '--opts', 'TRAIN.EPOCHS', '1', '--amp']),
    (eval_main, ['--cfg', TINY, '--throughput', '--opts', 'DATA.IMG_SIZE', '16', '--amp', 'TEST.CROP_PCT', '1.0']),
    (eval_main, ['--cfg', TINY, '--opts', 'DATA.IMG_SIZE', '16', '--checkpoint', 'best.pth']),
])
def test_an_option_given_after_opts_is_named_with_where_it_goes(tmp_path, monkeypatch, capsys, main, argv):
    """--opts takes the rest of the command line: an option after it is said to belong before it, whether the
    items are even (an unknown key otherwise) or odd in number, and where argparse would call it missing."""
    monkeypatch.chdir(tmp_path)
    option = next(item for item in argv if item.startswith('--') and argv.index(item) > argv.index('--opts'))
    assert _run(main, argv, capsys) == (USAGE_EXIT_CODE, '', f"error: --opts takes KEY VALUE pairs up to the end of "
                                                             f"the command, got the option {option} among them; "
                                                             f"expected {option} before --opts\n")
    assert not list(tmp_path.iterdir())


def test_eval_refuses_a_model_it_cannot_build_before_downloading(monkeypatch, capsys):
    monkeypatch.setattr(engine.hub, 'start_weights_file', lambda source: pytest.fail('downloaded'))
    code, _, err = _run(eval_main, ['--model', 'inline_deit_tiny', '--opts', 'MODEL.KWARGS.in_chans', '1'], capsys)
    assert (code, err) == (USAGE_EXIT_CODE, GREY_NEEDS_ONE_MEAN)


@pytest.mark.parametrize('data, message', [
    ([], "error: no dataset given; expected --data-path DIR (an ImageNet-style folder with train/ and val/) or "
         "DATA.DATASET 'digits'\n"),
    (['--data-path', 'nope'], "error: data path 'nope' does not exist; expected a folder with val inside\n"),
    (['--data-path', str(REPO / 'README.md')],
     f"error: data path {str(REPO / 'README.md')!r} is a file; expected a folder with val inside\n"),
])
def test_eval_refuses_missing_data_before_downloading_the_released_weights(monkeypatch, capsys, data, message):
    monkeypatch.setattr(engine.hub, 'start_weights_file', lambda source: pytest.fail('downloaded'))
    code, _, err = _run(eval_main, ['--model', 'inline_deit_tiny', *data], capsys)
    assert (code, err) == (USAGE_EXIT_CODE, message)


@pytest.mark.parametrize('entry', ['eval --model', 'train --pretrained'])
def test_a_flat_validation_folder_is_named_before_the_released_weights_are_downloaded(tmp_path, monkeypatch, capsys,
                                                                                       entry):
    """ImageNet's validation archive unpacks without class folders: one listing finds it before a download that
    can take minutes."""
    monkeypatch.setattr(engine.hub, 'start_weights_file', lambda source: pytest.fail('downloaded'))
    for split, folder in (('train', 'train/a'), ('train', 'train/b'), ('val', 'val')):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        Image.new('RGB', (16, 16)).save(tmp_path / folder / f'{split}_0.JPEG')
    argv = {'eval --model': (eval_main, ['--model', 'inline_deit_tiny', '--data-path', str(tmp_path)]),
            'train --pretrained': (train_main, ['--cfg', TINY, '--pretrained', 'inline_deit_tiny', '--data-path',
                                                str(tmp_path), '--output', str(tmp_path / 'out'), '--opts',
                                                'DATA.DATASET', 'imagefolder', 'MODEL.NUM_CLASSES', '2'])}[entry]
    assert _run(*argv, capsys) == (USAGE_EXIT_CODE, '', f"error: dataset folder '{tmp_path / 'val'}' holds 1 image "
                                                        f"files but no class folders; expected {tmp_path / 'val'}/"
                                                        f"<class>/<images> (sort a flat split into its class folders "
                                                        f"first)\n")
    assert not (tmp_path / 'out').exists()


GREY = ['MODEL.KWARGS.in_chans', '1', 'DATA.MEAN', '[0.5]', 'DATA.STD', '[0.5]']


def test_grey_scale_images_train_and_evaluate_a_one_channel_model(tmp_path, digits, capsys, caplog):
    """With in_chans 1 and one mean and std, images are read as 'L' (the digits are grey already) and the whole
    recipe (RandAugment, erasing, mixup) runs on one channel; the checkpoint evaluates and draws the same way."""
    cfg = load_config(TINY, ['DATA.DATA_PATH', str(digits), *GREY, 'AUG.AUTO_AUGMENT', 'rand-m9-mstd0.5-inc1',
                             'AUG.REPROB', '0.25', 'AUG.MIXUP', '0.8', 'AUG.CUTMIX', '1.0'])
    dataset = load_split(str(digits), 'train', engine.data.train_transform(cfg), image_mode=image_mode(cfg))
    images = torch.stack([dataset[i][0] for i in range(4)])
    assert images.shape == (4, 1, 16, 16)
    plain = load_split(str(digits), 'train', eval_transform(cfg), image_mode='L')[0][0]
    resized = np.asarray(Image.open(dataset.samples[0][0]).convert('L').resize((16, 16), Image.Resampling.BICUBIC))
    torch.testing.assert_close(plain[0], (torch.from_numpy(resized / 255).float() - 0.5) / 0.5, atol=2e-2, rtol=0)
    output = tmp_path / 'out'
    code, _, err = _run(train_main, ['--cfg', TINY, '--output', str(output), '--opts', 'DATA.DATA_PATH', str(digits),
                                     *GREY, 'TRAIN.EPOCHS', '1', 'DATA.BATCH_SIZE', '128', 'AUG.AUTO_AUGMENT',
                                     'rand-m9-mstd0.5-inc1', 'AUG.REPROB', '0.25', 'AUG.MIXUP', '0.8'], capsys)
    assert code == 0, err
    weights = torch.load(output / 'best.pth', weights_only=True)['model']
    assert weights['patch_embed.proj.weight'].shape[1] == 1
    caplog.clear()
    code, out, err = _run(eval_main, ['--checkpoint', str(output / 'best.pth')], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])['count'] == 360
    # timm's loader took the weights for three-channel ones and warned that their stem 'already matches'
    assert not [record for record in caplog.records if 'already match' in record.getMessage()]
    code, out, err = _run(eval_main, ['--checkpoint', str(output / 'best.pth'), '--throughput', '--batch-size', '2',
                                      '--warmup-forwards', '0', '--timed-forwards', '1'], capsys)
    assert code == 0, err  # timed on one-channel images (three before: a traceback)
    assert json.loads(out.strip().splitlines()[-1])['batch_size'] == 2
    # RGB weights start it as timm adapts them: the first convolution summed over the colour channels
    rgb = _tiny_checkpoint(tmp_path, load_config(TINY, ['DATA.DATA_PATH', str(digits)]))
    code, out, err = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'from_rgb'), '--pretrained', rgb,
                                       '--opts', 'DATA.DATA_PATH', str(digits), *GREY, 'TRAIN.EPOCHS', '1',
                                       'DATA.BATCH_SIZE', '128'], capsys)
    assert code == 0, err
    assert (f"{rgb}: adapted patch_embed.proj.weight to 1 input channel(s), summed over the weights' 3") in out
    inputs, shown = engine.analysis.load_images([dataset.samples[0][0]], load_config(
        None, ['DATA.DATA_PATH', str(digits), *GREY, 'DATA.IMG_SIZE', '16', 'TEST.CROP_PCT', '1.0']))
    assert inputs.shape == (1, 1, 16, 16) and shown[0].shape == (16, 16, 3)


def test_analysis_images_that_cannot_be_read_are_one_line(tmp_path, digits):
    cfg = load_config(TINY, ['DATA.DATA_PATH', str(digits)])
    (tmp_path / 'empty.png').write_bytes(b'')
    (tmp_path / 'cut.png').write_bytes(next((digits / 'val' / '0').iterdir()).read_bytes()[:60])
    (tmp_path / 'text.png').write_text('not an image')
    for name, reason in (('empty.png', 'is empty (0 bytes)'), ('cut.png', 'cannot be decoded (OSError: '),
                         ('text.png', 'is not an image (Pillow cannot identify its format)')):
        with pytest.raises(UsageError) as raised:
            engine.analysis.load_images([str(tmp_path / name)], cfg)
        message = str(raised.value)
        assert message.startswith(f"image {str(tmp_path / name)!r} {reason}") and '\n' not in message
        assert message.endswith('; expected an image that can be read')


def test_a_one_class_run_warns_that_top1_is_trivial(tmp_path, digits, capsys):
    data = tmp_path / 'one_class'
    for split in ('train', 'val'):
        shutil.copytree(digits / split / '0', data / split / '0')
    code, out, _ = _run(train_main, ['--cfg', TINY, '--output', str(tmp_path / 'out'), '--data-path', str(data),
                                     '--opts', 'DATA.DATASET', 'imagefolder', 'MODEL.NUM_CLASSES', '1', 'TRAIN.EPOCHS',
                                     '1', 'DATA.BATCH_SIZE', '32'], capsys)
    assert code == 0
    assert ("the dataset has 1 class (0): every prediction is that class, so top-1 is trivially 100 %; expected 2 or "
            "more classes for a meaningful accuracy") in out
    assert json.loads((tmp_path / 'out' / 'log.jsonl').read_text())['val_top1'] == 100.0


def test_corrupt_checkpoint_through_eval(tmp_path, digits, capsys):
    broken = tmp_path / 'broken.pth'
    broken.write_bytes(b'PK\x03\x04 not really a zip file')
    code, _, err = _run(eval_main, ['--cfg', TINY, '--checkpoint', str(broken), '--data-path', str(digits)], capsys)
    assert code == USAGE_EXIT_CODE and 'truncated or corrupt' in err and err.count('\n') == 1


def test_official_release_file_evaluates_like_the_same_weights_through_a_config(tmp_path, digits, tiny_cfg, capsys):
    official = _tiny_checkpoint(tmp_path, tiny_cfg, official=True)
    code, out, _ = _run(eval_main, ['--model', 'inline_deit_tiny', '--checkpoint', official, '--data-path',
                                    str(digits), '--opts'] + TINY_MODEL_OPTS, capsys)
    assert code == 0
    by_model = json.loads(out.strip().splitlines()[-1])
    code, out, _ = _run(eval_main, ['--cfg', TINY, '--checkpoint', official, '--data-path', str(digits)], capsys)
    assert code == 0
    by_cfg = json.loads(out.strip().splitlines()[-1])
    assert by_model['count'] == by_cfg['count'] == 360
    assert by_model['top1'] == by_cfg['top1'] and by_model['top5'] == by_cfg['top5']
    assert by_model['precision'] == 'float32'


def test_safetensors_weights_evaluate_and_start_training_like_the_same_torch_file(tmp_path, digits, tiny_cfg, capsys):
    """Weights as the hub keeps them (a flat state dict in safetensors) go wherever a torch file goes."""
    torch_file = _tiny_checkpoint(tmp_path, tiny_cfg)
    hub_file = tmp_path / 'model.safetensors'
    safetensors.torch.save_file(torch.load(torch_file, weights_only=True)['model'], str(hub_file))
    results = []
    for weights in (torch_file, str(hub_file)):
        code, out, err = _run(eval_main, ['--model', 'inline_deit_tiny', '--checkpoint', weights, '--data-path',
                                          str(digits), '--opts'] + TINY_MODEL_OPTS, capsys)
        assert code == 0, err
        results.append({k: v for k, v in json.loads(out.strip().splitlines()[-1]).items() if k != 'checkpoint'})
    assert results[0] == results[1] and results[0]['count'] == 360
    code, _, err = _run(train_main, ['--cfg', TINY, '--pretrained', str(hub_file), '--output', str(tmp_path / 'run'),
                                     '--data-path', str(digits), '--opts', 'TRAIN.EPOCHS', '1',
                                     'DATA.BATCH_SIZE', '128'], capsys)
    assert code == 0, err
    # a cut-off file is one line, as a cut-off torch file is
    hub_file.write_bytes(hub_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors' is truncated or corrupt \(SafetensorError: "):
        read_weights(str(hub_file))


# the tiny DeiT of TINY_MODEL_OPTS with SimA attention: a model that no registered name builds
HUB_MODEL = dict(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, num_classes=10)


def _saved_for_the_hub(folder: Path, **save) -> Path:
    torch.manual_seed(0)
    model = timm.create_model('softmax_deit_tiny', attn_type='sima', **HUB_MODEL)
    timm.models.save_for_hf(model, str(folder), **save)
    return folder


def _metrics(out: str) -> dict:
    result = json.loads(out.strip().splitlines()[-1])
    return {k: result[k] for k in ('top1', 'top5', 'loss', 'count')}


def test_a_model_saved_for_the_hub_evaluates_by_its_local_dir_name(tmp_path, digits, capsys):
    """`eval.py --model local-dir:FOLDER`: the architecture, its attention, input size and preprocessing come from
    the folder's config.json, the weights from its file; the same weights through the registered name with those
    settings given by hand give the same numbers, and without the attention other numbers."""
    folder = _saved_for_the_hub(tmp_path / 'saved')
    code, out, err = _run(eval_main, ['--model', f'local-dir:{folder}', '--data-path', str(digits),
                                      '--crop-pct', '1.0'], capsys)
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert (result['model'], result['img_size'], result['checkpoint']) == \
        ('softmax_deit_tiny', 16, str(folder / 'pytorch_model.bin'))
    assert result['model_kwargs']['attn_type'] == 'sima'  # the model name alone named softmax
    by_hand = ['--model', 'softmax_deit_tiny', '--checkpoint', str(folder / 'pytorch_model.bin'), '--data-path',
               str(digits), '--opts', *TINY_MODEL_OPTS]
    code, out, err = _run(eval_main, by_hand + ['MODEL.KWARGS.attn_type', 'sima'], capsys)
    assert code == 0, err
    assert _metrics(out) == _metrics(json.dumps(result)) and result['count'] == 360
    code, out, err = _run(eval_main, by_hand, capsys)
    assert code == 0, err
    assert _metrics(out)['loss'] != result['loss']


def test_a_hub_folder_with_weights_under_another_name_evaluates_and_starts_a_run(tmp_path, digits, capsys):
    """A folder whose weights file is not one save_for_hf names (`model.pth`, which timm's own loader reads) is
    evaluated with those weights and accepted as a training start, as `timm.create_model` accepts it."""
    saved = _saved_for_the_hub(tmp_path / 'saved')
    renamed = tmp_path / 'renamed'
    renamed.mkdir()
    shutil.copy(saved / 'config.json', renamed / 'config.json')
    shutil.copy(saved / 'pytorch_model.bin', renamed / 'model.pth')
    results = []
    for folder in (saved, renamed):
        code, out, err = _run(eval_main, ['--model', f'local-dir:{folder}', '--data-path', str(digits),
                                          '--crop-pct', '1.0'], capsys)
        assert code == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[1]['checkpoint'] == str(renamed / 'model.pth')
    assert _metrics(json.dumps(results[1])) == _metrics(json.dumps(results[0]))
    check_pretrained(f'local-dir:{renamed}')


def test_a_model_saved_for_the_hub_evaluates_by_its_hub_name(tmp_path, digits, capsys, monkeypatch):
    """`eval.py --model hf-hub:REPO`: config.json and model.safetensors come through timm's hub download (served
    here from a folder), and evaluate as the same folder does by its `local-dir:` name."""
    folder = _saved_for_the_hub(tmp_path / 'repo', safe_serialization=True)
    fetched = []

    def hub_download(repo_id, filename, revision=None, **kwargs):
        fetched.append((repo_id, filename, revision))
        if not (folder / filename).is_file():
            raise EntryNotFoundError(f'{filename} is not in {repo_id}')
        return str(folder / filename)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', hub_download)
    code, out, err = _run(eval_main, ['--model', 'hf-hub:lab/sima-deit-test@v1', '--data-path', str(digits),
                                      '--crop-pct', '1.0'], capsys)
    assert code == 0, err
    by_hub = json.loads(out.strip().splitlines()[-1])
    assert by_hub['checkpoint'] == str(folder / 'model.safetensors')
    assert fetched == [('lab/sima-deit-test', 'config.json', 'v1'), ('lab/sima-deit-test', 'model.safetensors', 'v1')]
    code, out, err = _run(eval_main, ['--model', f'local-dir:{folder}', '--data-path', str(digits),
                                      '--crop-pct', '1.0'], capsys)
    assert code == 0, err
    assert _metrics(out) == _metrics(json.dumps(by_hub))


def test_training_starts_from_a_model_saved_for_the_hub(tmp_path, digits, capsys, monkeypatch):
    """`train.py --pretrained local-dir:FOLDER` and `hf-hub:REPO` start from the saved weights, as the folder's
    weights file given by its path does; a start from scratch ends elsewhere."""
    torch.manual_seed(123)
    folder = tmp_path / 'saved'
    timm.models.save_for_hf(timm.create_model('inline_deit_tiny', **HUB_MODEL), str(folder), safe_serialization=True)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', lambda repo_id, filename, **kwargs: str(folder / filename))
    argv = ['--cfg', TINY, '--data-path', str(digits), '--opts', 'TRAIN.EPOCHS', '1', 'DATA.BATCH_SIZE', '128']
    starts = {'local': [f'local-dir:{folder}'], 'hub': ['hf-hub:lab/inline-deit-test'],
              'file': [str(folder / 'model.safetensors')], 'scratch': []}
    for output, start in starts.items():
        pretrained = ['--pretrained', *start] if start else []
        code, _, err = _run(train_main, [*pretrained, '--output', str(tmp_path / output), *argv], capsys)
        assert code == 0, err
    local, hub, file, scratch = (torch.load(tmp_path / output / 'last.pth', weights_only=True)['model']
                                 for output in starts)
    assert local.keys() == hub.keys() == file.keys()
    assert all(torch.equal(local[k], file[k]) and torch.equal(hub[k], file[k]) for k in file)
    assert not torch.equal(local['head.weight'], scratch['head.weight'])


def test_hub_names_that_cannot_be_evaluated_are_one_line_errors(tmp_path, digits, capsys, monkeypatch):
    no_weights = _saved_for_the_hub(tmp_path / 'no_weights')
    (no_weights / 'pytorch_model.bin').unlink()
    unknown = tmp_path / 'unknown'
    unknown.mkdir()
    (unknown / 'config.json').write_text(json.dumps({'architecture': 'sima_deit_tiyn', 'pretrained_cfg': {}}))
    broken = tmp_path / 'broken'
    broken.mkdir()
    (broken / 'config.json').write_text('{"architecture": ')
    wide = _saved_for_the_hub(tmp_path / 'wide')
    config = json.loads((wide / 'config.json').read_text())
    config['model_args']['img_size'] = [16, 32]
    (wide / 'config.json').write_text(json.dumps(config))

    def hub_download(repo_id, filename, **kwargs):
        if repo_id == 'lab/offline':
            raise LocalEntryNotFoundError('the file is not in the cache and outgoing traffic is disabled')
        if filename != 'config.json':
            raise EntryNotFoundError(f'{filename} is not in {repo_id}')
        return str(no_weights / filename)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', hub_download)
    data = ['--data-path', str(digits)]
    cases = {
        f'local-dir:{tmp_path / "missing"}': 'its config.json cannot be read (FileNotFoundError: ',
        f'local-dir:{no_weights}': 'the folder holds no weights; expected model.safetensors or pytorch_model.bin',
        f'local-dir:{unknown}': "unknown model 'sima_deit_tiyn'",
        f'local-dir:{broken}': 'its config.json cannot be read (JSONDecodeError: ',
        f'local-dir:{wide}': 'was built for 16x32 images; expected a square input size',
        'hf-hub:lab/empty': 'the repository holds no weights; expected model.safetensors or pytorch_model.bin',
        'hf-hub:lab/offline': 'its config.json cannot be read (LocalEntryNotFoundError: the file is not in the cache',
    }
    for name, expected in cases.items():
        code, _, err = _run(eval_main, ['--model', name, *data], capsys)
        assert code == USAGE_EXIT_CODE and expected in err and err.count('\n') == 1, (name, err)
        assert repr(name) in err, err


def test_timm_layout_weights_fine_tune_to_another_class_count(caplog):
    """timm's Swin weights (classifier `head.fc`) start a 10-class model as the official layout does: the class
    count is read under the official names, so the classifier is re-initialised, not loaded mis-shaped."""
    sizes = dict(embed_dim=16, depths=[2, 1, 1, 1], num_heads=[1, 2, 2, 2], window_size=4)
    torch.manual_seed(0)
    timm_weights = timm.create_model('swin_tiny_patch4_window7_224', img_size=32, **sizes).state_dict()
    opts = ['MODEL.NAME', 'softmax_swin_tiny', 'MODEL.NUM_CLASSES', '10', 'DATA.IMG_SIZE', '32']
    for key, value in sizes.items():
        opts += [f'MODEL.KWARGS.{key}', str(value)]
    with caplog.at_level(logging.INFO, logger='engine'):
        model = create_model(load_config(None, opts), timm_weights, source='timm.pth')
    assert model.head.weight.shape == (10, 128)
    assert "timm.pth: re-initialised the classifier for 10 classes (the weights have 1000)" in caplog.messages
    assert torch.equal(model.state_dict()['layers.0.downsample.reduction.weight'],
                       timm_weights['layers.1.downsample.reduction.weight'])


def test_a_convolutional_net_of_timm_trains_and_evaluates_at_the_config_s_image_size(tmp_path, digits, capsys):
    """A timm model without an `img_size` argument (a ResNet takes any input size) is built without it; the same
    keyword given in MODEL.KWARGS is still refused on one line."""
    cfg = tmp_path / 'resnet.yaml'
    cfg.write_text('DATA: {DATASET: digits, BATCH_SIZE: 64, IMG_SIZE: 16, NUM_WORKERS: 0}\n'
                   'MODEL: {NAME: test_resnet, NUM_CLASSES: 10, DROP_PATH_RATE: 0.0}\n'
                   'TRAIN: {EPOCHS: 1, WARMUP_EPOCHS: 0}\n'
                   'AUG: {AUTO_AUGMENT: "", REPROB: 0.0, MIXUP: 0.0, CUTMIX: 0.0, REPEATED_AUG: 1}\n')
    code, _, err = _run(train_main, ['--cfg', str(cfg), '--data-path', str(digits), '--output', str(tmp_path / 'run')],
                        capsys)
    assert code == 0, err
    logged = [json.loads(line) for line in (tmp_path / 'run' / 'log.jsonl').read_text().splitlines()]
    # the DeiT recipe validates under autocast (AMP.EVAL), as eval.py does with --amp
    code, out, err = _run(eval_main, ['--checkpoint', str(tmp_path / 'run' / 'last.pth'), '--data-path', str(digits),
                                      '--amp'], capsys)
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert (result['model'], result['img_size'], result['count']) == ('test_resnet', 16, 360)
    assert result['top1'] == pytest.approx(logged[-1]['val_top1'])
    code, _, err = _run(eval_main, ['--checkpoint', str(tmp_path / 'run' / 'last.pth'), '--data-path', str(digits),
                                    '--opts', 'MODEL.KWARGS.img_size', '16'], capsys)
    assert (code, err) == (USAGE_EXIT_CODE, "error: model 'test_resnet' does not accept the keyword 'img_size' "
                                            "(MODEL.KWARGS.img_size); expected the constructor's own argument names\n")


@pytest.mark.parametrize('name', ['caformer_s18', 'hrnet_w18_small', 'ese_vovnet19b_dw', 'volo_d4_448'])
def test_timm_architectures_build_from_their_own_evaluation_config(name):
    """timm models that refuse the engine's keywords in their own words ("unexpected keyword argument(s): [...]":
    MetaFormer, HRNet without img_size nor drop_path_rate, VoVNet) and VOLO's crop of 1.15 (padded, as timm pads
    it): each builds, as timm builds it, from the config of its name."""
    cfg = engine.evaluation.eval_config(None, name, None)
    assert cfg.TEST.CROP_PCT == timm.models.get_pretrained_cfg(name).crop_pct
    ours = create_model(cfg, device='meta')
    theirs = timm.create_model(name, device='meta')
    assert type(ours) is type(theirs)
    shapes = [[(k, v.shape) for k, v in model.state_dict().items()] for model in (ours, theirs)]
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize('name, classes', [('softmax_swin_tiny.ms_in22k', 21841), ('softmax_cswin_large.in22k', 21841),
                                           ('softmax_swin_tiny', 1000),
                                           ('vit_tiny_patch16_224.augreg_in21k', 21843)])
def test_a_model_name_evaluates_with_the_class_count_of_its_release(name, classes):
    """`eval.py --model NAME --throughput` times the released model, its classifier included."""
    assert engine.evaluation.eval_config(None, name, None).MODEL.NUM_CLASSES == classes


def test_a_timm_model_without_stochastic_depth_evaluates_and_trains_only_at_a_drop_path_rate_of_0(tmp_path, digits,
                                                                                                capsys):
    """DLA takes no `drop_path_rate`: evaluation (where stochastic depth is off) builds it whatever the config's
    rate; training refuses a non-zero MODEL.DROP_PATH_RATE on one line naming it, and trains at 0."""
    code, out, err = _run(eval_main, ['--model', 'dla46x_c', '--throughput', '--batch-size', '2', '--img-size', '32',
                                      '--warmup-forwards', '1', '--timed-forwards', '1'], capsys)
    assert code == 0, err
    cfg = tmp_path / 'dla.yaml'
    cfg.write_text('DATA: {DATASET: digits, BATCH_SIZE: 64, IMG_SIZE: 32, NUM_WORKERS: 0}\n'
                   'MODEL: {NAME: dla46x_c, NUM_CLASSES: 10}\n'
                   'TRAIN: {EPOCHS: 1, WARMUP_EPOCHS: 0}\n'
                   'AMP: {ENABLED: false}\n'
                   'AUG: {AUTO_AUGMENT: "", REPROB: 0.0, MIXUP: 0.0, CUTMIX: 0.0, REPEATED_AUG: 1}\n')
    argv = ['--cfg', str(cfg), '--data-path', str(digits), '--output', str(tmp_path / 'run')]
    code, _, err = _run(train_main, argv, capsys)
    assert (code, err) == (USAGE_EXIT_CODE, "error: model 'dla46x_c' has no stochastic depth (no drop_path_rate "
                                            "argument); expected MODEL.DROP_PATH_RATE 0.0, not 0.1\n")
    assert not (tmp_path / 'run').exists()
    code, _, err = _run(train_main, argv + ['--opts', 'MODEL.DROP_PATH_RATE', '0.0'], capsys)
    assert code == 0, err
    code, out, err = _run(eval_main, ['--checkpoint', str(tmp_path / 'run' / 'last.pth'), '--data-path', str(digits)],
                          capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])['count'] == 360


def test_a_checkpoint_of_another_attention_than_the_variant_s_evaluates(tmp_path, digits, capsys):
    """A model trained with MODEL.KWARGS.attn_type other than its registered variant's evaluates from its own
    checkpoint: the weights are the user's, not the variant's release."""
    opts = ['DATA.DATA_PATH', str(digits), 'MODEL.KWARGS.attn_type', 'sima']
    checkpoint = _tiny_checkpoint(tmp_path, load_config(TINY, opts))
    code, out, err = _run(eval_main, ['--cfg', TINY, '--checkpoint', checkpoint, '--opts'] + opts, capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])['count'] == 360


def test_throughput_prints_images_per_second(capsys):
    code, out, _ = _run(eval_main, ['--model', 'inline_deit_tiny', '--throughput', '--batch-size', '4', '--opts']
                        + TINY_MODEL_OPTS, capsys)
    assert code == 0
    assert out.startswith('batch_size 4 throughput ') and 'images/s' in out


def test_onednn_evaluates_to_the_same_accuracy_and_refuses_what_it_cannot_speed_up(tmp_path, digits, tiny_cfg,
                                                                                     capsys):
    official = _tiny_checkpoint(tmp_path, tiny_cfg, official=True)
    argv = ['--model', 'inline_deit_tiny', '--checkpoint', official, '--data-path', str(digits), '--opts',
            *TINY_MODEL_OPTS]
    results = []
    for extra, opts in (([], []), (['--onednn'], []),
                        (['--onednn', '--compile'], ['TRAIN.COMPILE_BACKEND', 'eager'])):
        code, out, _ = _run(eval_main, extra + argv + opts, capsys)
        assert code == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [(r['onednn'], r['compiled']) for r in results] == [(False, False), (True, False), (True, True)]
    assert all((r['top1'], r['top5']) == (results[0]['top1'], results[0]['top5']) for r in results)
    code, out, err = _run(eval_main, ['--onednn', '--amp'] + argv, capsys)
    assert code == USAGE_EXIT_CODE and out == ''
    assert err.strip().splitlines() == [
        "error: --onednn with --amp: the model's products would take autocast's path; expected float32 (leave "
        "out --amp or --onednn)"]


def test_the_script_itself_exits_2_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / 'train.py'), '--cfg', TINY, '--opts', 'TRAIN.BASE_LR', 'x'],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == USAGE_EXIT_CODE
    assert result.stderr.strip().splitlines() == [
        "error: config key TRAIN.BASE_LR expects a number, got 'x' in --opts"]


@pytest.mark.parametrize('source, message', [
    ("from models.attention import register_attention\nfrom models.attention.softmax import SoftmaxMixer\n\n\n"
     "@register_attention('softmax')\nclass Again(SoftmaxMixer):\n    pass\n",
     "(ValueError: attention 'softmax' is already registered by SoftmaxMixer; at {file}, line 5); expected a module "
     "that imports and registers cleanly"),
    ("def f(:\n    pass\n", "(SyntaxError: invalid syntax; at {file}, line 1)"),
    ("import json\nimport no_such_dependency\n", "(No module named 'no_such_dependency'; at {file}, line 2); "
     "expected a module whose own imports are installed"),
    ("raise ValueError('line one\\nline two')\n", "(ValueError: line one line two; at {file}, line 1)"),
    # after the package's first line, print('ran')
    ("raise RuntimeError('in the package')\n", "(RuntimeError: in the package; at {package}, line 2)"),
])
def test_a_model_imports_module_that_fails_is_named_on_one_line(tmp_path, monkeypatch, capsys, source, message):
    """The registry refusing a name, a syntax error, a missing dependency or any error of a MODEL.IMPORTS module,
    or of the package of a dotted one: one line naming the module, the error and its line, not a traceback; the
    failed code runs once."""
    package = f'user_package_{tmp_path.name}'
    (tmp_path / package).mkdir()
    in_package = 'in the package' in source
    (tmp_path / package / '__init__.py').write_text(f"print('ran')\n{source}" if in_package else "print('ran')\n")
    (tmp_path / package / 'user_module.py').write_text('' if in_package else source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = get_default_config()
    cfg.MODEL.IMPORTS = [f'{package}.user_module']
    with pytest.raises(UsageError) as raised:
        import_model_modules(cfg)
    file, init = tmp_path / package / 'user_module.py', tmp_path / package / '__init__.py'
    assert message.format(file=file, package=init) in str(raised.value)
    assert str(raised.value).startswith(f"MODEL.IMPORTS module '{package}.user_module' ")
    assert '\n' not in str(raised.value) and capsys.readouterr().out == 'ran\n'
