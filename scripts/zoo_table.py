"""Print the README's model-zoo table: parameters and FLOPs measured on our models, official top-1 and config.

    python scripts/zoo_table.py > zoo.md

FLOPs are multiply-accumulates of the matrix products and convolutions (as the official READMEs count them),
measured with `torch.utils.flop_counter` on the meta device, so no weights are allocated.
"""
import os
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

import timm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402,F401  (registers the families)

# ImageNet-1k top-1 reported by the papers / official READMEs (None: no released weights or figure).
OFFICIAL_TOP1 = {
    'inline_deit_tiny': 74.5, 'inline_deit_small': 80.2, 'inline_deit_base': 82.3,
    'inline_pvt_tiny': 78.2, 'inline_pvt_small': 82.0, 'inline_pvt_medium': 83.2, 'inline_pvt_large': 83.6,
    'inline_swin_tiny': 82.4, 'inline_swin_small': 83.6, 'inline_swin_base': 84.1, 'inline_swin_base_384': None,
    'inline_cswin_tiny': 83.2, 'inline_cswin_small': 83.8, 'inline_cswin_base': 84.5, 'inline_cswin_base_384': None,
    'flatten_pvt_tiny': 77.8, 'flatten_pvt_small': None, 'flatten_pvt_medium': None, 'flatten_pvt_large': None,
    'flatten_swin_tiny': 82.1, 'flatten_swin_small': 83.5, 'flatten_swin_base': 83.8, 'flatten_swin_base_384': 85.0,
    'flatten_cswin_tiny': 83.1, 'flatten_cswin_small': None, 'flatten_cswin_base': None,
    'flatten_cswin_base_384': None,
    'softmax_deit_tiny': 72.2, 'softmax_deit_small': 79.9, 'softmax_deit_base': 81.8,
    'softmax_pvt_tiny': 75.1, 'softmax_pvt_small': 79.8, 'softmax_pvt_medium': 81.2, 'softmax_pvt_large': 81.7,
    'softmax_swin_tiny': 81.2, 'softmax_swin_small': 83.2, 'softmax_swin_base': 83.5, 'softmax_swin_base_384': 84.5,
    'softmax_cswin_tiny': 82.8, 'softmax_cswin_small': 83.6, 'softmax_cswin_base': 84.2,
    'softmax_cswin_base_384': 85.5,
}


def config_file(name: str) -> str:
    attention, rest = name.split('_', 1)
    path = os.path.join('configs', attention, f'{rest}.yaml')
    return f'`{path}`' if os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), path)) else '–'


def measure(name: str):
    with torch.device('meta'):
        model = timm.create_model(name).eval()
    size = model.pretrained_cfg['input_size']
    params = sum(p.numel() for p in model.parameters())
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.empty(1, *size, device='meta'))
    return size[-1], params, counter.get_total_flops() / 2


def main() -> None:
    print('| model | resolution | params (M) | FLOPs (G) | official top-1 | weights | config |')
    print('|---|---|---|---|---|---|---|')
    for name in OFFICIAL_TOP1:
        resolution, params, macs = measure(name)
        top1 = OFFICIAL_TOP1[name]
        weights = 'released' if timm.models.get_pretrained_cfg(name).has_weights else '–'
        print(f'| `{name}` | {resolution} | {params / 1e6:.1f} | {macs / 1e9:.1f} | '
              f'{top1 if top1 is not None else "–"} | {weights} | {config_file(name)} |')


if __name__ == '__main__':
    main()
