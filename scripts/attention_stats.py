"""Attention statistics of several models on the same images: a CSV per layer and head, a Markdown table and a
per-layer plot, one line per model.

    python scripts/attention_stats.py --checkpoints softmax=output/softmax/best.pth inline=output/inline/best.pth \
        --data ~/.cache/swappable-attention-zoo/digits/val --max-images 360 --out docs/attention_stats

`--models NAME ...` adds registered models with random weights, or with `--pretrained` their released weights,
and `--models NAME=FILE` a registered model with the weights of a file, such as an official release, which stores
no config (`--opts` overrides their config). Every model records every token's row in every layer (`models.analysis.stats`
defines the statistics). Writes OUT.csv, OUT.md and OUT.png.
"""
import argparse
import csv
import io
import os
import shlex
import sys
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import numpy as np
    import torch
    from yacs.config import CfgNode as CN

    import models  # noqa: F401  (registers the families)
    from engine.analysis import find_images, load_analysis_model, load_images, refuse_unreleased
    from engine.config import parse_args_with_opts
    from engine.checkpoint import atomic_write_text, files_taken_together, prepare_script_out
    from engine.distributed import DistInfo
    from engine.errors import UsageError, exit_for_missing_extra, refuse_below, run_cli
    from engine.loops import Progress
    from engine.trainer import setup_logging
    from models.analysis import record_attention
    from models.checkpoint import is_hub_name
    try:
        from models.analysis.plots import plot_layer_curves
    except ModuleNotFoundError as missing:
        exit_for_missing_extra(missing, 'analysis')
    from models.analysis.stats import STATISTICS, AttentionStatistics

# The per-layer plot's panels.
PLOTTED = ('effective_tokens', 'top5_mass', 'gini', 'negative', 'distance_px', 'collisions')


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='attention_stats.py', description=__doc__.split('\n\n')[0])
    parser.add_argument('--checkpoints', nargs='+', default=[], metavar='[LABEL=]PATH',
                        help="our checkpoints; the label defaults to the stored config's MODEL.KWARGS.attn_type, "
                             "else its MODEL.NAME")
    parser.add_argument('--models', nargs='+', default=[], metavar='NAME[=FILE]',
                        help="registered models (random weights without --pretrained; NAME=FILE: the weights of "
                             "FILE, e.g. an official release), or 'local-dir:FOLDER' / 'hf-hub:REPO' of models saved "
                             "for the hub (their weights)")
    parser.add_argument('--pretrained', action='store_true',
                        help="the released weights of --models' registered names, downloaded once into the cache")
    parser.add_argument('--ema', action='store_true', help="the EMA weights of the checkpoints and files")
    parser.add_argument('--data', required=True, help='an image file or a folder of images (searched recursively)')
    parser.add_argument('--max-images', type=int, default=256,
                        help='images taken from the folder, spread evenly over its sorted files (default 256)')
    parser.add_argument('--batch-size', type=int, default=32, help='images per forward pass (default 32)')
    parser.add_argument('--out', required=True, help='output path without extension: OUT.csv, OUT.md, OUT.png')
    parser.add_argument('--debug', action='store_true', help='show tracebacks instead of one-line errors')
    parser.add_argument('--opts', nargs=argparse.REMAINDER, default=[], metavar='KEY VALUE',
                        help='config overrides for every model, last on the command line, e.g. --opts DATA.IMG_SIZE 32')
    args = parse_args_with_opts(parser, argv)
    if not args.checkpoints and not args.models:
        parser.error('expected --checkpoints or --models')
    if args.pretrained and not args.models:
        parser.error('--pretrained loads the released weights of --models NAME ...; expected --models')
    with_files = [item for item in args.models if model_with_file(item)[1]]
    if args.pretrained and with_files:
        parser.error(f"--pretrained loads the released weights of --models NAME, but {with_files[0]} gives a file's; "
                     f"expected one or the other")
    if args.pretrained:
        refuse_unreleased(parser, args.models)
    if args.ema and not args.checkpoints and not with_files:
        parser.error("--ema reads the EMA weights of checkpoints; expected --checkpoints PATH ... or --models "
                     "NAME=FILE")
    refuse_below(parser, {'--max-images': (args.max_images, 1), '--batch-size': (args.batch_size, 1)})
    prepare_script_out(parser, args.out, prefix=True, suffixes=('.csv', '.md', '.png'), example='stats')
    return args


def labelled_checkpoint(item: str) -> Tuple[str, str]:
    """(label or '', path) of a `--checkpoints` item: a file's path as it stands (sweep folders such as `lr=1e-3`
    hold an '='), else LABEL=PATH split at the first '='."""
    if os.path.isfile(item):
        return '', item
    label, _, path = item.partition('=')
    return (label, path) if path else ('', item)


def model_with_file(item: str) -> Tuple[str, str]:
    """(model name, weights file or '') of a `--models` item, NAME or NAME=FILE (a hub name is one name)."""
    if is_hub_name(item):
        return item, ''
    name, _, path = item.partition('=')
    return name, path


