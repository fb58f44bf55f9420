"""Command lines of `train.py` and `eval.py` (plain `python` on one device, or under `torchrun`)."""
import argparse
import json
import os
import sys
from typing import Any, Dict, Sequence

from .build import check_model_config, check_onednn
from .config import describe_model, load_config, parse_args_with_opts
from .data import check_splits, resolve_data_root
from .distributed import cleanup_distributed, init_distributed
from .errors import UsageError
from .evaluation import eval_config, evaluate_weights, throughput
from .hub import weights_file
from .trainer import setup_logging, train

__all__ = ['train_main', 'eval_main']


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--data-path', help='dataset folder with train/ and val/ (DATA.DATA_PATH)')
    parser.add_argument('--check-data', action='store_true',
                        help='decode every image before starting; bad files follow DATA.BAD_IMAGES (error or skip)')
    parser.add_argument('--debug', action='store_true', help='show tracebacks instead of one-line errors')
    parser.add_argument('--opts', nargs=argparse.REMAINDER, default=[], metavar='KEY VALUE',
                        help='config overrides, last on the command line, e.g. --opts TRAIN.EPOCHS 100 '
                             'MODEL.KWARGS.depth 6')


def _overrides(args: argparse.Namespace, mapping: Dict[str, str]) -> Dict[str, Any]:
    """A nested config dict from the command-line flags that were given."""
    result: Dict[str, Any] = {}
    for attr, key in mapping.items():
        value = getattr(args, attr)
        if value is None:
            continue
        node = result
        *parents, leaf = key.split('.')
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return result


def train_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog='train.py', description='Train a registered model: python train.py --cfg FILE --data-path DIR, or '
                                     'torchrun --nproc_per_node=N train.py ... on several devices.')
    parser.add_argument('--cfg', help='YAML config (inherits with BASE); the defaults are the DeiT recipe')
    parser.add_argument('--output', help='output folder for checkpoints and logs (OUTPUT); by default '
                                         'output/<config folder>/<config name>')
    parser.add_argument('--resume', help='training checkpoint to resume (MODEL.RESUME); by default OUTPUT/last.pth')
    parser.add_argument('--pretrained', help='weights to start from (MODEL.PRETRAINED), e.g. for fine-tuning: a '
                                             'checkpoint file, a model name for its released weights, or '
                                             "'local-dir:FOLDER' / 'hf-hub:REPO' of a model saved for the hub")
    parser.add_argument('--pretrained-ema', action='store_true', default=None,
                        help="start from the EMA weights of the --pretrained checkpoint (MODEL.PRETRAINED_EMA)")
    parser.add_argument('--compile', action='store_true', default=None,
                        help='torch.compile the whole model, without graph breaks (TRAIN.COMPILE)')
    parser.add_argument('--onednn', action='store_true', default=None,
                        help="CPU, AMP off: the linear layers' and attention products through oneDNN "
                             '(TRAIN.ONEDNN)')
    parser.add_argument('--batch-size', type=int, help='training images per process (DATA.BATCH_SIZE)')
    _common_arguments(parser)
    args = parse_args_with_opts(parser, argv)
    cfg = load_config(args.cfg, args.opts, _overrides(args, dict(
        data_path='DATA.DATA_PATH', batch_size='DATA.BATCH_SIZE', output='OUTPUT', resume='MODEL.RESUME',
        pretrained='MODEL.PRETRAINED', pretrained_ema='MODEL.PRETRAINED_EMA', compile='TRAIN.COMPILE',
        onednn='TRAIN.ONEDNN')))
    info = init_distributed(cfg.DEVICE, cfg.DIST.BACKEND, cfg.DIST.TIMEOUT_MIN)
    try:
        train(cfg, info, check_data=args.check_data)
    finally:
        cleanup_distributed()
    return 0


