"""The benchmark and the zoo table take their attentions from the registry, so a new attention shows in both."""
import importlib.util
import os
import re
from types import ModuleType

import timm
import torch

from models.attention import WindowAttention, forms_score_matrix, list_attentions

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts')


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f'scripts_{name}', os.path.join(SCRIPTS, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchmark = load_script('benchmark')
zoo_table = load_script('zoo_table')


def test_zoo_registry_table_has_a_column_per_attention_and_a_row_per_size():
    lines = zoo_table.registry_table(['deit'])
    header = [cell.strip() for cell in lines[0].strip('|').split('|')]
    assert header[2:] == list_attentions()
    rows = lines[2:lines.index('')]
    sizes = [name[len('softmax_'):] for name in timm.list_models('softmax_deit_*')]
    assert sorted(row.split('|')[1].strip() for row in rows) == sorted(sizes)
    for row in rows:
        for cell in row.strip('|').split('|')[2:]:
            params, flops = map(float, re.match(r'\s*([\d.]+) / ([\d.]+)', cell).groups())
            assert params > 0 and flops > 0, row


def test_benchmark_offers_and_selects_every_attention():
    parser = benchmark.build_parser()
    assert parser.parse_args([]).attentions == list_attentions()
    for family in benchmark.FAMILIES:
        specs = benchmark.group_specs(family, 'tiny', 224, list_attentions(), reference=False)
        assert [spec['label'] for spec in specs] == list_attentions()
        assert all(timm.is_model(spec['model']) for spec in specs)


def test_benchmark_swin_linear_blocks_see_the_whole_grid_above_the_trained_resolution():
    """The official linear Swin models window their linear blocks at the trained grid unless told otherwise; at
    twice the resolution of Swin-B-384 every model of the group builds (the official softmax windows divide the
    grids)."""
    for spec in benchmark.group_specs('swin', 'base_384', 768, list_attentions(), reference=False):
        with torch.device('meta'):
            model = timm.create_model(spec['model'], **spec['kwargs'])
        windows = [m.window for m in model.modules()
                   if isinstance(m, WindowAttention) and not forms_score_matrix(m.attention_name)]
        assert all(window is None for window in windows), spec
