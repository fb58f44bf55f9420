"""Print the README's model-zoo tables: the official models (parameters and FLOPs measured on ours, official top-1
and config), then parameters and FLOPs of every registered attention on every family size.

    python scripts/zoo_table.py > zoo.md

FLOPs are multiply-accumulates of the matrix products and convolutions (as the official READMEs count them),
measured with `torch.utils.flop_counter` on the meta device, so no weights are allocated.
"""
import argparse
import functools
import os
import re
import sys
from typing import Collection, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import timm

    import models  # noqa: F401  (registers the families)
    from engine.errors import run_cli
    from models.attention import list_attentions

# ImageNet-1k top-1 reported by the papers / official READMEs (None: no released weights or figure, or a figure
# only in a paper table not checked here: MultiMax-DeiT, SimA-XCiT; DeiT-S -> SimA's is the paper's as its
# authors' issue tracker quotes it). A name's default weights, then its other weights by tag: the ImageNet-22k
# releases (the pretrained ones classify 21841 classes, so have no ImageNet-1k figure).
OFFICIAL_TOP1 = {
    'inline_deit_tiny': 74.5, 'inline_deit_small': 80.2, 'inline_deit_base': 82.3,
    'inline_pvt_tiny': 78.2, 'inline_pvt_small': 82.0, 'inline_pvt_medium': 83.2, 'inline_pvt_large': 83.6,
    'inline_swin_tiny': 82.4, 'inline_swin_small': 83.6, 'inline_swin_base': 84.1, 'inline_swin_base_384': None,
    'inline_cswin_tiny': 83.2, 'inline_cswin_small': 83.8, 'inline_cswin_base': 84.5, 'inline_cswin_base_384': None,
    'flatten_pvt_tiny': 77.8, 'flatten_pvt_small': None, 'flatten_pvt_medium': None, 'flatten_pvt_large': None,
    'flatten_pvt_v2_b0': 71.1, 'flatten_pvt_v2_b1': None, 'flatten_pvt_v2_b2': None, 'flatten_pvt_v2_b3': None,
    'flatten_pvt_v2_b4': None,
    'flatten_swin_tiny': 82.1, 'flatten_swin_small': 83.5, 'flatten_swin_base': 83.8, 'flatten_swin_base_384': 85.0,
    'flatten_cswin_tiny': 83.1, 'flatten_cswin_small': None, 'flatten_cswin_base': None,
    'flatten_cswin_base_384': None,
    'multimax_deit_tiny': None, 'multimax_deit_small': None, 'multimax_deit_base': None,
    **{f'sima_{size}_p{patch}': None for size in ('nano_12', 'tiny_12', 'small_12', 'tiny_24', 'small_24', 'medium_24',
                                                  'large_24') for patch in (16, 8)},
    'sima_deit_small_ls': 79.8,
    'softmax_deit_tiny': 72.2, 'softmax_deit_small': 79.9, 'softmax_deit_base': 81.8,
    'softmax_pvt_tiny': 75.1, 'softmax_pvt_small': 79.8, 'softmax_pvt_medium': 81.2, 'softmax_pvt_large': 81.7,
    'softmax_pvt_v2_b0': 70.5, 'softmax_pvt_v2_b1': 78.7, 'softmax_pvt_v2_b2': 82.0, 'softmax_pvt_v2_b2_li': 82.1,
    'softmax_pvt_v2_b3': 83.1, 'softmax_pvt_v2_b4': 83.6, 'softmax_pvt_v2_b5': 83.8,
    'softmax_swin_tiny': 81.2, 'softmax_swin_small': 83.2, 'softmax_swin_base': 83.5, 'softmax_swin_base_384': 84.5,
    'softmax_swin_large': 86.3, 'softmax_swin_large_384': 87.3,
    'softmax_swin_tiny.ms_in22k_ft_in1k': 80.9, 'softmax_swin_small.ms_in22k_ft_in1k': 83.2,
    'softmax_swin_base.ms_in22k_ft_in1k': 85.2, 'softmax_swin_base_384.ms_in22k_ft_in1k': 86.4,
    **{f'softmax_swin_{size}.ms_in22k': None for size in ('tiny', 'small', 'base', 'base_384', 'large', 'large_384')},
    'softmax_cswin_tiny': 82.8, 'softmax_cswin_small': 83.6, 'softmax_cswin_base': 84.2,
    'softmax_cswin_base_384': 85.5, 'softmax_cswin_large': 86.5, 'softmax_cswin_large_384': 87.5,
    'softmax_cswin_large.in22k': None,
}


