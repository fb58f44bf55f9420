"""Does the training loop keep the model busy? `train.py`'s images/s beside what the model and the data pipeline
each sustain alone, on ImageNet-shaped images.

Unless `--data` names an image folder (`train/<class>/*.jpg`, `val/<class>/*.jpg`), a temporary one is written:
JPEGs of ImageNet's median size (500x375, smooth content, about ImageNet's bytes per image). Then, with the
recipe of `--cfg` (its transforms, mixup, AMP, optimizer):

- loader: images/s of the training loader alone (decode, random resized crop, RandAugment, erasing, then mixup),
  with `DATA.NUM_WORKERS` worker processes;
- model: images/s of the training step alone (forward, loss, backward, optimizer step) on a batch in memory;
- train.py: images/s of `train.py` on the same data (its `log.jsonl`), loader and model together: the median of
  its epochs after the first.

The loop keeps the model busy when train.py's rate is close to the model's, which needs the loader's to be above
it. The loader's and the model's figures are medians over `--repeats` timed passes; the table states the device,
versions, command and date. Example (one process, the DeiT recipe):

    python scripts/train_throughput.py --cfg configs/base/deit.yaml --model softmax_deit_tiny \
        --out docs/train_throughput
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import numpy as np
    import torch
    from PIL import Image

    import timm

    from engine.build import (
        autocast_dtype, check_model_config, create_criterion, create_optimizer, create_training_model,
    )
    from engine.checkpoint import prepare_script_out, write_table_keeping_notes
    from engine.config import load_config
    from engine.data import (
        build_batch_augmentation, build_train_loader, check_splits, class_folders, image_channels, image_mode,
        load_split, train_transform,
    )
    from engine.distributed import DistInfo, resolve_device
    from engine.errors import UsageError, refuse_below, run_cli
    from engine.loops import autocast

# ImageNet-1k's median image is 500x375; its JPEGs average about 110 KB.
IMAGE_SIZE = (500, 375)


def write_images(root: str, classes: int, per_class: int, seed: int = 0) -> None:
    """`per_class` JPEGs per class under root/train and two per class under root/val: smooth random content
    (coarse noise resized bicubically), so decoding costs about what a photograph of that size costs."""
    rng = np.random.default_rng(seed)
    for split, count in (('train', per_class), ('val', 2)):
        for c in range(classes):
            folder = os.path.join(root, split, f'class_{c:03d}')
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                coarse = rng.integers(0, 256, size=(IMAGE_SIZE[1] // 6, IMAGE_SIZE[0] // 6, 3), dtype=np.uint8)
                image = Image.fromarray(coarse).resize(IMAGE_SIZE, Image.Resampling.BICUBIC)
                image.save(os.path.join(folder, f'{i:04d}.jpg'), quality=90)


def timed_passes(step, count: int, repeats: int, warmup: int) -> List[float]:
    """Seconds of `count` calls of `step()`, `repeats` times, after `warmup` calls."""
    for _ in range(warmup):
        step()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            step()
        rounds.append(time.perf_counter() - start)
    return rounds


def loader_rate(cfg, info: DistInfo, batches: int, repeats: int) -> float:
    """Median images/s of the training loader with mixup (and erasing after it), over passes of `batches`
    batches."""
    dataset = load_split(cfg.DATA.DATA_PATH, 'train', train_transform(cfg), cfg.MODEL.NUM_CLASSES,
                         image_mode=image_mode(cfg))
    loader = build_train_loader(cfg, dataset, info)
    augment = build_batch_augmentation(cfg, info.device)
    epoch = 0
    iterator = None

    def step():
        nonlocal iterator, epoch
        while True:
            try:
                images, targets = next(iterator)
                break
            except (StopIteration, TypeError):
                epoch += 1
                loader.sampler.set_epoch(epoch)
                iterator = iter(loader)
        if augment is not None:
            augment(images, targets)

    step()  # starts the workers, outside the timing
    rounds = timed_passes(step, batches, repeats, warmup=1)
    return cfg.DATA.BATCH_SIZE * batches / statistics.median(rounds)


def model_rate(cfg, info: DistInfo, steps: int, repeats: int) -> float:
    """Median images/s of the training step on one batch held in memory."""
    torch.manual_seed(cfg.SEED)
    model = create_training_model(cfg, info.device).train()  # as train.py builds it
    optimizer = create_optimizer(cfg, model, cfg.TRAIN.BASE_LR)
    criterion = create_criterion(cfg)
    size, batch = cfg.DATA.IMG_SIZE, cfg.DATA.BATCH_SIZE
    images = torch.randn(batch, image_channels(cfg), size, size, device=info.device)
    targets = torch.randint(cfg.MODEL.NUM_CLASSES, (batch,), device=info.device)
    augment = build_batch_augmentation(cfg, info.device)
    if augment is not None:
        images, targets = augment(images, targets)
    dtype = autocast_dtype(cfg, info.device, cfg.AMP.ENABLED)
    scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.AMP.ENABLED and dtype == 'float16')

    def step():
        with autocast(info.device, cfg.AMP.ENABLED, dtype):
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if info.device.type == 'cuda':
            torch.cuda.synchronize(info.device)

    rounds = timed_passes(step, steps, repeats, warmup=2)
    return batch * steps / statistics.median(rounds)


def train_py_rate(args: argparse.Namespace, data: str, output: str, epochs: int) -> float:
    """Median images/s that `train.py` logs for its epochs after the first (which also starts the workers) of
    `epochs` (2 or more) on `data`: one epoch's rate varies by several percent from the next."""
    command = [sys.executable, os.path.join(ROOT, 'train.py'), '--cfg', args.cfg, '--opts', *train_opts(args, data),
               'OUTPUT', output, 'TRAIN.EPOCHS', str(epochs), 'TRAIN.WARMUP_EPOCHS', '0', 'EMA.EVAL', 'False']
    # with this process's thread count, which the loader and step measurements ran under
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if done.returncode:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        reason = said[-1].removeprefix('error: ') if said else f'exit status {done.returncode}'
        raise UsageError(f"train.py failed, so no rate of it: {reason}")
    with open(os.path.join(output, 'log.jsonl')) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return statistics.median(record['images_per_second'] for record in records[1:])