def sources(args: argparse.Namespace) -> List[Tuple[str, str, str, str]]:
    """(label, model name or '', checkpoint or '', its option) of every model to measure."""
    found = [(label, '', path, '--checkpoints') for label, path in map(labelled_checkpoint, args.checkpoints)]
    found += [(name, name, path, '--models') for name, path in map(model_with_file, args.models)]
    return found


def measure(model: torch.nn.Module, inputs: torch.Tensor, batch_size: int, label: str) -> List[Dict[str, object]]:
    image_size = tuple(inputs.shape[-2:])
    summary = AttentionStatistics(image_size)
    starts = range(0, len(inputs), batch_size)
    with torch.no_grad(), Progress(len(starts), label) as progress:
        for start in starts:
            with record_attention(model) as rec:
                model(inputs[start:start + batch_size])
            for name in rec:
                summary.add(rec[name])
            progress.update()
    return summary.rows(label)


def markdown_table(rows: Sequence[Dict[str, object]]) -> List[str]:
    """Per model and layer, every statistic averaged over the heads; then per model, those layer means averaged
    over the layers, each layer weighing the same whatever its number of heads (Swin's stages have 3 to 24)."""
    header = ['model', 'layer'] + list(STATISTICS)
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    groups: Dict[Tuple[str, str], List[Dict[str, object]]] = {}
    for row in rows:
        groups.setdefault((str(row['model']), str(row['layer'])), []).append(row)
    layer_means: Dict[str, List[np.ndarray]] = {}
    for (model, layer), group in groups.items():
        means = _head_means(group)
        layer_means.setdefault(model, []).append(means)
        lines.append(_line(model, layer, means))
    for model, means in layer_means.items():
        lines.append(_line(f'**{model}**', 'all', _nanmean_rows(np.stack(means))))
    return lines


def _head_means(group: Sequence[Dict[str, object]]) -> np.ndarray:
    """Each statistic of STATISTICS averaged over the rows (heads) of `group`, NaN where no row has it."""
    return _nanmean_rows(np.array([[float(row[key]) for key in STATISTICS] for row in group]))


def _nanmean_rows(values: np.ndarray) -> np.ndarray:
    """The mean of each column of (rows, columns) `values` over its non-NaN entries; NaN for a column of NaN."""
    counts = (~np.isnan(values)).sum(axis=0)
    sums = np.nansum(values, axis=0)
    return np.divide(sums, counts, out=np.full(sums.shape, np.nan), where=counts > 0)


def _line(model: str, layer: str, means: np.ndarray) -> str:
    values = ['–' if np.isnan(value) else f'{value:.3g}' for value in means]
    return '| ' + ' | '.join([model, layer] + values) + ' |'


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # progress as train.py shows it: a bar on a terminal, whole lines in a log file or a pipe
    setup_logging(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu')), stream=sys.stderr)
    files = find_images(args.data, args.max_images)
    # every model built and labelled before the first is measured: a bad one fails at once, not after a long run
    loaded: Dict[str, Tuple[torch.nn.Module, CN]] = {}
    for label, name, checkpoint, option in sources(args):
        model, cfg = load_analysis_model(
            name or None, checkpoint or None, args.opts, args.ema, '--models', pretrained=args.pretrained,
            without_config=f"expected it with the model whose weights it holds: --models NAME={checkpoint}")
        label = label or str(cfg.MODEL.KWARGS.get('attn_type', cfg.MODEL.NAME))
        try:
            with record_attention(model):  # every layer recordable (a weight function for each attention)
                pass
        except ValueError as e:
            raise UsageError(f"{label}: {e}") from None
        if label in loaded:
            raise UsageError(f"two models are labelled {label!r}; give them labels as LABEL=PATH" if option ==
                             '--checkpoints' else f"model {label!r} is measured twice; expected each model of "
                             f"--models once (checkpoints as --checkpoints LABEL=PATH take labels)")
        loaded[label] = model, cfg
    rows: List[Dict[str, object]] = []
    for label, (model, cfg) in loaded.items():
        inputs, _ = load_images(files, cfg)
        rows += measure(model, inputs, args.batch_size, label)
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    command = 'python scripts/attention_stats.py ' + ' '.join(shlex.quote(a) for a in argv)
    with files_taken_together():  # never a new table beside the previous run's figure
        atomic_write_text(args.out + '.csv', table.getvalue())
        atomic_write_text(args.out + '.md', f"Attention statistics on {len(files)} images, means over the heads (and "
                                            f"the layers in the bold rows).\n\n    {command}\n\n"
                                            + '\n'.join(markdown_table(rows)) + '\n')
        plot_layer_curves(rows, PLOTTED, args.out + '.png')
    print(f"wrote {args.out}.csv, {args.out}.md and {args.out}.png ({len(rows)} layer-head rows)")
    return 0


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