def eval_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog='eval.py', description='Top-1/top-5 of a checkpoint on an image-folder validation set, or throughput.')
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--cfg', help='YAML config of the model (default: the config stored in our checkpoint)')
    source.add_argument('--model', help="registered model name, or 'local-dir:FOLDER' / 'hf-hub:REPO' of a model "
                                        'saved by timm.models.save_for_hf; preprocessing from its pretrained config')
    parser.add_argument('--checkpoint', help='our checkpoint (last.pth / best.pth) or an official release file '
                                             '(default with --model: its released weights, downloaded once, or '
                                             'the weights saved with it)')
    parser.add_argument('--ema', action='store_true', help='evaluate the EMA weights of the checkpoint')
    parser.add_argument('--amp', action='store_true', help='evaluate under autocast (AMP.DTYPE); float32 otherwise')
    parser.add_argument('--img-size', type=int, help='input size S (DATA.IMG_SIZE)')
    parser.add_argument('--crop-pct', type=float, help='resize to S / crop_pct, crop S (TEST.CROP_PCT)')
    parser.add_argument('--crop-mode', help="'center' (shorter side), 'squash' (square resize) or 'border' (longer "
                                            "side, padded) (TEST.CROP_MODE)")
    parser.add_argument('--compile', action='store_true',
                        help='torch.compile the whole model, without graph breaks, with TRAIN.COMPILE_MODE and '
                             'TRAIN.COMPILE_BACKEND (the config\'s TRAIN.COMPILE is for training)')
    parser.add_argument('--onednn', action='store_true',
                        help="CPU, float32: the linear layers' and attention products through oneDNN, which "
                             'some CPUs run up to twice as fast as the default library (outputs equal to float32 '
                             'rounding; eager or --compile)')
    parser.add_argument('--throughput', action='store_true',
                        help='print images/s at --batch-size (50 warm-up forwards, 30 timed) instead of accuracy')
    parser.add_argument('--warmup-forwards', type=int, default=50, metavar='N',
                        help='untimed forwards before --throughput measures (default 50, as the official scripts; '
                             'with --compile after one more, which compiles)')
    parser.add_argument('--timed-forwards', type=int, default=30, metavar='N',
                        help='forwards --throughput times (default 30, as the official scripts)')
    parser.add_argument('--batch-size', type=int,
                        help='images per process (TEST.BATCH_SIZE, by default 1.5 x DATA.BATCH_SIZE); with '
                             '--throughput the batch it times (by default DATA.BATCH_SIZE)')
    _common_arguments(parser)
    args = parse_args_with_opts(parser, argv)
    if not args.checkpoint and not args.throughput and not args.model:
        parser.error('--checkpoint is required (except with --model or --throughput)')
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint!r} does not exist or is not a file; expected a checkpoint "
                         f"written by train.py (last.pth / best.pth) or an official release file")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f'--batch-size {args.batch_size}: expected at least 1 image')
    if args.warmup_forwards < 0 or args.timed_forwards < 1:
        parser.error(f'--warmup-forwards {args.warmup_forwards} --timed-forwards {args.timed_forwards}: expected '
                     f'at least 0 warm-up and 1 timed forward')
    overrides = _overrides(args, dict(
        data_path='DATA.DATA_PATH', img_size='DATA.IMG_SIZE', crop_pct='TEST.CROP_PCT', crop_mode='TEST.CROP_MODE'))
    if args.batch_size is not None:
        overrides.setdefault('TEST', {})['BATCH_SIZE'] = args.batch_size
    cfg = eval_config(args.cfg, args.model, args.checkpoint, args.opts, overrides)
    check_model_config(cfg)  # a model it cannot build fails before any download or data scan
    info = init_distributed(cfg.DEVICE, cfg.DIST.BACKEND, cfg.DIST.TIMEOUT_MIN)
    setup_logging(info, stream=sys.stderr)  # stdout keeps only the results
    try:
        if args.onednn:
            check_onednn(info.device, '--amp' if args.amp else None, '--onednn')
        if args.throughput:
            batch_size = args.batch_size or cfg.DATA.BATCH_SIZE
            result = throughput(cfg, info, batch_size, args.checkpoint, ema=args.ema, amp=args.amp,
                                adopt_classes=bool(args.model), warmup=args.warmup_forwards,
                                timed=args.timed_forwards, compile=args.compile, onednn=args.onednn)
            if info.is_main:
                print(f"batch_size {batch_size} throughput {result['throughput']:.1f} images/s")
        else:
            checkpoint = args.checkpoint
            if not checkpoint:
                check_splits(resolve_data_root(cfg, info), ['val'])  # the data first: a download can take minutes
                checkpoint = weights_file(args.model, '--model', info)
            result = evaluate_weights(cfg, info, checkpoint, ema=args.ema, amp=args.amp,
                                      adopt_classes=bool(args.model), check_data=args.check_data,
                                      compile=args.compile, onednn=args.onednn, released=not args.checkpoint)
            if info.is_main:
                print(f"{describe_model(cfg)} ({result['weights']} weights, {result['precision']}): top-1 "
                      f"{result['top1']:.3f} top-5 {result['top5']:.3f} on {result['count']} images")
        if info.is_main:
            print(json.dumps(result), flush=True)
    finally:
        cleanup_distributed()
    return 0

