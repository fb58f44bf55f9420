"""Image-folder datasets (ImageNet layout or the embedded digits demo), timm transforms, samplers and loaders.

Both datasets go through the same path: `<root>/train/<class>/*` and `<root>/val/<class>/*` read by torchvision's
`ImageFolder`. The digits set (scikit-learn's 1,797 real 8x8 images) is written once as such a folder.
"""
import json
import os
import random
import shutil
import tempfile
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageOps
from timm.data import Mixup, create_transform
from timm.data.auto_augment import AugmentOp
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info
from torchvision.datasets import ImageFolder
from yacs.config import CfgNode as CN

from .config import mixup_active
from .distributed import DistInfo, barrier
from .errors import UsageError

__all__ = [
    'DIGITS_STAMP', 'default_digits_root', 'prepare_digits', 'resolve_data_root', 'check_splits', 'load_split',
    'posterize', 'train_transform', 'eval_transform', 'build_mixup', 'ShardSampler', 'SkipSampler', 'SeededSamples',
    'build_train_loader', 'build_eval_loader', 'eval_batch_size',
]

DIGITS_STAMP = 'digits.json'
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.ppm', '.bmp', '.pgm', '.tif', '.tiff', '.webp')


def default_digits_root() -> str:
    """`$XDG_CACHE_HOME/swappable-attention-zoo/digits` (`~/.cache/...` without the variable)."""
    cache = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(cache, 'swappable-attention-zoo', 'digits')


def _write_digits(root: str) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    indices = np.arange(len(digits.target))
    train_idx, val_idx = train_test_split(
        indices, test_size=DIGITS_VAL_FRACTION, stratify=digits.target, random_state=DIGITS_SPLIT_SEED)
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # values 0..16 -> 0..255
    for split, split_idx in (('train', train_idx), ('val', val_idx)):
        for i in sorted(split_idx):
            folder = os.path.join(root, split, str(digits.target[i]))
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(pixels[i], mode='L').save(os.path.join(folder, f'{i:04d}.png'))
    with open(os.path.join(root, DIGITS_STAMP), 'w') as f:
        json.dump(dict(train=len(train_idx), val=len(val_idx), classes=10, image_size=8), f)


