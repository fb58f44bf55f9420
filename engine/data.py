"""Image-folder datasets (ImageNet layout or the embedded digits demo), timm transforms, samplers and loaders.

Both datasets go through the same path: `<root>/train/<class>/*` and `<root>/val/<class>/*` read by torchvision's
`ImageFolder`, with a scan that follows each folder once per class (no symlink loop) and counts each file once per
class. Files that are
not images that can be read (broken links, FIFOs, empty, truncated or non-image files) follow `DATA.BAD_IMAGES`:
'error' stops with one line naming the file, 'skip' leaves them out and says so. The digits set (scikit-learn's
1,797 real 8x8 images) is written once as such a folder.
"""
import errno
import functools
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
import time
import unicodedata
import uuid
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from timm.data import Mixup, create_transform
from timm.data.auto_augment import AugmentOp
from timm.data.distributed_sampler import RepeatAugSampler
from timm.data.random_erasing import RandomErasing
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate, get_worker_info
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import has_file_allowed_extension
from yacs.config import CfgNode as CN

from models._files import file_in_the_way, remove_left_by_dead_processes

from .config import mixup_active
from .distributed import DistInfo, all_gather_objects, each_node_first
from .errors import BadImageError, UsageError
from .loops import Progress

__all__ = [
    'DIGITS_STAMP', 'default_digits_root', 'prepare_digits', 'resolve_data_root', 'check_splits', 'class_difference',
    'check_trained_classes', 'class_folders', 'load_split',
    'BadImage', 'ImageFolderSplit', 'ImageLoader', 'image_mode', 'image_channels', 'read_image', 'check_images',
    'report_scan',
    'posterize', 'train_transform', 'eval_transform', 'build_batch_augmentation', 'ShardSampler', 'SkipSampler',
    'SeededSamples',
    'build_train_loader', 'build_eval_loader', 'eval_batch_size',
]

DIGITS_STAMP = 'digits.json'
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.ppm', '.bmp', '.pgm', '.tif', '.tiff', '.webp')
logger = logging.getLogger('engine')


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


def _remove_stale_staging(parent: str) -> None:
    """Remove the staging folders in `parent` of digits writers of this host that no longer run."""
    host = re.escape(socket.gethostname())
    remove_left_by_dead_processes(parent, re.compile(rf'\.digits-{host}\.(\d+)\.[0-9a-f]{{8}}$'))


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
    # named before it is made, so that the `finally` removes it whenever an interruption comes; a writer killed
    # outright (SIGTERM, SIGKILL) runs no `finally`, and the next writer on the host removes its folder
    staging = os.path.join(parent, f'.digits-{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}')
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_stale_staging(parent)
        os.mkdir(staging)
        _write_digits(staging)
        try:
            os.rename(staging, root)  # replaces an empty folder; fails when another writer finished first
        except OSError:
            if not os.path.isfile(os.path.join(root, DIGITS_STAMP)):
                raise
    except OSError as e:
        blocker = file_in_the_way(root)
        reason = (f"{blocker!r} is a file, not a folder" if blocker
                  else f"{e.strerror or type(e).__name__}" + (f": {e.filename!r}" if e.filename else ''))
        raise UsageError(f"cannot write the digits cache {root!r} ({reason}); expected a folder this user can write: "
                         f"set DATA.DATA_PATH, or XDG_CACHE_HOME for the default place") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def resolve_data_root(cfg: CN, info: DistInfo) -> str:
    """The dataset folder; for the digits demo, the first process of each node writes the cache while the others
    wait, and every process stops with its error when it cannot."""
    if cfg.DATA.DATASET == 'digits':
        root = cfg.DATA.DATA_PATH or default_digits_root()
        return each_node_first(info, lambda: prepare_digits(root), f"write the digits cache {root!r}")
    if not cfg.DATA.DATA_PATH:
        raise UsageError("no dataset given; expected --data-path DIR (an ImageNet-style folder with train/ and val/) "
                         "or DATA.DATASET 'digits'")
    return cfg.DATA.DATA_PATH


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a link loop: not a folder, and as a file name it is judged like any other
        return False


