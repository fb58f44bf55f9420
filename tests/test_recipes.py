"""The shipped ImageNet recipes as training builds them: augmentation that survives every RandAugment draw, the
official learning-rate schedules, and their float16 autocast, which runs as bfloat16 on the CPU."""
import logging
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from timm.data.random_erasing import RandomErasing

import engine.build
from engine.build import autocast_dtype, check_pretrained, cpu_has_bfloat16_kernels, create_scheduler
from engine.cli import train_main
from engine.config import ConfigError, load_config, scaled_lrs
from engine.data import build_batch_augmentation, posterize, train_transform
from engine.loops import TrainState, step_schedule
from models.checkpoint import has_released_weights

CONFIGS = Path(__file__).resolve().parents[1] / 'configs'
RECIPES = sorted(p for p in CONFIGS.rglob('*.yaml') if p.parent.name != 'demo')
RAND_AUGMENT_DRAWS = 10_000  # per distinct RandAugment (ops, magnitudes, fill and interpolation)
FULL_DRAWS = 200  # of the whole transform (crop to IMG_SIZE, ..., random erasing) per distinct recipe
MAX_MAGNITUDE = 10.0  # timm clamps RandAugment magnitudes to [0, 10]


def _images(size: int = 40) -> List[Image.Image]:
    """Small RGB images: noise, gradients, a checkerboard and flat colours (black, white, grey)."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size, dtype=np.uint8)
    images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(3)]
    images.append(np.stack([np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)),
                            np.full((size, size), 128, np.uint8)], axis=-1))
    checker = ((np.indices((size, size)).sum(0) // 5) % 2 * 255).astype(np.uint8)
    images.append(np.stack([checker] * 3, axis=-1))
    images += [np.full((size, size, 3), v, np.uint8) for v in (0, 255, 128)]
    return [Image.fromarray(a, mode='RGB') for a in images]


def _distinct_transforms() -> Dict[str, list]:
    """One transform per distinct recipe (keyed by its description), with the configs that build it."""
    transforms: Dict[str, list] = {}
    for path in RECIPES:
        transform = train_transform(load_config(str(path)))
        transforms.setdefault(repr(transform), [transform, []])[1].append(path.name)
    return transforms


def _rand_augment(transform):
    return next(t for t in transform.transforms if type(t).__name__ == 'RandAugment')


def _record(rand_augment, magnitudes: Dict[str, List[float]], bits: Set[int]) -> List[str]:
    """Wrap each op of `rand_augment` so its magnitudes (and posterize bits) are recorded; return the op names."""
    for op in rand_augment.ops:
        def level_fn(magnitude, hparams, name=op.name, inner=op.level_fn):
            magnitudes[name].append(magnitude)
            return inner(magnitude, hparams) if inner is not None else ()

        def aug_fn(img, *args, name=op.name, inner=op.aug_fn, **kwargs):
            if name == 'PosterizeIncreasing':
                bits.add(args[0])
            return inner(img, *args, **kwargs)

        op.level_fn, op.aug_fn = level_fn, aug_fn
    return [op.name for op in rand_augment.ops]


def test_posterize_keeps_the_top_bits_and_gives_black_for_zero_bits():
    img = _images()[0]
    pixels = np.asarray(img)
    assert np.array_equal(np.asarray(posterize(img, 0)), np.zeros_like(pixels))
    assert np.array_equal(np.asarray(posterize(img, -1)), np.zeros_like(pixels))
    assert np.array_equal(np.asarray(posterize(img, 1)), pixels & 0b10000000)
    assert np.array_equal(np.asarray(posterize(img, 3)), np.asarray(ImageOps.posterize(img, 3)))
    assert posterize(img, 8) is img
    grey = img.convert('L')
    assert posterize(grey, 0).mode == 'L' and np.asarray(posterize(grey, 0)).max() == 0


def test_every_recipe_train_transform_survives_every_randaugment_op_and_magnitude():
    """Each distinct recipe's transform, built by the engine, runs end to end; each distinct RandAugment (the stage
    that crashed, 1 image in about 660) runs 10,000 draws on the small images, reaching every op at the top
    magnitude."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    images = _images()
    transforms = _distinct_transforms()
    assert sum(len(names) for _, names in transforms.values()) == len(RECIPES) >= 40
    drawn: Set[str] = set()
    for transform, names in transforms.values():
        magnitudes: Dict[str, List[float]] = defaultdict(list)
        bits: Set[int] = set()
        rand_augment = _rand_augment(transform)
        op_names = _record(rand_augment, magnitudes, bits)
        assert len(op_names) == 15 and rand_augment.num_layers == 2
        for i in range(FULL_DRAWS):
            out = transform(images[i % len(images)])
            assert out.dtype == torch.float32 and torch.isfinite(out).all()
        # recipes that differ only outside RandAugment (crop, erasing, normalisation) share its draws
        config = repr(rand_augment) + repr([(op.magnitude_std, sorted(op.kwargs.items())) for op in rand_augment.ops])
        if config in drawn:
            continue
        drawn.add(config)
        for i in range(RAND_AUGMENT_DRAWS):
            out = rand_augment(images[i % len(images)])
            assert out.size == (40, 40) and out.mode == 'RGB'
        # every op ran many times and reached the top magnitude, where posterize asks for 0 bits
        assert {name for name in op_names if len(magnitudes[name]) >= 500} == set(op_names), names
        assert {name for name in op_names if max(magnitudes[name]) == MAX_MAGNITUDE} == set(op_names), names
        assert {0, 1} <= bits, (names, bits)


