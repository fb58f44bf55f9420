"""Dataset scan and bad files: a symlink loop is followed once and each file counted once; broken links, link loops,
FIFOs, empty, unreadable, non-image and truncated files follow DATA.BAD_IMAGES ('error': one line naming the file
and exit status 2, before training where the scan or --check-data can tell; 'skip': logged and counted); class
folders that do not match are named; a bad validation image after an epoch's training leaves that epoch saved.
Workers started by fork, forkserver or spawn load the same batches."""
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

import engine.data
import engine.loops
from engine.cli import eval_main, train_main
from engine.config import ConfigError, load_config
from engine.data import (BadImage, build_eval_loader, build_train_loader, class_difference, eval_transform,
                         load_split, read_image, train_transform)
from engine.distributed import DistInfo
from engine.errors import USAGE_EXIT_CODE, BadImageError, UsageError, run_cli
from engine.loops import evaluate
from digits_subset import copy_digits_subset

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml')
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu'))
TRAIN_PER_CLASS, VAL_PER_CLASS = 12, 4  # 120 training images: 7 updates of 16 per epoch
# with one more file, batches of 11 use every image: a bad one is met in every epoch
ELEVENS = ['DATA.BATCH_SIZE', '11']
TIMING = ('epoch_seconds', 'images_per_second')
NOBODY = 65534


@pytest.fixture
def data(tmp_path, digits) -> Path:
    """A small copy of the digits folder: 12 training and 4 validation images per class."""
    return copy_digits_subset(digits, tmp_path / 'data', TRAIN_PER_CLASS, VAL_PER_CLASS)


