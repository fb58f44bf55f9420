"""Draw the attention of a model over images: a query's map per head for chosen layers, attention rollout (class-
token models whose layers all mix the same tokens: DeiT's), Grad-CAM, SimA's token norms, MultiMax's σ per layer
and the simplex figure.

    python scripts/visualize_attention.py --checkpoint output/demo/digits/best.pth --image digits/val --max-images 2 \
        --layers 0 -1 --queries 16,16 cls --gradcam --simplex --out figures

`--model NAME` alone draws a registered model with random weights, `--model NAME --pretrained` with its
released weights (its preprocessing from its pretrained config; `--opts` overrides, e.g. MODEL.KWARGS.depth 2).
Query points are pixel coordinates `Y,X` of the model input (after resizing and cropping), or `cls` for the class
token. Writes PNG files into `--out` and lists them in its `.visualize_attention.txt`. Their names carry no model, so
a folder that holds the figures of an earlier run is refused unless `--overwrite`, which removes the listed figures
and no other file; one with PNG files that no run listed is refused either way.
"""
import argparse
import contextlib
import itertools
import os
import re
import sys
from typing import List, Optional, Sequence, Tuple, Union

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import torch
    from yacs.config import CfgNode as CN

    import models  # noqa: F401  (registers the families)
    from engine.analysis import find_images, load_analysis_model, load_images, refuse_unreleased
    from engine.config import parse_args_with_opts
    from engine.checkpoint import atomic_write_text, prepare_script_out
    from engine.errors import UsageError, exit_for_missing_extra, refuse_below, run_cli
    from engine.distributed import DistInfo
    from engine.loops import Progress
    from engine.trainer import setup_logging
    from models.analysis import Query, attention_layers, pools_tokens, record_attention
    try:
        from models.analysis.plots import (
            attention_rollout, grad_cam, plot_heat_map, plot_multimax_sigma, plot_query_maps, plot_simplex,
            plot_token_norms, rollout_problem,
        )
    except ModuleNotFoundError as missing:
        exit_for_missing_extra(missing, 'analysis')
    from models.attention.mixer import Mixer
    from models.attention.multimax import MultiMaxMixer


# The figures of the last run into an --out folder, one name a line: the only files --overwrite removes.
MANIFEST = '.visualize_attention.txt'
MANIFEST_HEADER = '# the figures of the last run of scripts/visualize_attention.py here; --overwrite removes them\n'

NEGATIVE_POINT = re.compile(r'-\d+,-?\d+|\d+,-\d+')


def _negative_point(query: str) -> str:
    return f"query {query!r} is outside the image; expected Y,X pixel coordinates from its top-left corner, 0 or more"