# The official schedules: (epochs run, warm-up epochs, warm-up before the decay (prefix), effective minimum lr,
# when the learning rate moves (TRAIN.LR_SCHEDULER.STEP), GPUs of the official run). The minimum lr is the official
# one at the official total batch. DeiT's loop and those derived from it call `lr_scheduler.step(epoch)` after each
# epoch ('previous_epoch'), timm's train.py `step(epoch + 1)` ('epoch'), Swin's `step_update` every update.
DEIT = (300, 5, False, 1e-5, 'previous_epoch')  # facebookresearch/deit main.py: 300 epochs (cooldown 10 never runs)
PVT = (300, 5, False, 1e-5, 'previous_epoch')  # whai362/PVT classification/main.py (DeiT-derived)
CSWIN = (310, 20, False, 1e-5, 'epoch')  # microsoft/CSWin-Transformer main.py (timm train): 300 + cooldown 10
SWIN = (300, 20, True, 5e-6 * 1024 / 512, 'update')  # microsoft/Swin-Transformer: warm-up inside 300, then cosine
SWIN_384 = (30, 5, True, 2e-7 * 1024 / 512, 'update')  # Swin base-384 fine-tune: 30 epochs, 5 warm-up, 64 x 2 x 8
# InLine / FLatten (Swin fork, warm-up inside the cosine, EPOCHS + COOLDOWN run), min lr at 8 GPUs: their table
INLINE_DEIT = (300, 20, False, 5e-6 * 4096 / 512, 'update')  # inline_deit_t: 512 x 8
SWIN_FORK_1024 = (300, 20, False, 1e-5, 'update')  # 128 x 8: inline_deit_s, *_swin_t/s
SWIN_FORK_512 = (300, 20, False, 5e-6, 'update')  # 64 x 8: inline_deit_b, *_swin_b
SWIN_FORK_384 = (30, 5, False, 1e-7, 'update')  # *_swin_b_384: 32 x 8
PVT_FORK = {b: (310, 5, False, lr, 'update') for b, lr in ((128, 2e-5), (64, 1e-5), (32, 5e-6))}  # by batch per GPU
# CSwin's fine-tunes (finetune.py, timm's train.py): no warm-up, then cooldown 10; 22k -> 1k 30 epochs, 384 20
CSWIN_22KTO1K = (40, 0, False, 5e-7, 'epoch')
CSWIN_384 = (30, 0, False, 5e-7, 'epoch')
CSWIN_FORK = {b: (310, 20, False, lr, 'update') for b, lr in ((128, 2e-5), (64, 1e-5), (256, 4e-5))}
CSWIN_FORK_384 = (30, 0, False, 2.5e-7, 'update')  # *_cswin_b_384: 20 epochs + cooldown 10, no warm-up, 32 x 8
SIMA = (400, 5, False, 1e-5, 'previous_epoch')  # UCDvision/sima main.py: 400 epochs (cooldown 10 never runs)
SIMA_DEIT = (300, 5, False, 1e-5, 'previous_epoch')  # DeiT-S -> SimA: the same for 300 epochs