def truncated_jpeg(path: Path) -> Path:
    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, 'JPEG')
    path.write_bytes(buffer.getvalue()[:len(buffer.getvalue()) // 2])
    return path


# files the scan can judge without opening them: (name, how to make it, the reason named, as a pattern)
SCAN_BAD = {
    'broken link': ('broken.png', lambda p: p.symlink_to('nowhere.png'),
                    re.escape("is a broken symbolic link (to 'nowhere.png')")),
    'link loop': ('loop.png', lambda p: p.symlink_to(p.name), 'is a symbolic link loop'),
    'empty': ('empty.png', lambda p: p.write_bytes(b''), re.escape('is empty (0 bytes)')),
    'fifo': ('fifo.png', os.mkfifo, 'is a FIFO, not a regular file'),
}
# files only a decode can judge
DECODE_BAD = {
    'non-image': ('notes.png', lambda p: p.write_text('not an image'),
                  re.escape('is not an image (Pillow cannot identify its format)')),
    'truncated jpeg': ('truncated.jpg', truncated_jpeg,
                       r'cannot be decoded \(OSError: image file is truncated \(\d+ bytes not processed\)\)'),
}
EXPECTED = re.escape("; expected images that can be read (DATA.BAD_IMAGES 'error'; 'skip' leaves such files out")


def make_bad(folder: Path, kind: str) -> Path:
    name, make, _ = {**SCAN_BAD, **DECODE_BAD}[kind]
    make(folder / name)
    return folder / name


def train_argv(output: Path, data: Path, *opts: str):
    return ['--cfg', TINY, '--output', str(output), '--data-path', str(data), '--opts', 'DATA.DATASET', 'imagefolder',
            'TRAIN.EPOCHS', '1', *opts]


def error_line(capsys) -> str:
    """The last line on stderr (a progress bar before it ends with a carriage return); no traceback before it."""
    err = capsys.readouterr().err
    assert 'Traceback' not in err, err
    return err.replace('\r', '\n').rstrip('\n').split('\n')[-1]


def records(output: Path):
    with open(output / 'log.jsonl') as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def test_a_directory_symlink_loop_is_followed_once_and_each_file_counted_once(data):
    train = data / 'train'
    plain = load_split(str(data), 'train', None, 10).samples
    (train / '6' / 'loopdir').symlink_to('..')
    (train / '4' / 'fives').symlink_to('../5')
    first_seven = sorted((train / '7').iterdir())[0]
    (train / '7' / 'again.png').symlink_to(first_seven.name)
    # torchvision's scan follows the loop until the links nest too deep, labelling every copy 6
    looped = ImageFolder(str(train))
    assert len(looped) > 20 * len(plain)
    assert sum(target == 6 for _, target in looped.samples) > 0.9 * len(looped)

    (train / 'loop').symlink_to('loop')  # neither a class folder nor an image
    dataset = load_split(str(data), 'train', None, 10)
    assert dataset.samples == plain
    assert dataset.notes == [
        f"{train / '4' / 'fives'} leads to {train / '5'}, scanned once: not followed",
        f"{train / '6' / 'loopdir'} leads to {train}, scanned once: not followed",
        f"1 file(s) reached a second time through links within their class were counted once "
        f"({train / '7' / 'again.png'} is {first_seven})",
    ]


def test_a_file_linked_into_another_class_counts_in_both_as_torchvision_has_it(data):
    """A link (or hard link) in one class to a file of another took the file away from its own class: the class
    first in scan order labelled it, and the other lost it."""
    train = data / 'train'
    plain = load_split(str(data), 'train', None, 10).samples
    dog = sorted((train / '7').iterdir())[0]
    (train / '2' / 'alias.png').symlink_to(dog)
    os.link(sorted((train / '8').iterdir())[0], train / '1' / 'copy.png')
    (train / '9' / 'sub').mkdir()  # and a link to a subfolder of another class, which held it alone
    moved = sorted((train / '9').glob('*.png'))[0]
    moved.rename(train / '9' / 'sub' / moved.name)
    (train / '3' / 'linked').symlink_to(train / '9' / 'sub')
    plain = [(str(train / '9' / 'sub' / moved.name) if path == str(moved) else path, target) for path, target in plain]
    dataset = load_split(str(data), 'train', None, 10)
    assert sorted(dataset.samples) == sorted(ImageFolder(str(train)).samples) == sorted(
        plain + [(str(train / '2' / 'alias.png'), 2), (str(train / '1' / 'copy.png'), 1),
                 (str(train / '3' / 'linked' / moved.name), 3)])
    assert dataset.notes == [f"3 file(s) are in more than one class, through links, and count in each "
                             f"({dog} is {train / '2' / 'alias.png'}, ...)"]


@pytest.mark.parametrize('kind', SCAN_BAD)
def test_a_bad_file_the_scan_finds_stops_the_run_before_anything_with_one_line(tmp_path, data, capsys, kind):
    bad = make_bad(data / 'train' / '3', kind)
    output = tmp_path / 'run'
    assert run_cli(train_main, train_argv(output, data)) == USAGE_EXIT_CODE
    assert re.fullmatch(rf"error: image {re.escape(repr(str(bad)))} {SCAN_BAD[kind][2]}{EXPECTED}\)",
                        error_line(capsys))
    assert not output.exists()


def test_several_bad_files_are_counted_in_the_one_line(data):
    for kind in SCAN_BAD:
        make_bad(data / 'val' / '8', kind)
    with pytest.raises(UsageError, match=rf"^image '{data}/val/8/broken.png' is a broken symbolic link \(to "
                                         rf"'nowhere.png'\) \(and 3 more bad file\(s\) in {data}/val\){EXPECTED}"):
        load_split(str(data), 'val', None, 10)


def test_an_unreadable_file_is_named_by_the_scan(data):
    bad = data / 'train' / '2' / 'secret.png'
    shutil.copy(next((data / 'train' / '2').iterdir()), bad)
    bad.chmod(0)
    if os.geteuid() != 0:
        with pytest.raises(UsageError, match=rf"^image '{bad}' cannot be read \(Permission denied\); expected"):
            load_split(str(data), 'train', None, 10)
        return
    # the superuser reads every file: scan as an unprivileged user, from inside the data folder (its parents are
    # private to the superuser)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(data)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                load_split('.', 'train', None, 10)
                os.write(write_end, b'no error')
            except UsageError as e:
                os.write(write_end, str(e).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as f:
        assert f.read().startswith("image './train/2/secret.png' cannot be read (Permission denied); expected")


def test_a_fifo_that_appears_after_the_scan_is_reported_without_blocking(data):
    dataset = load_split(str(data), 'train', None, 10)
    path, target = dataset.samples[5]
    os.remove(path)
    os.mkfifo(path)
    def waited(signum, frame):
        raise TimeoutError(f"reading {path} blocked")

    # a read of the FIFO would wait for a writer forever: fail instead
    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(10)
    try:
        image, got_target, bad = dataset[5]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert (image, got_target) == (None, target)
    assert [str(b) for b in bad] == [f"image {path!r} is a FIFO, not a regular file"]


@pytest.mark.parametrize('kind', DECODE_BAD)
def test_a_file_that_does_not_decode_stops_the_run_in_a_worker_with_one_line(tmp_path, data, capsys, kind):
    bad = make_bad(data / 'train' / '3', kind)
    output = tmp_path / 'run'
    assert run_cli(train_main, train_argv(output, data, 'DATA.NUM_WORKERS', '1')) == USAGE_EXIT_CODE
    assert re.fullmatch(rf"error: image {re.escape(repr(str(bad)))} {DECODE_BAD[kind][2]}{EXPECTED}"
                        rf", --check-data finds them before training\)", error_line(capsys))
    assert not (output / 'last.pth').exists()


def test_repeated_augmentation_draws_each_image_three_times_on_one_process_too(digits):
    """DeiT's loop (and PVT's and SimA's) takes its RASampler on any number of processes: one process draws each
    image 3 times in a row, floor(N / 256) * 256 samples an epoch (it drew every image once); two processes split
    those samples."""
    cfg = load_config(TINY, ['DATA.DATA_PATH', str(digits), 'AUG.REPEATED_AUG', '3'])
    train_set = load_split(str(digits), 'train', train_transform(cfg), 10)
    loader = build_train_loader(cfg, train_set, CPU)
    loader.sampler.set_epoch(0)
    drawn = [index for index, _ in loader.sampler]
    assert len(train_set) == 1437 and len(drawn) == 1280 == len(loader) * cfg.DATA.BATCH_SIZE
    assert all(drawn[i] == drawn[i + 1] == drawn[i + 2] for i in range(0, 1278, 3)) and len(set(drawn)) == 427
    halves = [build_train_loader(cfg, train_set, DistInfo(rank, 2, rank, torch.device('cpu'))) for rank in (0, 1)]
    for half in halves:
        half.sampler.set_epoch(0)
    assert [len(list(half.sampler)) for half in halves] == [640, 640]


# Python 3.14 starts DataLoader workers by forkserver on Linux, and macOS and Windows start them by spawn: the
# dataset, its transforms and the collate function reach those workers pickled, not inherited. One worker: what a
# worker draws depends on each sample's seed alone (SeededSamples), and each worker started by forkserver or spawn
# imports torch and the engine again, seconds of the suite.
def test_the_training_loader_gives_the_same_batches_however_its_workers_start(data):
    cfg = load_config(TINY, ['DATA.DATASET', 'imagefolder', 'DATA.DATA_PATH', str(data), 'DATA.NUM_WORKERS', '1',
                             'AUG.AUTO_AUGMENT', 'rand-m9-mstd0.5-inc1', 'AUG.REPROB', '0.25', *ELEVENS])
    batches = {}
    for start_method in ('fork', 'forkserver', 'spawn'):
        loader = build_train_loader(cfg, load_split(str(data), 'train', train_transform(cfg), 10), CPU)
        loader.multiprocessing_context = start_method
        loader.sampler.set_epoch(1)
        batches[start_method] = list(itertools.islice(loader, 3))
    assert [images.shape[0] for images, _ in batches['fork']] == [11] * 3
    for start_method in ('forkserver', 'spawn'):
        for (images, targets), (want_images, want_targets) in zip(batches[start_method], batches['fork']):
            assert torch.equal(images, want_images) and torch.equal(targets, want_targets), start_method


def test_a_bad_image_error_is_printed_by_the_rank_that_met_it(monkeypatch, capsys):
    monkeypatch.setenv('RANK', '1')
    monkeypatch.setenv('WORLD_SIZE', '2')

    def raises(error):
        def main(argv):
            raise error
        return main

    assert run_cli(raises(UsageError('every rank says this')), []) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == ''  # rank 0 says it
    assert run_cli(raises(BadImageError("image 'x.png' is empty (0 bytes)")), []) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == "error: image 'x.png' is empty (0 bytes)\n"


def test_a_split_of_unreadable_files_stops_in_one_line_in_time_linear_in_its_size(data, tmp_path, capsys):
    """Under 'skip', a split whose files all fail to decode (a dataset cloned without its Git LFS objects) trained
    epochs of no step with a loss of 0 and evaluated 'top-1 0.00 on 1 image' with status 0, and each training sample
    tried every other file: time quadratic in the split."""
    for path in (p for p in data.rglob('*') if p.is_file() and p.suffix == '.png'):
        path.write_text('version https://git-lfs.github.com/spec/v1\n')
    cfg = load_config(TINY, ['DATA.DATASET', 'imagefolder', 'DATA.DATA_PATH', str(data), 'DATA.BAD_IMAGES', 'skip',
                             *ELEVENS])
    train_set = load_split(str(data), 'train', train_transform(cfg), 10, 'skip', replace_bad=True)
    image, _, met = train_set[0]  # 32 files tried, all different, then the loader stops
    assert image is None and len({b.path for b in met}) == len(met) == engine.data._REPLACEMENT_ATTEMPTS == 32
    assert run_cli(train_main, train_argv(tmp_path / 'run', data, 'DATA.BAD_IMAGES', 'skip')) == USAGE_EXIT_CODE
    assert re.fullmatch(rf"error: none of 32 files tried in turn for one training image of {re.escape(str(data))}/"
                        rf"train can be read \(the first: image '.*' is not an image \(Pillow cannot identify its "
                        rf"format\)\); expected a split whose images can be read \(DATA.BAD_IMAGES 'skip' stands "
                        rf"readable images in for a few bad ones; --check-data lists the files that cannot be read\)",
                        error_line(capsys))
    assert not (tmp_path / 'run' / 'last.pth').exists()
    val_set = load_split(str(data), 'val', eval_transform(cfg), 10, 'skip')
    loader = build_eval_loader(cfg, val_set, CPU, 24)
    with pytest.raises(UsageError, match=r"^the evaluation read no image: DATA.BAD_IMAGES 'skip' left out every file "
                                         r"as unreadable \(40 on this process, the first here: .*\); expected a split "
                                         r"with images that can be read \(--check-data lists the files that "
                                         r"cannot\)$"):
        evaluate(torch.nn.Linear(1, 1), loader, CPU)


def test_evaluation_builds_no_autograd_graph():
    """A change to evaluate() left its no_grad decorator on another function: validation kept every activation for
    a backward pass that never came."""
    grad_enabled = []

    class Recording(torch.nn.Linear):
        def forward(self, x):
            grad_enabled.append(torch.is_grad_enabled())
            return super().forward(x)

    result = evaluate(Recording(8, 10), [(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))], CPU)
    assert grad_enabled == [False] and result['count'] == 4


def test_images_of_16_bit_pixels_are_read_as_8_bits_and_wider_data_is_a_bad_image(tmp_path):
    """Pillow's convert to 'L' or 'RGB' clips one-channel values above 255: a 16-bit grey ramp was read almost all
    white, and 32-bit or floating-point TIFFs all white or all black, without a word."""
    ramp = np.linspace(0, 65535, 256).round().astype(np.uint16).reshape(16, 16)
    Image.fromarray(ramp).save(tmp_path / 'ramp16.png')
    Image.fromarray(ramp.astype(np.int32), mode='I').save(tmp_path / 'ramp32.tif')  # 16-bit values in mode I
    expected = np.round(ramp * (255 / 65535)).astype(np.uint8)
    for name in ('ramp16.png', 'ramp32.tif'):
        assert np.array_equal(np.asarray(read_image(str(tmp_path / name), 'L')), expected)
        assert np.array_equal(np.asarray(read_image(str(tmp_path / name), 'RGB')), np.stack([expected] * 3, axis=-1))
    Image.fromarray(np.linspace(0, 1, 256, dtype=np.float32).reshape(16, 16), mode='F').save(tmp_path / 'float.tif')
    Image.fromarray(np.full((16, 16), 70000, np.int32), mode='I').save(tmp_path / 'wide.tif')
    Image.fromarray(np.ones((16, 16), np.float32), mode='F').save(tmp_path / 'mask.tif')  # whole numbers, as floats
    for name in ('float.tif', 'mask.tif'):
        assert read_image(str(tmp_path / name)) == BadImage(str(tmp_path / name), (
            'cannot be decoded (ValueError: F pixels, floating-point data; expected 8- or 16-bit integer values)'))
    assert read_image(str(tmp_path / 'wide.tif')).reason == ('cannot be decoded (ValueError: I pixels from 70000 to '
                                                            '70000; expected 16-bit values, integers from 0 to 65535)')


def test_an_image_the_transform_cannot_take_is_a_bad_image_named_in_one_line(data):
    """timm's 'border' crop rounds the short side of a 3x2000 image to 0 pixels: a traceback from a DataLoader
    worker, under 'skip' too. It is a bad image now: 'error' names it, 'skip' leaves it out."""
    thin = data / 'val' / '4' / 'thin.png'
    Image.new('RGB', (3, 2000), (90, 30, 200)).save(thin)
    for bad_images in ('error', 'skip'):
        cfg = load_config(TINY, ['DATA.DATASET', 'imagefolder', 'DATA.DATA_PATH', str(data), 'TEST.CROP_MODE',
                                 'border', 'DATA.BAD_IMAGES', bad_images, *ELEVENS])
        val_set = load_split(str(data), 'val', eval_transform(cfg), 10, bad_images)
        loader = build_eval_loader(cfg, val_set, CPU, 24)
        if bad_images == 'error':
            with pytest.raises(BadImageError, match=rf"^image '{re.escape(str(thin))}' of 3x2000 pixels cannot be "
                                                    r"transformed \(height and width must be > 0\); expected images "
                                                    r"that can be read"):
                list(loader)
        else:
            assert sum(targets.shape[0] for _, targets in loader) == len(val_set) - 1
            assert loader.skipped == {str(thin)}


def test_skip_replaces_a_bad_training_image_and_drops_a_bad_validation_image(data):
    cfg = load_config(TINY, ['DATA.DATASET', 'imagefolder', 'DATA.DATA_PATH', str(data), 'DATA.BAD_IMAGES', 'skip',
                             *ELEVENS])
    bad = truncated_jpeg(data / 'train' / '0' / '00.jpg')  # the first file of class 0
    train_set = load_split(str(data), 'train', None, 10, 'skip', replace_bad=True)
    assert train_set.samples[0] == (str(bad), 0) and len(train_set) == 121
    image, target, met = train_set[0]
    stride = engine.data._spread_stride(121)  # 74: the replacement is taken from another folder
    assert stride == 74 and math.gcd(stride, 121) == 1
    replacement, replacement_target, _ = train_set[stride]
    assert target == replacement_target == 6 and np.array_equal(np.asarray(image), np.asarray(replacement))
    assert [b.path for b in met] == [str(bad)]

    train_set.transform = train_transform(cfg)
    loader = build_train_loader(cfg, train_set, CPU)
    loader.sampler.set_epoch(0)
    sizes = [images.shape[0] for images, _ in loader]
    assert sizes == [11] * 11 and loader.skipped == {str(bad)}

    val_bad = make_bad(data / 'val' / '4', 'non-image')
    val_set = load_split(str(data), 'val', eval_transform(cfg), 10, 'skip')
    loader = build_eval_loader(cfg, val_set, CPU, 24)
    assert sum(targets.shape[0] for _, targets in loader) == len(val_set) - 1 == 40
    assert loader.skipped == {str(val_bad)}


def test_skip_logs_each_bad_file_and_counts_them_per_epoch(tmp_path, data):
    scan_bad = [make_bad(data / 'train' / '3', kind) for kind in SCAN_BAD]
    train_bad = make_bad(data / 'train' / '5', 'truncated jpeg')
    val_bad = make_bad(data / 'val' / '1', 'non-image')
    output = tmp_path / 'run'
    argv = train_argv(output, data, 'DATA.BAD_IMAGES', 'skip', 'TRAIN.EPOCHS', '2', *ELEVENS)
    assert run_cli(train_main, argv) == 0
    log = (output / 'train.log').read_text()

    def skipped(path: Path, reason: str) -> int:
        return len(re.findall(rf"skipped image {re.escape(repr(str(path)))}, which {reason} \(DATA.BAD_IMAGES "
                              rf"'skip'\)\n", log))

    for path, kind in zip(scan_bad, SCAN_BAD):
        assert skipped(path, SCAN_BAD[kind][2]) == 1
    assert f"{data / 'train'}: 4 bad file(s) left out, 121 images kept" in log
    # the files only a decode finds: named once, counted in every epoch
    assert skipped(train_bad, DECODE_BAD['truncated jpeg'][2]) == 1
    assert skipped(val_bad, DECODE_BAD['non-image'][2]) == 1
    for epoch in (0, 1):
        assert (f"epoch {epoch}: skipped 1 training and 1 validation image(s) that could not be read "
                f"(DATA.BAD_IMAGES 'skip')") in log
    assert [(r['epoch'], r['step'], r['skipped_images']) for r in records(output)] == [(0, 11, 2), (1, 22, 2)]

    # the replacements are the same in every run
    again = tmp_path / 'again'
    assert run_cli(train_main, train_argv(again, data, *argv[argv.index('--opts') + 3:])) == 0
    assert records(again) == records(output)
    first, second = (torch.load(folder / 'last.pth', weights_only=True)['model'] for folder in (output, again))
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_check_data_finds_a_truncated_image_before_training(tmp_path, data, capsys, monkeypatch):
    """...and shows its progress as training does: whole lines where stderr is no terminal, not bar updates."""
    monkeypatch.setattr(engine.loops, 'PLAIN_PROGRESS_SECONDS', 0.0)
    bad = make_bad(data / 'train' / '9', 'truncated jpeg')
    output = tmp_path / 'run'
    assert run_cli(train_main, ['--check-data', *train_argv(output, data)]) == USAGE_EXIT_CODE
    out, err = capsys.readouterr()
    assert '\r' not in err and 'Traceback' not in err and 'check train 2/2 (100%)' in out, err
    assert re.fullmatch(rf"error: image {re.escape(repr(str(bad)))} {DECODE_BAD['truncated jpeg'][2]}{EXPECTED}\)",
                        err.rstrip('\n').split('\n')[-1])
    log = (output / 'train.log').read_text()
    assert 'updates per epoch' not in log and not (output / 'last.pth').exists()

    assert run_cli(train_main, ['--check-data', *train_argv(output, data, 'DATA.BAD_IMAGES', 'skip')]) == 0
    log = (output / 'train.log').read_text()
    assert re.search(rf"skipped image {re.escape(repr(str(bad)))}, which {DECODE_BAD['truncated jpeg'][2]}", log)
    assert '120 training and 40 validation images' in log
    assert records(output)[0]['skipped_images'] == 0  # left out before training: no pass met it

    val_bad = make_bad(data / 'val' / '6', 'truncated jpeg')
    argv = ['--checkpoint', str(output / 'last.pth'), '--data-path', str(data), '--opts', 'DATA.BAD_IMAGES', 'error']
    assert run_cli(eval_main, ['--check-data', *argv]) == USAGE_EXIT_CODE
    assert re.fullmatch(rf"error: image {re.escape(repr(str(val_bad)))} {DECODE_BAD['truncated jpeg'][2]}{EXPECTED}\)",
                        error_line(capsys))


def test_a_corrupt_validation_image_after_an_epoch_leaves_its_checkpoint_and_the_run_resumes_exactly(
        tmp_path, data, capsys):
    reference = tmp_path / 'reference'
    assert run_cli(train_main, train_argv(reference, data, 'TRAIN.EPOCHS', '2')) == 0

    output = tmp_path / 'run'
    val_image = sorted((data / 'val' / '7').iterdir())[0]
    good = val_image.read_bytes()
    val_image.write_bytes(good[:len(good) // 2])
    assert run_cli(train_main, train_argv(output, data, 'TRAIN.EPOCHS', '2')) == USAGE_EXIT_CODE
    assert error_line(capsys).startswith(f"error: image {str(val_image)!r} cannot be decoded (OSError: image file is "
                                         f"truncated)")
    saved = torch.load(output / 'last.pth', weights_only=True)
    assert (saved['epoch'], saved['epoch_batches'], saved['step'], saved['metrics']) == (0, 7, 7, None)
    assert saved['train_record'].keys() == {'train_loss', 'lr', 'epoch_seconds', 'images_per_second',
                                            'skipped_train_images'}
    assert not (output / 'log.jsonl').exists()

    val_image.write_bytes(good)
    assert run_cli(train_main, train_argv(output, data, 'TRAIN.EPOCHS', '2')) == 0  # validates epoch 0, then on
    assert 'resumed from' in (output / 'train.log').read_text()
    assert records(output) == records(reference)
    for name in ('last.pth', 'best.pth'):
        resumed, uninterrupted = (torch.load(folder / name, weights_only=True) for folder in (output, reference))
        assert resumed['step'] == uninterrupted['step']
        for key in ('model', 'model_ema'):
            for tensor in uninterrupted[key]:
                assert torch.equal(resumed[key][tensor], uninterrupted[key][tensor]), (name, key, tensor)


def test_class_folders_that_differ_are_named(tmp_path, data, capsys):
    (data / 'val' / '9').rename(data / 'val' / 'nine')
    assert run_cli(train_main, train_argv(tmp_path / 'run', data)) == USAGE_EXIT_CODE
    assert error_line(capsys) == (f"error: the class folders of {data}/train and {data}/val differ (only in "
                                  f"train/: 9; only in val/: nine); expected the same classes")
    # the same name composed in one split and decomposed in the other, as macOS writes it, printed alike
    assert class_difference(['\u00f1and\u00fa'], ['n\u0303andu\u0301'], 'train/', 'val/') == (
        "only in train/: \u00f1and\u00fa; only in val/: n\u0303andu\u0301; '\\xf1and\\xfa' and "
        "'n\\u0303andu\\u0301' are one name in two Unicode forms (composed and decomposed characters)")
    (data / 'train' / '.ipynb_checkpoints').mkdir()
    with pytest.raises(UsageError, match=r"has 11 class folders, among them the hidden \.ipynb_checkpoints but the "
                                         r"model has 10 classes"):
        load_split(str(data), 'train', None, 10)


def test_the_bad_image_policy_is_a_checked_choice():
    assert load_config(TINY).DATA.BAD_IMAGES == 'error'
    with pytest.raises(ConfigError, match=r"^config key DATA.BAD_IMAGES is 'ignore'; expected one of 'error', "
                                          r"'skip'$"):
        load_config(TINY, ['DATA.BAD_IMAGES', 'ignore'])


def test_read_image_decodes_fully(data):
    good = next((data / 'train' / '1').iterdir())
    assert read_image(str(good)).mode == 'RGB'
    cut = truncated_jpeg(data / 'cut.jpg')
    assert re.fullmatch(rf"image {re.escape(repr(str(cut)))} {DECODE_BAD['truncated jpeg'][2]}",
                        str(read_image(str(cut))))


def torchrun(*args: str, cwd: Path):
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
               str(REPO / 'train.py'), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_two_processes_check_the_data_together(tmp_path, data):
    make_bad(data / 'train' / '2', 'truncated jpeg')
    make_bad(data / 'val' / '3', 'truncated jpeg')
    output = tmp_path / 'checked'
    # each process decodes half of the files; both leave out what either found
    result = torchrun('--check-data', *train_argv(output, data, 'DATA.BAD_IMAGES', 'skip'), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (output / 'train.log').read_text()
    assert re.search(rf"--check-data: decoded the 121 images of {re.escape(str(data / 'train'))} in [\d.]+ s, 1 bad",
                     log)
    assert '120 training and 40 validation images' in log
    assert [(r['epoch'], r['step'], r['skipped_images']) for r in records(output)] == [(0, 3, 0)]