def config_file(name: str) -> str:
    """The config that trains model `name`'s weights: `{family size}_22kto1k.yaml` fine-tunes the ImageNet-22k
    weights on ImageNet-1k; none trains on ImageNet-22k."""
    attention, rest = name.split('.')[0].split('_', 1)
    tag = timm.models.get_pretrained_cfg(name).tag or ''
    if tag.endswith('in22k'):
        return '–'
    if tag.endswith('in22k_ft_in1k'):
        rest += '_22kto1k'
    path = os.path.join('configs', attention, f'{rest}.yaml')
    return f'`{path}`' if os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), path)) else '–'


@functools.lru_cache(maxsize=None)  # both tables measure the official models
def measure(name: str) -> Tuple[int, int, float]:
    """Input resolution, parameters and multiply-accumulates of model `name` at its pretrained input size."""
    with torch.device('meta'):
        model = timm.create_model(name).eval()
    size = model.pretrained_cfg['input_size']
    params = sum(p.numel() for p in model.parameters())
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.empty(1, *size, device='meta'))
    return size[-1], params, counter.get_total_flops() / 2


def official_table() -> List[str]:
    """The official models with their measured size and cost, official top-1, the tag of their released weights
    and config (markdown)."""
    lines = ['| model | resolution | params (M) | FLOPs (G) | official top-1 | weights | config |',
             '|---|---|---|---|---|---|---|']
    for name in OFFICIAL_TOP1:
        resolution, params, macs = measure(name)
        top1 = OFFICIAL_TOP1[name]
        cfg = timm.models.get_pretrained_cfg(name)
        weights = f'`{cfg.tag}`' if cfg.has_weights else '–'
        lines.append(f'| `{name}` | {resolution} | {params / 1e6:.1f} | {macs / 1e9:.1f} | '
                     f'{top1 if top1 is not None else "–"} | {weights} | {config_file(name)} |')
    return lines


def family_of(family_size: str) -> str:
    """The family of a family size: 'pvt_v2_b0' -> 'pvt_v2', 'swin_base_384' -> 'swin', 'pvt_v2_b2_li' -> 'pvt_v2'."""
    return re.match(r'(.+?)_(?:tiny|small|medium|large|base|b\d+)(?:_\d+|_li)?$', family_size).group(1)


def registry_table(families: Optional[Collection[str]] = None) -> List[str]:
    """Every registered attention (columns) on every family size of `families` (rows; default all), each cell the
    parameters and FLOPs of `{attention}_{family}_{size}` (markdown, with its legend)."""
    attentions = list_attentions()
    # Every family registers every attention at each of its sizes, so the softmax models list the sizes.
    rows = []
    for softmax_name in timm.list_models('softmax_*'):
        family_size = softmax_name[len('softmax_'):]
        family = family_of(family_size)
        if families is None or family in families:
            resolution, params, _ = measure(softmax_name)
            rows.append((family, params, resolution, family_size))
    lines = [f"| family size | resolution | {' | '.join(attentions)} |", '|---|---|' + '---|' * len(attentions)]
    # A family's sizes in the order of their softmax models' parameters, then resolution (base before base_384).
    for _, _, row_resolution, family_size in sorted(rows):
        cells = []
        for attention in attentions:
            name = f'{attention}_{family_size}'
            resolution, params, macs = measure(name)
            cells.append(f'{params / 1e6:.1f} / {macs / 1e9:.1f}'
                         + (f' @ {resolution}' if resolution != row_resolution else '')
                         + (' †' if name in OFFICIAL_TOP1 else ''))
        lines.append(f"| {family_size} | {row_resolution} | {' | '.join(cells)} |")
    lines += ['', 'Cells: params (M) / FLOPs (G) of `{attention}_{family size}` at the row\'s resolution (`@ R`: at '
                  'its own resolution R). † an official model of the table above: what is measured is its official '
                  'configuration, which for an attention other than the family\'s own can differ from the family '
                  'size with that attention in every block (pattern, widths, resolution).']
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    argparse.ArgumentParser(description=__doc__.split('\n\n')[0]).parse_args(argv)  # takes no options
    print('\n'.join(official_table() + [''] + registry_table()))


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