SCHEDULES = {
    'base/deit': (*DEIT, 16), 'softmax/deit_tiny': (*DEIT, 4), 'softmax/deit_small': (*DEIT, 4),
    'softmax/deit_base': (*DEIT, 16),  # README: Ti/S 256 x 4 GPUs, B 64 x 16 GPUs
    'base/pvt': (*PVT, 8), **{f'softmax/pvt_{s}': (*PVT, 8) for s in ('tiny', 'small', 'medium', 'large')},
    'base/pvt_v2': (*PVT, 8), **{f'softmax/pvt_v2_{s}': (*PVT, 8)
                                       for s in ('b0', 'b1', 'b2', 'b2_li', 'b3', 'b4', 'b5')},
    **{f'multimax/deit_{s}': (*DEIT, g) for s, g in (('tiny', 4), ('small', 4), ('base', 16))},
    'base/cswin': (*CSWIN, 8), **{f'softmax/cswin_{s}': (*CSWIN, 8) for s in ('tiny', 'small', 'base')},
    'softmax/cswin_base_384': (*CSWIN_384, 8), 'softmax/cswin_large_22kto1k': (*CSWIN_22KTO1K, 8),
    'base/swin': (*SWIN, 8), **{f'softmax/swin_{s}': (*SWIN, 8) for s in ('tiny', 'small', 'base')},
    'softmax/swin_base_384': (*SWIN_384, 8),
    # Swin's fine-tuning of its ImageNet-22k weights: the base-384 fine-tune's schedule
    **{f'softmax/swin_{s}_22kto1k': (*SWIN_384, 8) for s in ('tiny', 'small', 'base', 'base_384', 'large', 'large_384')},
    **{f'base/{b}': (*SWIN_FORK_1024, 8) for b in ('inline', 'flatten', 'inline_flatten')},
    'inline/deit_tiny': (*INLINE_DEIT, 8), 'inline/deit_small': (*SWIN_FORK_1024, 8),
    'inline/deit_base': (*SWIN_FORK_512, 8),
    **{f'{a}/swin_{s}': (*SWIN_FORK_1024, 8) for a in ('inline', 'flatten') for s in ('tiny', 'small')},
    **{f'{a}/swin_base': (*SWIN_FORK_512, 8) for a in ('inline', 'flatten')},
    **{f'{a}/swin_base_384': (*SWIN_FORK_384, 8) for a in ('inline', 'flatten')},
    **{f'inline/pvt_{s}': (*PVT_FORK[b], 8) for s, b in (('tiny', 128), ('small', 128), ('medium', 128),
                                                        ('large', 64))},
    **{f'flatten/pvt_{s}': (*PVT_FORK[b], 8) for s, b in (('tiny', 128), ('small', 64), ('medium', 64),
                                                         ('large', 32))},
    **{f'flatten/pvt_v2_{s}': (*PVT_FORK[b], 8) for s, b in (('b0', 128), ('b1', 128), ('b2', 128), ('b3', 128),
                                                            ('b4', 64))},
    **{f'inline/cswin_{s}': (*CSWIN_FORK[b], 8) for s, b in (('tiny', 128), ('small', 128), ('base', 64))},
    **{f'flatten/cswin_{s}': (*CSWIN_FORK[b], 8) for s, b in (('tiny', 256), ('small', 128), ('base', 64))},
    **{f'{a}/cswin_base_384': (*CSWIN_FORK_384, 8) for a in ('inline', 'flatten')},
    'base/sima_xcit': (*SIMA, 8), 'sima/deit_small_ls': (*SIMA_DEIT, 8),
    **{f'sima/{s}_p{p}': (*SIMA, 8) for s in ('nano_12', 'tiny_12', 'small_12', 'tiny_24', 'small_24', 'medium_24',
                                               'large_24') for p in (16, 8)},
}


def test_every_fine_tuning_recipe_starts_from_the_released_weights_it_fine_tunes():
    """The 384 fine-tunes (30 epochs at lr 2e-5) trained from random weights unless given --pretrained; each now
    names the released 224 weights of its model (or the ImageNet-22k ones), where they are released."""
    fine_tunes = 0
    for path in RECIPES:
        cfg = load_config(str(path))
        if cfg.TRAIN.EPOCHS > 30:
            assert not cfg.MODEL.PRETRAINED, path
            continue
        fine_tunes += 1
        start = cfg.MODEL.PRETRAINED.split('.')[0]
        if path.stem.endswith('_22kto1k'):
            assert cfg.MODEL.PRETRAINED in (f'{cfg.MODEL.NAME}.ms_in22k', f'{cfg.MODEL.NAME}.in22k'), path
        elif has_released_weights(cfg.MODEL.NAME.replace('_384', '')):
            assert start == cfg.MODEL.NAME.replace('_384', ''), path
        else:
            assert not cfg.MODEL.PRETRAINED, path
        if cfg.MODEL.PRETRAINED:
            check_pretrained(cfg.MODEL.PRETRAINED)
    assert fine_tunes == 13