def class_folders(folder: str) -> List[str]:
    """The class folders of a split folder, sorted as torchvision sorts them."""
    return sorted(e.name for e in os.scandir(folder) if _is_folder(e))


def check_splits(root: str, splits: Sequence[str]) -> None:
    """Raise `UsageError` unless `root` exists and holds, for each of `splits`, a folder of class folders: one
    listing per split, cheap enough to run before any download or scan."""
    if not os.path.isdir(root):
        state = 'is a file' if os.path.exists(root) else 'does not exist'
        raise UsageError(f"data path {root!r} {state}; expected a folder with {' and '.join(splits)} inside")
    for split in splits:
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            raise UsageError(f"data path {root!r} has no {split}/ folder; expected {split}/<class>/<images>")
        if class_folders(folder):
            continue
        flat = sum(1 for e in os.scandir(folder) if has_file_allowed_extension(e.name, IMAGE_EXTENSIONS))
        if flat:  # ImageNet's validation archive unpacks this way
            raise UsageError(f"dataset folder {folder!r} holds {flat} image files but no class folders; expected "
                             f"{folder}/<class>/<images> (sort a flat split into its class folders first)")
        raise UsageError(f"dataset folder {folder!r} is empty; expected one folder of images per class")


def class_difference(first: Sequence[str], second: Sequence[str], first_place: str, second_place: str) -> str:
    """The class names only one of `first` and `second` holds, for a message naming where each list comes from."""
    only_first, only_second = sorted(set(first) - set(second)), sorted(set(second) - set(first))
    difference = '; '.join(f"only in {place}: {', '.join(names)}" for place, names in
                           ((first_place, only_first), (second_place, only_second)) if names)
    # names that print alike: one written in composed characters, the other decomposed (as macOS writes names)
    composed = {unicodedata.normalize('NFC', name): name for name in only_second}
    alike = [(name, composed[unicodedata.normalize('NFC', name)]) for name in only_first
             if unicodedata.normalize('NFC', name) in composed]
    if alike:
        difference += (f"; {ascii(alike[0][0])} and {ascii(alike[0][1])} are one name in two Unicode forms "
                       f"(composed and decomposed characters)")
    return difference or 'the same names in another order'


def check_trained_classes(trained: Optional[Sequence[str]], found: Sequence[str], source: str, folder: str) -> None:
    """Raise `UsageError` unless `found`, the class folders of `folder`, are the classes `source` (a checkpoint)
    was trained on: with as many classes under other names, every label after the first change would be read as
    another class. `trained` None (a checkpoint that does not record them) passes."""
    if trained is None or list(trained) == list(found):
        return
    raise UsageError(f"{source} was trained on other classes than {folder} holds "
                     f"({class_difference(trained, found, 'the checkpoint', folder)}); expected the class folders it "
                     f"was trained on")


class BadImage(NamedTuple):
    """A file that is not an image that can be read, and why."""
    path: str
    reason: str

    def __str__(self) -> str:
        return f"image {self.path!r} {self.reason}"

    def skip_message(self) -> str:
        return f"skipped image {self.path!r}, which {self.reason} (DATA.BAD_IMAGES 'skip')"