def _refuse_negative_queries(argv: Sequence[str]) -> None:
    """A UsageError for a negative point among the values of --queries, which argparse reads as an unknown option
    ('-1,3'), not as a value."""
    values = False
    for token in itertools.takewhile(lambda token: token != '--opts', argv):
        if values and NEGATIVE_POINT.fullmatch(token):
            raise UsageError(_negative_point(token))
        values = token == '--queries' or (values and not token.startswith('--'))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='visualize_attention.py', description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', help='registered model name (random weights without --checkpoint or '
                                        "--pretrained), or 'local-dir:FOLDER' / 'hf-hub:REPO' of a model saved for "
                                        'the hub (its weights)')
    parser.add_argument('--pretrained', action='store_true',
                        help="--model's released weights, downloaded once into the cache (as eval.py --model)")
    parser.add_argument('--checkpoint', help='our checkpoint (alone, its stored config builds the model), or with '
                                             '--model any weights file of that model, a release included')
    parser.add_argument('--ema', action='store_true', help="the checkpoint's EMA weights")
    parser.add_argument('--image', required=True, help='an image file or a folder of images (searched recursively)')
    parser.add_argument('--max-images', type=int, default=4,
                        help='images taken from a folder, spread evenly over its sorted files (default 4)')
    parser.add_argument('--layers', nargs='+', default=['0', '-1'],
                        help='attention layers: module names or indices (default: first and last)')
    parser.add_argument('--queries', nargs='+', default=None,
                        help="query points Y,X in pixels of the model input, or 'cls' (default: the centre)")
    parser.add_argument('--gradcam', action='store_true', help='also draw Grad-CAM of the predicted class')
    parser.add_argument('--simplex', action='store_true', help='also draw the simplex figure')
    parser.add_argument('--out', required=True, help=f'output folder of the PNG files (listed in its {MANIFEST}); '
                                                     'refused where it holds figures of an earlier run')
    parser.add_argument('--overwrite', action='store_true',
                        help="replace the figures of an earlier run in --out: they are removed (those listed in its "
                             f"{MANIFEST}, no other file) before this run writes its own")
    parser.add_argument('--debug', action='store_true', help='show tracebacks instead of one-line errors')
    parser.add_argument('--opts', nargs=argparse.REMAINDER, default=[], metavar='KEY VALUE',
                        help='config overrides, last on the command line, e.g. --opts MODEL.KWARGS.depth 2')
    _refuse_negative_queries(argv)
    args = parse_args_with_opts(parser, argv)
    if not args.model and not args.checkpoint:
        parser.error('expected --model NAME or --checkpoint PATH')
    if args.pretrained and (args.checkpoint or not args.model):
        parser.error('--pretrained loads the released weights of --model NAME; expected --model without --checkpoint')
    if args.pretrained:
        refuse_unreleased(parser, [args.model])
    if args.ema and not args.checkpoint:
        parser.error("--ema reads the EMA weights of a checkpoint; expected --checkpoint PATH")
    if args.gradcam:
        try:
            import pytorch_grad_cam  # noqa: F401  (imported where Grad-CAM is drawn; checked before any work)
        except ModuleNotFoundError as missing:
            exit_for_missing_extra(missing, 'analysis')
    refuse_below(parser, {'--max-images': (args.max_images, 1)})
    prepare_script_out(parser, args.out, prefix=False)
    args.earlier_figures = earlier_figures(parser, args.out, args.overwrite)
    return args