def test_every_recipe_has_an_official_schedule():
    assert sorted(SCHEDULES) == sorted(f'{p.parent.name}/{p.stem}' for p in RECIPES)


@pytest.mark.parametrize('key', sorted(SCHEDULES))
def test_schedule_matches_the_official_recipe(key):
    """The schedule the training loop steps (`step_schedule`): epochs run, warm-up, where the decay starts and ends,
    and whether the learning rate moves every update, at the start of each epoch, or one epoch late."""
    epochs_run, warmup, prefix, min_lr, per, gpus = SCHEDULES[key]
    cfg = load_config(str(CONFIGS / f'{key}.yaml'))
    assert cfg.TRAIN.LR_SCHEDULER.STEP == per
    lrs = scaled_lrs(cfg, gpus)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lrs['lr'])
    per_epoch = 7
    scheduler, epochs = create_scheduler(cfg, optimizer, lrs, per_epoch)

    def lr_at_update(update: int) -> float:
        step_schedule(scheduler, TrainState(epoch=update // per_epoch, epoch_batches=update % per_epoch), per_epoch,
                      1, per)
        return optimizer.param_groups[0]['lr']

    # the schedule's clock: updates, or epochs (an epoch late with 'previous_epoch')
    unit = per_epoch if per == 'update' else 1
    lag = 1 if per == 'previous_epoch' else 0

    def lr_at(t: int) -> float:
        return lr_at_update(t if per == 'update' else (t + lag) * per_epoch)

    assert epochs == epochs_run and scheduler.t_in_epochs == (per != 'update')
    assert lrs['min_lr'] == pytest.approx(min_lr, rel=1e-12)
    decay_end = cfg.TRAIN.EPOCHS * unit
    assert epochs_run - cfg.TRAIN.EPOCHS == cfg.TRAIN.COOLDOWN_EPOCHS
    warmup_steps = warmup * unit
    assert scheduler.warmup_t == warmup_steps
    if warmup:
        assert lr_at(0) == pytest.approx(lrs['warmup_lr'], rel=1e-12)
        assert lr_at(warmup_steps - 1) < lrs['lr']
    # the cosine starts at update 0 (warm-up inside it) or after the warm-up (prefix), and ends at EPOCHS
    start = warmup_steps if prefix else 0
    cosine = lrs['min_lr'] + 0.5 * (lrs['lr'] - lrs['min_lr']) * (
        1 + math.cos(math.pi * (warmup_steps - start) / (decay_end - start)))
    assert lr_at(warmup_steps) == pytest.approx(cosine, rel=1e-12)
    assert (lr_at(warmup_steps) == pytest.approx(lrs['lr'], rel=1e-12)) == (prefix or not warmup)
    assert lr_at(decay_end - 1) > min_lr
    assert lr_at(decay_end) == pytest.approx(min_lr, rel=1e-12)
    if cfg.TRAIN.COOLDOWN_EPOCHS:  # the last update of the run, at the minimum
        assert lr_at_update(epochs_run * per_epoch - 1) == pytest.approx(min_lr, rel=1e-12)
    if per != 'update':  # one value an epoch
        assert {lr_at_update(2 * per_epoch + i) for i in range(per_epoch)} == {lr_at_update(2 * per_epoch)}
    if per != 'update' and warmup:  # DeiT's loop runs epochs 0 and 1 both at the warm-up's start
        second = lrs['warmup_lr'] + (1 - lag) * (lrs['lr'] - lrs['warmup_lr']) / warmup
        assert lr_at_update(0) == lrs['warmup_lr'] and lr_at_update(per_epoch) == pytest.approx(second, rel=1e-12)


def test_the_cswin_recipe_erases_the_mixed_batch_as_its_prefetching_loader_does():
    """CSwin's timm loader mixes in its collate and erases after normalising: the erased boxes hold the noise as
    drawn (std 1), where erasing each image before mixup blends two images' noise (std sqrt(λ² + (1 − λ)²) < 1).
    DeiT's loop erases each image in its transform."""
    opts = ['AUG.REPROB', '1.0', 'AUG.CUTMIX', '0.0', 'DATA.IMG_SIZE', '32', 'MODEL.NUM_CLASSES', '10']
    cswin, deit = (load_config(str(CONFIGS / f'base/{name}.yaml'), opts) for name in ('cswin', 'deit'))
    assert not any(isinstance(t, RandomErasing) for t in train_transform(cswin).transforms)
    assert any(isinstance(t, RandomErasing) for t in train_transform(deit).transforms)
    assert build_batch_augmentation(deit, torch.device('cpu')) is not None  # mixup alone
    stds = {}
    for order in ('after', 'before'):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        images, labels = torch.zeros(64, 3, 32, 32), torch.arange(64) % 10
        if order == 'before':  # each image erased by its transform, then the batch mixed
            images = torch.stack([RandomErasing(1.0, mode='pixel', device='cpu')(image) for image in images])
            images, targets = build_batch_augmentation(deit, torch.device('cpu'))(images, labels)
        else:
            images, targets = build_batch_augmentation(cswin, torch.device('cpu'))(images, labels)
        assert targets.shape == (64, 10) and (images != 0).flatten(1).any(dim=1).all()
        stds[order] = images[images != 0].std().item()
    assert stds['after'] == pytest.approx(1.0, abs=0.02) and stds['before'] < 0.9


def test_a_prefixed_warm_up_must_leave_epochs_to_decay():
    with pytest.raises(ConfigError, match=r'^config key TRAIN.WARMUP_EPOCHS is 20; expected fewer than TRAIN.EPOCHS '
                                          r'\(20\) with TRAIN.LR_SCHEDULER.WARMUP_PREFIX$'):
        load_config(str(CONFIGS / 'base/swin.yaml'), ['TRAIN.EPOCHS', '20'])


@pytest.mark.parametrize('bfloat16_kernels', [True, False])
def test_float16_autocast_becomes_bfloat16_on_the_cpu_only(monkeypatch, bfloat16_kernels):
    """...and a CPU without bfloat16 kernels (AVX2 only), where autocast trained 5x slower than float32, says so."""
    monkeypatch.setattr(engine.build, 'cpu_has_bfloat16_kernels', lambda: bfloat16_kernels)
    slow = [] if bfloat16_kernels else [
        "this CPU has no bfloat16 kernels (oneDNN's need AVX-512 or AMX): autocast runs several times slower than "
        "float32 here; AMP.ENABLED False (eval.py: leave out --amp) runs faster"]
    cfg = load_config(str(CONFIGS / 'inline/deit_tiny.yaml'))
    assert cfg.AMP.ENABLED and cfg.AMP.DTYPE == 'float16'
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger('engine')
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert autocast_dtype(cfg, torch.device('cuda', 0), True) == 'float16'
        assert records == []
        assert autocast_dtype(cfg, torch.device('cpu'), False) == 'bfloat16'
        assert records == []  # autocast off: nothing to say
        assert autocast_dtype(cfg, torch.device('cpu'), True) == 'bfloat16'
        assert [r.getMessage() for r in records] == [
            'AMP.DTYPE float16 runs as bfloat16 on the CPU (float16 autocast is slower there than float32)', *slow]
        records.clear()
        bf16 = load_config(str(CONFIGS / 'inline/deit_tiny.yaml'), ['AMP.DTYPE', 'bfloat16'])
        assert autocast_dtype(bf16, torch.device('cpu'), True) == 'bfloat16'
        assert [r.getMessage() for r in records] == slow
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_float16_run_on_the_cpu_trains_exactly_like_bfloat16_without_a_scaler(tmp_path):
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        for label in range(2):
            (tmp_path / 'data' / split / str(label)).mkdir(parents=True)
            for i in range(32):
                Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode='L').save(
                    tmp_path / 'data' / split / str(label) / f'{i}.png')
    opts = ['DATA.DATASET', 'imagefolder', 'MODEL.NUM_CLASSES', '2', 'TRAIN.EPOCHS', '1', 'AMP.ENABLED', 'True',
            'DEVICE', 'cpu']
    for dtype in ('float16', 'bfloat16'):
        assert train_main(['--cfg', str(CONFIGS / 'demo/digits_tiny.yaml'), '--output', str(tmp_path / dtype),
                           '--data-path', str(tmp_path / 'data'), '--opts', *opts, 'AMP.DTYPE', dtype]) == 0
    log = (tmp_path / 'float16' / 'train.log').read_text()
    assert log.count('AMP.DTYPE float16 runs as bfloat16 on the CPU') == 1
    assert log.count('this CPU has no bfloat16 kernels') == (0 if cpu_has_bfloat16_kernels() else 1)
    assert 'runs as bfloat16' not in (tmp_path / 'bfloat16' / 'train.log').read_text()
    runs = [torch.load(tmp_path / dtype / 'last.pth', weights_only=True) for dtype in ('float16', 'bfloat16')]
    assert runs[0]['scaler'] == runs[1]['scaler'] == {}  # no gradient scaler
    assert runs[0]['step'] == runs[1]['step'] == 4
    for name, value in runs[1]['model'].items():
        assert torch.equal(runs[0]['model'][name], value), name