_FILE_KINDS = ((stat.S_ISDIR, 'a folder'), (stat.S_ISFIFO, 'a FIFO'), (stat.S_ISSOCK, 'a socket'),
               (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'))


def _stat_image(path: str) -> Union[os.stat_result, BadImage]:
    """The status of the file `path` leads to, or why it cannot be an image: a broken link, a link loop, not a
    regular file (reading a FIFO would block), empty, or unreadable. Never opens the file."""
    try:
        status = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return BadImage(path, 'is a symbolic link loop')
        if e.errno == errno.ENOENT and os.path.islink(path):
            return BadImage(path, f'is a broken symbolic link (to {os.readlink(path)!r})')
        return BadImage(path, f'cannot be read ({e.strerror})')
    if not stat.S_ISREG(status.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(status.st_mode)), 'a special file')
        return BadImage(path, f'is {kind}, not a regular file')
    if status.st_size == 0:
        return BadImage(path, 'is empty (0 bytes)')
    if not os.access(path, os.R_OK):
        return BadImage(path, 'cannot be read (Permission denied)')
    return status


def image_mode(cfg: CN) -> str:
    """The Pillow mode images are read in: 'L' (grey-scale) when DATA.MEAN holds one channel, else 'RGB'."""
    return 'L' if len(cfg.DATA.MEAN) == 1 else 'RGB'


def image_channels(cfg: CN) -> int:
    """The channels of the images the data pipeline feeds the model: 1 in `image_mode` 'L', else 3."""
    return 1 if image_mode(cfg) == 'L' else 3


def read_image(path: str, mode: str = 'RGB') -> Union[Image.Image, BadImage]:
    """The image at `path` (fully decoded) in Pillow `mode`, or a `BadImage` saying why there is none."""
    status = _stat_image(path)
    if isinstance(status, BadImage):
        return status
    try:
        with Image.open(path) as image:
            if image.mode in _WIDE_MODES:
                return _eight_bit(image).convert(mode)
            return image.convert(mode)
    except UnidentifiedImageError:
        return BadImage(path, 'is not an image (Pillow cannot identify its format)')
    except Exception as e:  # Pillow's decoders raise many types on corrupt data (OSError, SyntaxError, ValueError, ...)
        detail = str(e).splitlines()[0] if str(e) else ''
        return BadImage(path, f"cannot be decoded ({type(e).__name__}{': ' + detail if detail else ''})")


# Pillow's modes of one channel wider than 8 bits, whose `convert` to 'L' or 'RGB' clips every value above 255
# (a 16-bit grey ramp came out almost all white): 16-bit integers, 32-bit integers (Pillow's mode for 16-bit PNGs
# before version 10.4), 32-bit floats.
_WIDE_MODES = ('I;16', 'I;16L', 'I;16B', 'I;16N', 'I', 'F')


def _eight_bit(image: Image.Image) -> Image.Image:
    """A one-channel image of 16-bit values (0 to 65535, as the 'I;16' and 'I' modes of 16-bit files hold them) as
    8 bits, v * 255 / 65535 rounded; a ValueError for floating-point data and for other values (32-bit data),
    whose range an image file does not state."""
    if image.mode == 'F':
        raise ValueError("F pixels, floating-point data; expected 8- or 16-bit integer values")
    values = np.asarray(image, dtype=np.float64)
    if values.size and not (0 <= values.min() and values.max() <= 65535):
        raise ValueError(f"{image.mode} pixels from {values.min():g} to {values.max():g}; expected 16-bit values, "
                         f"integers from 0 to 65535")
    return Image.fromarray(np.round(values * (255 / 65535)).astype(np.uint8), mode='L')


def _bad_files_error(bad: Sequence[BadImage], where: str) -> UsageError:
    more = f" (and {len(bad) - 1} more bad file(s) in {where})" if len(bad) > 1 else ''
    return UsageError(f"{bad[0]}{more}; expected images that can be read (DATA.BAD_IMAGES 'error'; 'skip' leaves "
                      f"such files out)")


class ImageFolderSplit(ImageFolder):
    """torchvision's `ImageFolder` with a scan that enters each folder once per class (links are followed, loops and
    links to another class's whole folder are not), counts each file once per class (the first path in scan order
    keeps it; a file two classes hold counts in both, as in `ImageFolder`), and checks each file cheaply (a regular,
    non-empty, readable file), and a `__getitem__` that reports the files it cannot read instead of raising.

    Under `bad_images` 'error' the scan raises `UsageError` naming the first bad file (and counting the others);
    under 'skip' it leaves bad files out and lists them in `left_out`. `notes` holds the links the scan did not
    follow again. `__getitem__` returns `(image, target, bad)`: `bad` the unreadable files it met, and `image` None
    when the sample is one of them; with `replace_bad` under 'skip', a readable file further on stands in for it
    (up to `_REPLACEMENT_ATTEMPTS` tried, spread over the folders), so batches stay full, or `ImageLoader` stops.
    """

    def __init__(self, folder: str, transform=None, bad_images: str = 'error', replace_bad: bool = False,
                 image_mode: str = 'RGB'):
        self.bad_images, self.replace_bad = bad_images, replace_bad
        self.left_out: List[BadImage] = []
        self.notes: List[str] = []
        super().__init__(folder, transform=transform, loader=functools.partial(read_image, mode=image_mode),
                         allow_empty=True)

    def find_classes(self, directory: str) -> Tuple[List[str], Dict[str, int]]:
        classes = class_folders(directory)
        return classes, {name: index for index, name in enumerate(classes)}

    def make_dataset(self, directory: str, class_to_idx: Dict[str, int], extensions=None, is_valid_file=None,
                     allow_empty: bool = True) -> List[Tuple[str, int]]:
        """(path, class index) of every image file, in torchvision's order (classes, then folders by path, then
        names); raise `UsageError` for a class folder without images."""
        claimed = {self._key(directory): directory}
        # class folders are claimed first, so a link from one class to another's whole folder is not followed
        for name in class_to_idx:
            path = os.path.join(directory, name)
            claimed.setdefault(self._key(path), path)
        # a file is counted once per class: a link within a class adds nothing, while a file that two classes hold
        # (a link or hard link from one into another) belongs to both, as torchvision's ImageFolder has it
        files: Dict[Tuple[str, int, int], str] = {}
        first_seen: Dict[Tuple[int, int], Tuple[str, str]] = {}  # class and path
        samples, empty, again, shared = [], [], [], []
        for name in sorted(class_to_idx):
            count = len(samples)
            # each class walks its own folders once: a link into a subfolder of another class counts there too
            for path in self._walk(os.path.join(directory, name), dict(claimed)):
                status = _stat_image(path)
                if isinstance(status, BadImage):
                    self.left_out.append(status)
                    continue
                first = files.setdefault((name, status.st_dev, status.st_ino), path)
                if first != path:
                    again.append(f"{path} is {first}")
                    continue
                owner, owner_path = first_seen.setdefault((status.st_dev, status.st_ino), (name, path))
                if owner != name:
                    shared.append(f"{path} is {owner_path}")
                samples.append((path, class_to_idx[name]))
            if len(samples) == count:
                empty.append(name)
        if again:
            self.notes.append(f"{len(again)} file(s) reached a second time through links within their class were "
                              f"counted once ({again[0]}{', ...' if len(again) > 1 else ''})")
        if shared:
            self.notes.append(f"{len(shared)} file(s) are in more than one class, through links, and count in each "
                              f"({shared[0]}{', ...' if len(shared) > 1 else ''})")
        if self.left_out and self.bad_images == 'error':
            raise _bad_files_error(self.left_out, directory)
        if empty:
            after = f" once {len(self.left_out)} bad file(s) are left out" if self.left_out else ''
            raise UsageError(f"dataset folder {directory!r} has a class folder without images{after} "
                             f"({', '.join(empty)}); expected files ending in {', '.join(IMAGE_EXTENSIONS)}")
        return samples

    @staticmethod
    def _key(path: str) -> Tuple[int, int]:
        status = os.stat(path)
        return status.st_dev, status.st_ino

    def _walk(self, top: str, claimed: Dict[Tuple[int, int], str]) -> Iterator[str]:
        """Paths of the files with an image extension under `top`, folder by folder in path order; a folder
        reached again through a link is left out and noted."""
        found: Dict[str, List[str]] = {}
        pending = [top]
        while pending:
            folder = pending.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError as e:
                raise UsageError(f"dataset folder {folder!r} cannot be listed ({e.strerror}); expected a readable "
                                 f"folder") from None
            names = []
            for entry in entries:
                if _is_folder(entry):
                    key = self._key(entry.path)
                    if key in claimed:
                        self.notes.append(f"{entry.path} leads to {claimed[key]}, scanned once: not followed")
                        continue
                    claimed[key] = entry.path
                    pending.append(entry.path)
                elif has_file_allowed_extension(entry.name, IMAGE_EXTENSIONS):
                    names.append(entry.name)
            found[folder] = names
        for folder in sorted(found):
            for name in found[folder]:
                yield os.path.join(folder, name)

    @property
    def replaces_bad(self) -> bool:
        """Whether a readable file stands in for a bad one: `replace_bad` under 'skip'."""
        return self.replace_bad and self.bad_images == 'skip'

    @property
    def stand_ins(self) -> int:
        """Files tried in turn for one sample: where it `replaces_bad`, a bounded number (trying every next file
        made a split of unreadable files, Git LFS pointers, take time quadratic in its size), else its own."""
        return min(len(self.samples), _REPLACEMENT_ATTEMPTS) if self.replaces_bad else 1

    def __getitem__(self, index: int) -> Tuple[Any, int, Tuple[BadImage, ...]]:
        bad: List[BadImage] = []
        size = len(self.samples)
        # stand-ins spread over the folders by a stride coprime with their count; where none of them can be read,
        # the loader stops the run
        stride = _spread_stride(size) if self.replaces_bad else 1
        for attempt in range(self.stand_ins):
            path, target = self.samples[(index + attempt * stride) % size]
            image = self.loader(path)
            if not isinstance(image, BadImage):
                try:
                    return (self.transform(image) if self.transform is not None else image), target, tuple(bad)
                except ValueError as e:  # a shape the transform cannot take: 'border' crops of a 3x2000 image
                    image = BadImage(path, f"of {image.width}x{image.height} pixels cannot be transformed ({e})")
            bad.append(image)
        return None, self.targets[index], tuple(bad)

    def remove(self, bad: Sequence[BadImage]) -> None:
        """Leave the files of `bad` out of the samples."""
        paths = {b.path for b in bad}
        self.samples = [s for s in self.samples if s[0] not in paths]
        self.imgs, self.targets = self.samples, [s[1] for s in self.samples]
        self.left_out.extend(bad)


# Files tried for one sample under 'skip' with replacement before the sample is dropped from its batch.
_REPLACEMENT_ATTEMPTS = 32


def _spread_stride(size: int) -> int:
    """A step through `size` samples that visits all of them and leaves a folder of bad files at once: the first
    number from floor(0.618·size) (at least 1) up that is coprime with `size`."""
    stride = max(1, int(size * 0.618))
    while math.gcd(stride, size) != 1:
        stride += 1
    return stride


def load_split(root: str, split: str, transform, num_classes: Optional[int] = None, bad_images: str = 'error',
               replace_bad: bool = False, image_mode: str = 'RGB') -> ImageFolderSplit:
    """`ImageFolderSplit(root/split)` after checking the folder exists, has class folders (`check_splits`) and
    (when given) `num_classes` of them; images are read in Pillow's `image_mode`."""
    check_splits(root, [split])
    folder = os.path.join(root, split)
    classes = class_folders(folder)
    if num_classes is not None and len(classes) != num_classes:
        hidden = [c for c in classes if c.startswith('.')]
        among = f", among them the hidden {', '.join(hidden)}" if hidden else ''
        raise UsageError(f"dataset folder {folder!r} has {len(classes)} class folders{among} but the model has "
                         f"{num_classes} classes (MODEL.NUM_CLASSES)")
    return ImageFolderSplit(folder, transform, bad_images, replace_bad, image_mode)


def report_scan(dataset: ImageFolderSplit) -> None:
    """Log the files the scan left out and the links it did not follow again."""
    for note in dataset.notes:
        logger.warning(note)
    for bad in dataset.left_out:
        logger.warning(bad.skip_message())
    if dataset.left_out:
        logger.warning(f"{dataset.root}: {len(dataset.left_out)} bad file(s) left out, {len(dataset)} images kept")


class _Decode(Dataset):
    """Decodes the given files: `BadImage` for those that fail, None for the others."""

    def __init__(self, paths: Sequence[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Optional[BadImage]:
        image = read_image(self.paths[index])
        return image if isinstance(image, BadImage) else None


def check_images(dataset: ImageFolderSplit, cfg: CN, info: DistInfo) -> None:
    """Decode every image of `dataset` (`--check-data`), each process its share; under 'error' raise `UsageError`
    naming the first file that fails, under 'skip' leave those files out on every process."""
    paths = [path for path, _ in dataset.samples[info.rank::info.world_size]]
    loader = DataLoader(_Decode(paths), batch_size=64, num_workers=_workers(cfg), collate_fn=list)
    start = time.perf_counter()
    found = []
    with Progress(len(loader), f'check {os.path.basename(dataset.root)}', enabled=info.is_main) as progress:
        for batch in loader:
            found += [bad for bad in batch if bad is not None]
            progress.update()
    bad = sorted({b for found_by_rank in all_gather_objects(found) for b in found_by_rank})
    logger.info(f"--check-data: decoded the {len(dataset)} images of {dataset.root} in "
                f"{time.perf_counter() - start:.1f} s, {len(bad)} bad")
    if not bad:
        return
    if dataset.bad_images == 'error':
        raise _bad_files_error(bad, dataset.root)
    for b in bad:
        logger.warning(b.skip_message())
    dataset.remove(bad)


class _Batch(NamedTuple):
    images: Optional[torch.Tensor]
    targets: Optional[torch.Tensor]
    bad: Tuple[BadImage, ...]
    dropped: int  # samples without a readable image


def _collate(samples: Sequence[Tuple[Any, int, Tuple[BadImage, ...]]]) -> _Batch:
    """The readable samples collated, with the bad files met on the way."""
    bad = tuple(b for _, _, found in samples for b in found)
    good = [(image, target) for image, target, _ in samples if image is not None]
    if not good:
        return _Batch(None, None, bad, len(samples))
    images, targets = default_collate(good)
    return _Batch(images, targets, bad, len(samples) - len(good))


def _outlast_one_sigterm(worker_id: int) -> None:
    """A loader worker's start: its first SIGTERM is ignored, a second ends it. torchrun stops a process with a
    signal to its process group, as `timeout` and batch schedulers do, which reached the workers too: they died
    and the process failed on its next batch instead of saving after its step. The loader ends its workers
    itself, and one that hangs still stops at the next SIGTERM: the loader's own, or Python's at exit."""
    def ignore_once(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, ignore_once)


class ImageLoader(DataLoader):
    """A `DataLoader` over an `ImageFolderSplit` that yields `(images, targets)` and applies `DATA.BAD_IMAGES` to
    the files its workers could not read: 'error' raises `BadImageError` naming the file; 'skip' logs each file
    the first time and keeps the files skipped in the current pass in `skipped`. `seeded` takes the
    `(index, sample_seed)` keys of `SkipSampler` (`SeededSamples`). Its workers outlast a stop signal sent to the
    whole process group (`_outlast_one_sigterm`)."""

    def __init__(self, dataset: ImageFolderSplit, seeded: bool = False, **kwargs):
        super().__init__(SeededSamples(dataset) if seeded else dataset, collate_fn=_collate,
                         worker_init_fn=_outlast_one_sigterm, **kwargs)
        self.split = dataset
        self.bad_images = dataset.bad_images
        self.skipped: Set[str] = set()
        self._logged: Set[str] = set()

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        self.skipped = set()
        for batch in super().__iter__():
            for bad in batch.bad:
                if self.bad_images == 'error':
                    raise BadImageError(f"{bad}; expected images that can be read (DATA.BAD_IMAGES 'error'; 'skip' "
                                        f"leaves such files out, --check-data finds them before training)")
                self.skipped.add(bad.path)
                if bad.path not in self._logged:
                    self._logged.add(bad.path)
                    logger.warning(bad.skip_message())
            if self.split.replaces_bad and batch.dropped:  # on any process: a batch short on one alone desynchronises
                raise BadImageError(f"none of {self.split.stand_ins} files tried in turn for one training image of "
                                    f"{self.split.root} can be read (the first: {batch.bad[0]}); expected a split "
                                    f"whose images can be read (DATA.BAD_IMAGES 'skip' stands readable images in for "
                                    f"a few bad ones; --check-data lists the files that cannot be read)")
            if batch.images is not None:
                yield batch.images, batch.targets


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
    """timm's training transform: random resized crop, flip, RandAugment, normalisation, random erasing (unless
    AUG.ERASE_AFTER_MIXUP moves it to the batch, `build_batch_augmentation`).

    Every posterize op of the auto-augmentation uses `posterize`, which accepts the 0 bits timm asks for.
    """
    aug = cfg.AUG
    transform = create_transform(
        cfg.DATA.IMG_SIZE, is_training=True, scale=tuple(aug.SCALE), ratio=tuple(aug.RATIO), hflip=aug.HFLIP,
        color_jitter=aug.COLOR_JITTER or None, auto_augment=aug.AUTO_AUGMENT or None,
        interpolation=cfg.DATA.INTERPOLATION, mean=tuple(cfg.DATA.MEAN), std=tuple(cfg.DATA.STD),
        re_prob=0. if aug.ERASE_AFTER_MIXUP else aug.REPROB, re_mode=aug.REMODE, re_count=aug.RECOUNT)
    for op in _augment_ops(transform):
        if op.name.startswith('Posterize'):
            op.aug_fn = posterize
    return transform


def eval_transform(cfg: CN):
    """Resize to floor(S / crop_pct) (shorter side, or square with 'squash'), centre crop S, normalise."""
    return create_transform(
        cfg.DATA.IMG_SIZE, is_training=False, interpolation=_eval_interpolation(cfg), mean=tuple(cfg.DATA.MEAN),
        std=tuple(cfg.DATA.STD), crop_pct=cfg.TEST.CROP_PCT, crop_mode=cfg.TEST.CROP_MODE)


def build_batch_augmentation(cfg: CN, device: torch.device) -> Optional[Callable[[Tensor, Tensor],
                                                                             Tuple[Tensor, Tensor]]]:
    """What the training loop does to each batch of (images, labels) on `device`: mixup / CutMix (soft labels),
    then, with AUG.ERASE_AFTER_MIXUP, random erasing of the mixed images; None where it does nothing."""
    aug = cfg.AUG
    mixup = None
    if mixup_active(cfg):
        mixup = Mixup(
            mixup_alpha=aug.MIXUP, cutmix_alpha=aug.CUTMIX, cutmix_minmax=aug.CUTMIX_MINMAX, prob=aug.MIXUP_PROB,
            switch_prob=aug.MIXUP_SWITCH_PROB, mode=aug.MIXUP_MODE, label_smoothing=cfg.MODEL.LABEL_SMOOTHING,
            num_classes=cfg.MODEL.NUM_CLASSES)
    if not (aug.ERASE_AFTER_MIXUP and aug.REPROB > 0):
        return mixup
    erasing = RandomErasing(aug.REPROB, mode=aug.REMODE, max_count=aug.RECOUNT, device=device)

    def mix_then_erase(images: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
        if mixup is not None:
            images, labels = mixup(images, labels)
        return erasing(images), labels

    return mix_then_erase


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


def build_train_loader(cfg: CN, dataset: ImageFolderSplit, info: DistInfo) -> ImageLoader:
    """Shuffled per epoch (DistributedSampler seeded by SEED, or repeated augmentation, also on one process, as
    DeiT's RASampler: AUG.REPEATED_AUG draws of each image, floor(N / 256) * 256 samples an epoch in all from 256
    images on); full batches only. Each sample's augmentation is drawn from its own seed (`SkipSampler`,
    `SeededSamples`), so a resumed run repeats it with any number of workers."""
    if cfg.AUG.REPEATED_AUG > 1:
        base = RepeatAugSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                num_repeats=cfg.AUG.REPEATED_AUG)
    else:
        base = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                  seed=cfg.SEED)
    if len(base) < cfg.DATA.BATCH_SIZE:
        raise UsageError(f"DATA.BATCH_SIZE {cfg.DATA.BATCH_SIZE} is larger than the {len(base)} training images "
                         f"each of the {info.world_size} processes gets; expected a smaller batch")
    return ImageLoader(
        dataset, seeded=True, batch_size=cfg.DATA.BATCH_SIZE, sampler=SkipSampler(base, cfg.SEED, info.rank),
        num_workers=_workers(cfg), pin_memory=cfg.DATA.PIN_MEMORY and info.device.type == 'cuda', drop_last=True,
        # each new iterator draws the workers' base seed: from a generator of its own, not the run's torch stream
        generator=torch.Generator())


def build_eval_loader(cfg: CN, dataset: ImageFolderSplit, info: DistInfo, batch_size: int) -> ImageLoader:
    return ImageLoader(
        dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), info.rank, info.world_size),
        num_workers=_workers(cfg), pin_memory=cfg.DATA.PIN_MEMORY and info.device.type == 'cuda', drop_last=False)


def eval_batch_size(cfg: CN) -> int:
    return cfg.TEST.BATCH_SIZE or int(1.5 * cfg.DATA.BATCH_SIZE)