def _listed_figures(folder: str) -> List[str]:
    """The names the manifest in `folder` lists (none where there is no manifest)."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding='utf-8', errors='surrogateescape') as f:
            return [line.rstrip('\n') for line in f if not line.startswith('#')]
    except FileNotFoundError:
        return []


def earlier_figures(parser: argparse.ArgumentParser, out: str, overwrite: bool) -> List[str]:
    """The figures of an earlier run in the folder `out`, which `overwrite` replaces; `parser.error` (one line,
    status 2) where it holds some without `overwrite`, or PNG files that no earlier run listed (the figures of a
    run before the manifest, or the user's own), which would stand beside this run's figures and which this script
    never removes."""
    pngs = sorted(name for name in os.listdir(out)
                  if name.lower().endswith('.png') and os.path.isfile(os.path.join(out, name)))
    listed = set(_listed_figures(out))
    others = [name for name in pngs if name not in listed]
    if others:
        parser.error(f"--out {out}: the folder holds {len(others)} PNG file(s) that no earlier run listed in its "
                     f"{MANIFEST}, such as {others[0]!r}; expected a folder without other PNG files, which "
                     f"--overwrite would leave beside this run's figures: move them away or choose another --out")
    if pngs and not overwrite:
        parser.error(f"--out {out}: the folder holds {len(pngs)} figure(s) of an earlier run; expected a new or empty "
                     f"folder, or --overwrite to replace them")
    return pngs


def _class_token_layers(model: torch.nn.Module, image: torch.Tensor) -> List[str]:
    """The recordable layers whose tokens include the class token, from one forward pass of `image`."""
    with torch.no_grad(), record_attention(model) as every:
        model(image)
    return [name for name in every if every[name].num_prefix_tokens > 0]


def parse_layers(layers: Sequence[str]) -> List[Union[str, int]]:
    return [int(layer) if re.fullmatch(r'-?\d+', layer) else layer for layer in layers]


def parse_point(query: str, size: int) -> Tuple[float, float]:
    """The point Y,X of a query other than 'cls' as fractions of the `size` x `size` input; a UsageError where it is
    no pixel of it."""
    if NEGATIVE_POINT.fullmatch(query):
        raise UsageError(_negative_point(query))
    match = re.fullmatch(r'(\d+),(\d+)', query)
    if not match:
        raise UsageError(f"query {query!r}: expected Y,X pixel coordinates or 'cls'")
    y, x = int(match.group(1)), int(match.group(2))
    if not (y < size and x < size):
        raise UsageError(f"query {query!r} is outside the {size}x{size} image")
    # the pixel's centre: its edge, y / size, can round to just below its patch's first row
    return (y + 0.5) / size, (x + 0.5) / size


def parse_queries(queries: Sequence[str], size: int, has_class_token: bool) -> List[Query]:
    """Token 0 for 'cls', else the point Y,X as fractions of the `size` x `size` input."""
    parsed: List[Query] = []
    for query in queries:
        if query != 'cls':
            parsed.append(parse_point(query, size))
        elif has_class_token:
            parsed.append(0)
        else:
            raise UsageError("query 'cls': the model has no class token")
    return parsed


def check_points(queries: Sequence[str], cfg: CN) -> None:
    """A UsageError for a query point outside the input of `cfg`, known before the model is built ('cls' needs the
    model: it is checked with it)."""
    for query in queries:
        if query != 'cls':
            parse_point(query, cfg.DATA.IMG_SIZE)


def slug(text: str) -> str:
    # letters of every script stay: 猫.png and 犬.png, été.png and ête.png are different images
    return re.sub(r'[^\w-]+', '-', text).strip('-') or 'model'


def figure_stems(files: Sequence[str], image: str) -> List[str]:
    """The figure names' stem of each image: its path under the folder `image` (`val/a/0.png` and `val/b/0.png` are
    two images) without the extension, or with it where two would share a stem (`x.png`, `x.jpg`); a UsageError
    where two still would."""
    names = [os.path.relpath(file, image) if os.path.isdir(image) else os.path.basename(file) for file in files]
    stems = [slug(os.path.splitext(name)[0]) for name in names]
    stems = [slug(name) if stems.count(stem) > 1 else stem for name, stem in zip(names, stems)]
    for first, stem in enumerate(stems):
        if stems.count(stem) > 1:
            second = stems.index(stem, first + 1)
            raise UsageError(f"images {files[first]!r} and {files[second]!r} would write figures of one name "
                             f"({stem}_...); expected paths that differ in more than punctuation")
    return stems


def _no_rollout_reason(model: torch.nn.Module) -> Optional[str]:
    """Why the rollout cannot be formed, known before the model runs again for every layer: an attention that
    pools the tokens, or one without a weight function (in a layer outside --layers); None where it can."""
    mixers = [module for layer in attention_layers(model).values() for module in layer.modules()
              if isinstance(module, Mixer)]
    try:
        pooling = sorted({mixer.attention_name for mixer in mixers if pools_tokens(type(mixer))})
    except ValueError as e:
        return str(e)
    if pooling:
        return (f"{' and '.join(pooling)} attention pools the tokens into global vectors and forms no "
                f"token-to-token weights to multiply through the layers")
    return None


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # progress as train.py shows it: a bar on a terminal, whole lines in a log file or a pipe
    setup_logging(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu')), stream=sys.stderr)
    model, cfg = load_analysis_model(args.model, args.checkpoint, args.opts, args.ema, pretrained=args.pretrained,
                                     check=lambda cfg: check_points(args.queries or [], cfg))
    size = cfg.DATA.IMG_SIZE
    files = find_images(args.image, args.max_images)
    inputs, shown = load_images(files, cfg)
    has_class_token = getattr(model, 'num_prefix_tokens', 0) > 0
    # a point given twice would draw the same figures twice under one name
    queries = list(dict.fromkeys(parse_queries(args.queries or [f'{size // 2},{size // 2}'], size, has_class_token)))
    labels = ['cls' if q == 0 else f'y{int(q[0] * size)}x{int(q[1] * size)}' for q in queries]
    written: List[str] = []

    def save(name: str) -> str:
        """The path of the figure `name`, listed in the manifest before it is written: a run stopped half-way leaves
        no figure that --overwrite would not remove."""
        if not written:  # the earlier run's figures go only once this run's checks have passed
            for earlier in args.earlier_figures:
                with contextlib.suppress(FileNotFoundError):  # removed by hand while this run worked
                    os.remove(os.path.join(args.out, earlier))
        path = os.path.join(args.out, name)
        written.append(path)
        atomic_write_text(os.path.join(args.out, MANIFEST),
                          MANIFEST_HEADER + ''.join(os.path.basename(figure) + '\n' for figure in written))
        return path

    try:
        with torch.no_grad(), record_attention(model, parse_layers(args.layers), queries) as rec:
            logits = model(inputs)
        recorded = {name: rec[name] for name in rec}
    except ValueError as e:
        raise UsageError(str(e)) from None
    if 'cls' in labels:  # PVT's class token joins in its last stage, and SimA-XCiT's in its class attention
        for name, layer in recorded.items():
            if not layer.is_pooling and layer.num_prefix_tokens == 0:
                way = "or --layers that hold the class token" if any(_class_token_layers(model, inputs[:1])) else \
                    "no layer this script records holds it"
                raise UsageError(f"query 'cls': layer {name} has no class token (its tokens are the "
                                 f"{layer.grid[0]}x{layer.grid[1]} grid); expected Y,X points for it, {way}")
    stems = figure_stems(files, args.image)
    pooling = sorted({layer.attention for layer in recorded.values() if layer.is_pooling})
    if args.queries and pooling:
        print(f"{' and '.join(pooling)} attention's layers pool the tokens: their figures show each pool's weights, "
              f"not --queries")
    with Progress(len(files), 'images', enabled=len(files) > 1) as progress:
        for index, stem in enumerate(stems):
            for name, layer in recorded.items():
                rows = range(layer.weights.shape[2]) if layer.is_pooling else range(len(queries))
                for row in rows:
                    if layer.is_pooling and not layer.weights[index, :, row].any():
                        continue  # no head has this pool (CSwin's branches on a non-square grid)
                    label = f'pool{row}' if layer.is_pooling else labels[row]
                    plot_query_maps(shown[index], layer, row, save(f'{stem}_{slug(name)}_{label}.png'), index)
                if 'q_norm' in layer.extras:
                    plot_token_norms(shown[index], layer, save(f'{stem}_{slug(name)}_norms.png'), index)
            progress.update()
    no_rollout = _no_rollout_reason(model) if has_class_token else None
    if no_rollout is not None:
        print(f"no attention rollout: {no_rollout}")
    elif has_class_token:
        with torch.no_grad(), record_attention(model) as full:
            model(inputs)
        layers = [full[name] for name in full]
        problem = rollout_problem(layers)
        if problem is None:
            rollout = attention_rollout(layers)
            for index, stem in enumerate(stems):
                plot_heat_map(shown[index], rollout[index].numpy(), 'attention rollout (class token)',
                              save(f'{stem}_rollout.png'))
        else:
            print(f"no attention rollout: {problem}")
    if args.gradcam:
        cams = grad_cam(model, inputs)
        predicted = logits.argmax(dim=-1).tolist()
        for index, stem in enumerate(stems):
            plot_heat_map(shown[index], cams[index], f'Grad-CAM, class {predicted[index]}', save(f'{stem}_gradcam.png'))
    multimax = [m for m in model.modules() if isinstance(m, MultiMaxMixer)]
    if multimax:
        plot_multimax_sigma(model, save('multimax_sigma.png'))
    if args.simplex:
        first = multimax[0] if multimax else None
        plot_simplex(save('simplex.png'), *((first.ranges.detach(), first.ts.detach()) if first else ()))
    replaced = f" in place of the earlier run's {len(args.earlier_figures)}" if args.earlier_figures else ''
    print(f"wrote {len(written)} figures to {args.out}{replaced}")
    return 0


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