def train_opts(args: argparse.Namespace, data: str) -> List[str]:
    # the images are an ImageFolder (written here or --data) whatever dataset the recipe names, the demo's included
    opts = ['DATA.DATASET', 'imagefolder', 'DATA.DATA_PATH', data, 'MODEL.NUM_CLASSES', str(args.classes),
            'DEVICE', args.device]
    if args.model:
        opts += ['MODEL.NAME', args.model]
    if args.batch_size:
        opts += ['DATA.BATCH_SIZE', str(args.batch_size)]
    if args.workers is not None:
        opts += ['DATA.NUM_WORKERS', str(args.workers)]
    return opts + list(args.opts)


def write_table(args: argparse.Namespace, cfg, rates: Dict[str, float], seconds: float) -> str:
    device = (torch.cuda.get_device_name() if args.device == 'cuda'
              else f'CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)')
    precision = (f'{autocast_dtype(cfg, torch.device(args.device), False)} autocast' if cfg.AMP.ENABLED
                 else 'float32')
    lines = [
        '# Training loop throughput',
        '',
        f'- date: {datetime.date.today().isoformat()} ({seconds / 60:.1f} min)',
        f'- device: {device}; threads {torch.get_num_threads()}; data workers {cfg.DATA.NUM_WORKERS}',
        f'- versions: torch {torch.__version__}, timm {timm.__version__}, Python {platform.python_version()}',
        f'- command: `python scripts/train_throughput.py {shlex.join(sys.argv[1:])}`',
        f'- model {cfg.MODEL.NAME}, batch {cfg.DATA.BATCH_SIZE}, {cfg.DATA.IMG_SIZE}², {precision}, recipe '
        f'{os.path.relpath(args.cfg, ROOT)}' + (f'; {args.note}' if args.note else ''),
        '',
        '| measured | images/s | × the model step alone |',
        '|---|---|---|',
    ]
    model = rates['model step alone']
    for name, rate in rates.items():
        lines.append(f'| {name} | {rate:.1f} | {rate / model:.2f} |')
    text = '\n'.join(lines) + '\n'
    if args.out:
        write_table_keeping_notes(args.out + '.md', text)
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cfg', default=os.path.join(ROOT, 'configs', 'base', 'deit.yaml'), help='training recipe')
    parser.add_argument('--model', default='softmax_deit_tiny', help="MODEL.NAME ('' keeps the config's)")
    parser.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    parser.add_argument('--data', default='', help='an image folder with train/ and val/ (default: generated)')
    parser.add_argument('--classes', type=int, default=None,
                        help='classes of the generated data (default 10); with --data, its class folders')
    parser.add_argument('--per-class', type=int, default=64, help='training images per class when generating')
    parser.add_argument('--batch-size', type=int, default=0, help='DATA.BATCH_SIZE (0 keeps the config\'s)')
    parser.add_argument('--workers', type=int, default=None, help='DATA.NUM_WORKERS (default: the config\'s)')
    parser.add_argument('--threads', type=int, default=0, help='torch threads of this process (0: torch default)')
    parser.add_argument('--batches', type=int, default=4, help='batches per timed pass')
    parser.add_argument('--repeats', type=int, default=3, help='timed passes; figures are their medians')
    parser.add_argument('--epochs', type=int, default=4,
                        help='epochs of the train.py run, 2 or more (the median of all but the first, which starts the '
                             'workers, is reported)')
    parser.add_argument('--note', default='', help='a remark for the table (e.g. a shared machine)')
    parser.add_argument('--out', default='', help='write the table to OUT.md')
    parser.add_argument('opts', nargs=argparse.REMAINDER, help='KEY VALUE config overrides (after --)')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.opts = [o for o in args.opts if o != '--']
    misplaced = next((item for item in args.opts if re.match(r'--[A-Za-z]', item)), None)
    if misplaced is not None:
        parser.error(f"the config overrides after -- take KEY VALUE pairs up to the end of the command, got the option "
                     f"{misplaced} among them; expected {misplaced} before them")
    if len(args.opts) % 2:
        parser.error(f"the config overrides after -- take KEY VALUE pairs, got an odd number of items: "
                     f"{' '.join(args.opts)}")
    refuse_below(parser, {
        '--batches': (args.batches, 1), '--repeats': (args.repeats, 1), '--epochs': (args.epochs, 2),
        '--classes': (args.classes, 1), '--per-class': (args.per_class, 1), '--batch-size': (args.batch_size, 0),
        '--workers': (args.workers, 0), '--threads': (args.threads, 0)})
    try:
        device = resolve_device(args.device)
    except UsageError as e:
        parser.error(f'--device: {e}')
    if args.out:
        prepare_script_out(parser, args.out, prefix=True, suffixes=('.md',), example='throughput')
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.data:
        check_splits(args.data, ['train', 'val'])
        found = len(class_folders(os.path.join(args.data, 'train')))
        if args.classes not in (None, found):
            parser.error(f"--classes {args.classes}: --data {args.data} has {found} class folders in train; expected "
                         f"--classes {found} or none")
        args.classes = found
    elif args.classes is None:
        args.classes = 10
    with tempfile.TemporaryDirectory() as scratch:
        data = args.data or os.path.join(scratch, 'data')
        # the config, the model and a given dataset are checked before minutes of writing images and measuring
        cfg = load_config(args.cfg, train_opts(args, data) + ['OUTPUT', os.path.join(scratch, 'unused')],
                          opts_source='the config overrides after --')
        check_model_config(cfg)
        if not args.data:
            write_images(data, args.classes, args.per_class)
        info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
        rates = {
            'data loader alone': loader_rate(cfg, info, args.batches, args.repeats),
            'model step alone': model_rate(cfg, info, args.batches, args.repeats),
            'train.py (both)': train_py_rate(args, data, os.path.join(scratch, 'run'), args.epochs),
        }
    print(write_table(args, cfg, rates, time.perf_counter() - start))
    return 0


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