def prepare_digits(root: str) -> str:
    """Write the digits image folder at `root` unless it is there; return `root`.

    The folder is built beside `root` and renamed into place, so a killed writer never leaves a partial cache
    and concurrent writers agree on one complete copy.
    """
    root = os.path.abspath(root)
    if os.path.isfile(os.path.join(root, DIGITS_STAMP)):
        return root
    if os.path.isdir(root) and os.listdir(root):
        raise UsageError(f"DATA.DATA_PATH {root!r} holds files but no digits cache ({DIGITS_STAMP}); expected a "
                         f"missing or empty folder for DATA.DATASET 'digits'")
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix='.digits-', dir=parent)
    try:
        _write_digits(staging)
        try:
            os.rename(staging, root)  # replaces an empty folder; fails when another writer finished first
        except OSError:
            if not os.path.isfile(os.path.join(root, DIGITS_STAMP)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def resolve_data_root(cfg: CN, info: DistInfo) -> str:
    """The dataset folder; for the digits demo, rank 0 writes the cache while the others wait."""
    if cfg.DATA.DATASET == 'digits':
        root = cfg.DATA.DATA_PATH or default_digits_root()
        if info.is_main:
            prepare_digits(root)
        barrier()
        return prepare_digits(root)
    if not cfg.DATA.DATA_PATH:
        raise UsageError("no dataset given; expected --data-path DIR (an ImageNet-style folder with train/ and val/) "
                         "or DATA.DATASET 'digits'")
    return cfg.DATA.DATA_PATH


def _class_folders(folder: str) -> List[str]:
    return sorted(e.name for e in os.scandir(folder) if e.is_dir())


def check_splits(root: str, splits: Sequence[str]) -> None:
    """Raise `UsageError` unless `root` exists and holds a folder for each of `splits`."""
    if not os.path.isdir(root):
        raise UsageError(f"data path {root!r} does not exist; expected a folder with {' and '.join(splits)} inside")
    for split in splits:
        if not os.path.isdir(os.path.join(root, split)):
            raise UsageError(f"data path {root!r} has no {split}/ folder; expected {split}/<class>/<images>")


def load_split(root: str, split: str, transform, num_classes: Optional[int] = None) -> ImageFolder:
    """`ImageFolder(root/split)` after checking the folder exists, has class folders with images, and
    (when given) `num_classes` of them."""
    check_splits(root, [split])
    folder = os.path.join(root, split)
    classes = _class_folders(folder)
    if not classes:
        raise UsageError(f"dataset folder {folder!r} is empty; expected one folder of images per class")
    if num_classes is not None and len(classes) != num_classes:
        raise UsageError(f"dataset folder {folder!r} has {len(classes)} class folders but the model has "
                         f"{num_classes} classes (MODEL.NUM_CLASSES)")
    try:
        return ImageFolder(folder, transform=transform, allow_empty=False)
    except FileNotFoundError:
        raise UsageError(f"dataset folder {folder!r} has a class folder without images; expected files ending in "
                         f"{', '.join(IMAGE_EXTENSIONS)}") from None


def _eval_interpolation(cfg: CN) -> str:
    return 'bicubic' if cfg.DATA.INTERPOLATION == 'random' else cfg.DATA.INTERPOLATION


def posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """Keep the `bits_to_keep` most significant bits of each channel; 0 bits (or fewer) give a black image.

    timm's increasing posterize maps magnitude 10 to 0 bits, which `rand-m9-mstd0.5` reaches whenever the magnitude
    noise lands 2 standard deviations high (about 1 image in 660). Pillow before 13 posterized 0 bits to black, which
    is what the official recipes trained with; Pillow 13 rejects 0 bits, so the black image is made here.
    """
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def _augment_ops(transform) -> Iterator[AugmentOp]:
    """The ops of RandAugment / AugMix (`ops`) and AutoAugment (`policy`, a list of sub-policies) in `transform`."""
    for step in getattr(transform, 'transforms', ()):
        yield from getattr(step, 'ops', ())
        for sub_policy in getattr(step, 'policy', ()):
            yield from sub_policy


def train_transform(cfg: CN):
    """timm's training transform: random resized crop, flip, RandAugment, normalisation, random erasing.

    Every posterize op of the auto-augmentation uses `posterize`, which accepts the 0 bits timm asks for.
    """
    aug = cfg.AUG
    transform = create_transform(
        cfg.DATA.IMG_SIZE, is_training=True, scale=tuple(aug.SCALE), ratio=tuple(aug.RATIO), hflip=aug.HFLIP,
        color_jitter=aug.COLOR_JITTER or None, auto_augment=aug.AUTO_AUGMENT or None,
        interpolation=cfg.DATA.INTERPOLATION, mean=tuple(cfg.DATA.MEAN), std=tuple(cfg.DATA.STD),
        re_prob=aug.REPROB, re_mode=aug.REMODE, re_count=aug.RECOUNT)
    for op in _augment_ops(transform):
        if op.name.startswith('Posterize'):
            op.aug_fn = posterize
    return transform


def eval_transform(cfg: CN):
    """Resize to floor(S / crop_pct) (shorter side, or square with 'squash'), centre crop S, normalise."""
    return create_transform(
        cfg.DATA.IMG_SIZE, is_training=False, interpolation=_eval_interpolation(cfg), mean=tuple(cfg.DATA.MEAN),
        std=tuple(cfg.DATA.STD), crop_pct=cfg.TEST.CROP_PCT, crop_mode=cfg.TEST.CROP_MODE)


def build_mixup(cfg: CN) -> Optional[Mixup]:
    if not mixup_active(cfg):
        return None
    aug = cfg.AUG
    return Mixup(
        mixup_alpha=aug.MIXUP, cutmix_alpha=aug.CUTMIX, cutmix_minmax=aug.CUTMIX_MINMAX, prob=aug.MIXUP_PROB,
        switch_prob=aug.MIXUP_SWITCH_PROB, mode=aug.MIXUP_MODE, label_smoothing=cfg.MODEL.LABEL_SMOOTHING,
        num_classes=cfg.MODEL.NUM_CLASSES)


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world, ... without padding, so summed counts over ranks cover each sample once."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class SkipSampler(Sampler[Tuple[int, int]]):
    """Wraps an epoch-seeded sampler and yields `(index, sample_seed)`; `set_epoch(epoch, skip)` drops that epoch's
    first `skip` samples.

    A sample's seed depends only on (`seed`, `rank`, epoch, position in the epoch), so resuming in the middle of an
    epoch continues with the samples not yet trained, drawn with the seeds they had.
    """

    def __init__(self, sampler: Sampler, seed: int, rank: int):
        self.sampler, self.seed, self.rank = sampler, seed, rank
        self.epoch = self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.epoch, self.skip = epoch, skip

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        seeds = np.random.default_rng([self.seed, self.rank, self.epoch]).integers(2 ** 63, size=len(self.sampler))
        for position, index in enumerate(self.sampler):
            if position >= self.skip:
                yield index, int(seeds[position])

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class SeededSamples(Dataset):
    """`dataset[index]` for the keys `(index, sample_seed)` of `SkipSampler`.

    In a DataLoader worker, `random`, NumPy and torch are seeded with the sample's seed first: a worker's streams
    would otherwise depend on what it drew before, which neither a resumed run (whose workers start at another
    batch) nor another worker count repeats. In the main process (no workers) the streams are the run's own,
    which checkpoints restore.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __getitem__(self, key: Tuple[int, int]):
        index, seed = key
        if get_worker_info() is not None:
            random.seed(seed)
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
            torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds every accelerator: slower
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


def _workers(cfg: CN) -> int:
    return min(cfg.DATA.NUM_WORKERS, os.cpu_count() or 1)  # more workers than CPUs only adds start-up time


def build_train_loader(cfg: CN, dataset: Dataset, info: DistInfo) -> DataLoader:
    """Shuffled per epoch (DistributedSampler seeded by SEED, or repeated augmentation with several processes);
    full batches only. Each sample's augmentation is drawn from its own seed (`SkipSampler`, `SeededSamples`),
    so a resumed run repeats it with any number of workers."""
    if info.distributed and cfg.AUG.REPEATED_AUG > 1:
        base = RepeatAugSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                num_repeats=cfg.AUG.REPEATED_AUG)
    else:
        base = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                  seed=cfg.SEED)
    if len(base) < cfg.DATA.BATCH_SIZE:
        raise UsageError(f"DATA.BATCH_SIZE {cfg.DATA.BATCH_SIZE} is larger than the {len(base)} training images "
                         f"each of the {info.world_size} processes gets; expected a smaller batch")
    return DataLoader(
        SeededSamples(dataset), batch_size=cfg.DATA.BATCH_SIZE, sampler=SkipSampler(base, cfg.SEED, info.rank),
        num_workers=_workers(cfg), pin_memory=cfg.DATA.PIN_MEMORY and info.device.type == 'cuda', drop_last=True,
        # each new iterator draws the workers' base seed: from a generator of its own, not the run's torch stream
        generator=torch.Generator())


def build_eval_loader(cfg: CN, dataset: Dataset, info: DistInfo, batch_size: int) -> DataLoader:
    return DataLoader(
        dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), info.rank, info.world_size),
        num_workers=_workers(cfg), pin_memory=cfg.DATA.PIN_MEMORY and info.device.type == 'cuda', drop_last=False)


def eval_batch_size(cfg: CN) -> int:
    return cfg.TEST.BATCH_SIZE or int(1.5 * cfg.DATA.BATCH_SIZE)
