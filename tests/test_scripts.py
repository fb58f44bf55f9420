"""The benchmark and the zoo table take their attentions from the registry, so a new attention shows in both."""
import contextlib
import csv
import functools
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from types import ModuleType
from typing import Dict, List, Optional, Tuple

import pytest
import timm
import torch
from PIL import Image
from torch.utils.flop_counter import flop_registry

from engine.checkpoint import NOTES_MARKER
from engine.cli import train_main
from engine.data import resolve_data_root
from engine.distributed import resolve_device
from engine.errors import UsageError, run_cli
from models.attention import WindowAttention, forms_score_matrix, list_attentions, registry

from dispatch import DispatchRecorder

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts')


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f'scripts_{name}', os.path.join(SCRIPTS, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchmark = load_script('benchmark')
zoo_table = load_script('zoo_table')
train_throughput = load_script('train_throughput')
compare_fla = load_script('compare_fla')


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


def test_a_reader_that_stops_reading_ends_a_script_quietly():
    """`zoo_table.py | head -3`: the closed pipe was a BrokenPipeError traceback with status 1; a command run by
    the engine's wrapper, as every script is, ends as a process that SIGPIPE ends, 141, with nothing on the error
    output. (A printing command of its own: the scripts' tables take a minute to measure.)"""
    command = "import sys; from engine.errors import run_cli; sys.exit(run_cli(lambda argv: print('row\\n' * 9)))"
    process = subprocess.Popen([sys.executable, '-c', command], cwd=os.path.dirname(SCRIPTS), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    err = process.stderr.read()
    assert (process.wait(timeout=120), err) == (128 + signal.SIGPIPE, '')


def test_zoo_table_refuses_options_it_does_not_take_before_measuring(monkeypatch, capsys):
    monkeypatch.setattr(zoo_table, 'official_table', lambda: pytest.fail('measured'))
    with pytest.raises(SystemExit) as stopped:
        zoo_table.main(['--families', 'deit'])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith('error: unrecognized arguments: --families deit')


def test_benchmark_offers_and_selects_every_attention():
    parser = benchmark.build_parser()
    assert parser.parse_args([]).attentions == list_attentions()
    for family in benchmark.FAMILIES:
        specs = benchmark.group_specs(family, 'tiny', 224, list_attentions(), reference=False)
        assert [spec['label'] for spec in specs] == list_attentions()
        assert all(timm.is_model(spec['model']) for spec in specs)
    assert all(timm.is_model(name) for name in benchmark.TIMM_REFERENCE.values())
    for family, size in benchmark.TIMM_REFERENCE:  # timm's PVT v2 was given img_size, which it has not: never timed
        reference = benchmark.group_specs(family, size, 64 if family == 'swin' else 96, [], reference=True)[0]
        with torch.device('meta'):
            model = timm.create_model(reference['model'], **reference['kwargs'])
        assert type(model).__module__.startswith('timm.models.')
    assert benchmark.group_specs('pvt_v2', 'small', 224, ['inline'], reference=True)[1]['model'] == 'inline_pvt_v2_b2'


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


def test_benchmark_counts_the_flops_of_the_formula_with_the_cpu_attention_kernel():
    """A tiny softmax DeiT: the counter's FLOPs (2 per multiply-add) equal the formula written out, attention
    included, which runs in the CPU kernel of `scaled_dot_product_attention`: torch's counter sees it as 0 before
    torch 2.15 and from 2.15 on counts the backward's recomputed scores too."""
    batch, side, patch, dim, depth, heads, classes = 2, 32, 8, 32, 2, 2, 5
    model = timm.create_model('softmax_deit_tiny', img_size=side, patch_size=patch, embed_dim=dim, depth=depth,
                              num_heads=heads, num_classes=classes)
    x = torch.randn(batch, 3, side, side)
    n = (side // patch) ** 2 + 1  # patches and the class token
    embed = 2 * 3 * patch ** 2 * dim * (n - 1)
    attention = 2 * heads * n * n * (2 * dim // heads)  # q·kᵀ and p·v
    block = 2 * n * dim * 3 * dim + attention + 2 * n * dim * dim + 2 * 2 * n * dim * 4 * dim
    forward = embed + depth * block + 2 * dim * classes
    assert benchmark.count_flops(model, x, train=False) == batch * forward
    # backward: twice the forward products, but no gradient of the input image through the patch embedding
    assert benchmark.count_flops(model, x, train=True) == batch * (3 * forward - embed)
    assert all(p.grad is None for p in model.parameters())


def table_row(**measured) -> dict:
    """A row of the benchmark table: DeiT-T with softmax at 64, inference measured, no ratios."""
    row = dict(family='deit', size='tiny', attention='softmax', resolution=64, model='softmax_deit_tiny',
               compiled=False, params_m=5.5, gflops=0.1, infer_img_s=10.0, infer_mm_pct=20.0, infer_best_pct=9.1,
               train_step_ms=None, train_mm_pct=None, train_best_pct=None, infer_matmul_gflop_s=50.0,
               infer_onednn_gflop_s=110.0, train_matmul_gflop_s=None, train_onednn_gflop_s=None, infer_mem_mib=1.0,
               train_mem_mib=None)
    row.update({f'{mode}_vs_{base}': None for mode in ('infer', 'train') for base in ('timm', 'softmax', 'eager')})
    return dict(row, **measured)


def test_benchmark_efficiency_is_the_median_share_of_the_matmul_rate_and_the_table_states_its_setting(
        tmp_path, monkeypatch):
    rounds = [0.5, 1.0, 2.0]  # model seconds; the product takes 1 s in every round
    share = benchmark.efficiency(flops=4e9, seconds=rounds, matmul_flops=8e9, matmul_seconds=[1.0] * 3)
    assert share == 100 * 4 / 8  # median of 100 %, 50 %, 25 %
    args = benchmark.build_parser().parse_args(['--device', 'cpu', '--out', str(tmp_path / 'b'), '--compile',
                                                '--note', 'shared machine'])
    args.load_at_start = 0.0
    monkeypatch.setattr(sys, 'argv', ['scripts/benchmark.py', '--compile'])
    benchmark.write_outputs(args, [table_row()], [], 60.0)
    text = (tmp_path / 'b.md').read_text()
    for needle in ('- date: ', 'shared machine', f'torch {torch.__version__}, timm {timm.__version__}',
                   '- command: `python scripts/benchmark.py --compile`',
                   'inference rounds `torch.matmul` 50.0 GFLOP/s, oneDNN 110.0 GFLOP/s\n', '| 20.0 | 9.1 |'):
        assert needle in text, needle


@pytest.mark.parametrize('trained_first', [True, False])
def test_benchmark_table_states_the_training_rate_where_only_some_rows_trained(tmp_path, monkeypatch,
                                                                                trained_first):
    """With `--train-max-resolution` below a later resolution the run failed on its table after all the measuring
    (the rates of rows without training rounds are None), leaving a new CSV beside the previous table; with the
    untrained rows first the table left the training rate out."""
    args = benchmark.build_parser().parse_args(['--device', 'cpu', '--out', str(tmp_path / 'b')])
    args.load_at_start = 0.0
    monkeypatch.setattr(sys, 'argv', ['scripts/benchmark.py'])
    trained = table_row(resolution=32, train_step_ms=5.0, train_mm_pct=30.0, train_best_pct=12.0,
                        train_matmul_gflop_s=45.0)
    rows = [trained, table_row()] if trained_first else [table_row(), trained]
    benchmark.write_outputs(args, rows, [], 60.0)
    assert ('inference rounds `torch.matmul` 50.0 GFLOP/s, oneDNN 110.0 GFLOP/s; training rounds `torch.matmul` '
            '45.0 GFLOP/s\n') in (tmp_path / 'b.md').read_text()


def test_benchmark_stopped_before_its_table_is_in_place_keeps_the_previous_table_and_notes(tmp_path, monkeypatch):
    previous = f'# Benchmarks\n\nthe last run\n\n{NOTES_MARKER}\nnotes written by hand\n'
    (tmp_path / 'b.md').write_text(previous)
    args = benchmark.build_parser().parse_args(['--device', 'cpu', '--out', str(tmp_path / 'b')])
    args.load_at_start = 0.0
    replace = os.replace

    def stopped_at_the_table(source, target):  # Ctrl-C once the new table is written, before it takes the name
        if str(target).endswith('.md'):
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(os, 'replace', stopped_at_the_table)
    with pytest.raises(KeyboardInterrupt):
        benchmark.write_outputs(args, [table_row()], [], 60.0)
    assert (tmp_path / 'b.md').read_text() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ['b.csv', 'b.md']
    monkeypatch.setattr(benchmark, 'target_lines', lambda *args: 1 / 0)  # a table that fails: no new CSV either
    with pytest.raises(ZeroDivisionError):
        benchmark.write_outputs(args, [table_row(model='another')], [], 60.0)
    assert 'another' not in (tmp_path / 'b.csv').read_text() and (tmp_path / 'b.md').read_text() == previous
    monkeypatch.undo()
    monkeypatch.setattr(os, 'replace', replace)
    benchmark.write_outputs(args, [table_row()], [], 60.0)
    text = (tmp_path / 'b.md').read_text()
    assert 'the last run' not in text and text.endswith(f'{NOTES_MARKER}\nnotes written by hand\n')


@pytest.fixture
def measuring_here(monkeypatch) -> None:
    """The benchmark's measuring processes run in the test's process: the same `main` on their command line, its
    JSON line read back as `child_results` reads a process's. A process would start with seconds of imports; the
    tests of an attention of one's own and of a stop run real ones, and `child_results` has its own test."""
    def child_results(cmd: List[str], timeout: int, env: Optional[Dict[str, str]] = None) -> List[Dict]:
        assert cmd[:2] == [sys.executable, benchmark.__file__]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            benchmark.main(cmd[2:])
        return json.loads(out.getvalue().strip().splitlines()[-1])

    monkeypatch.setattr(benchmark, 'child_results', child_results)


@pytest.mark.usefixtures('measuring_here')
def test_benchmark_that_measured_nothing_fails_and_keeps_the_previous_table(tmp_path, capsys):
    """Every model skipped (DeiT cannot take 8-pixel images): the run exited 0 and replaced the table and the CSV
    with empty ones, which with --out docs/benchmarks would wipe the published table."""
    previous = {'b.md': f'# Benchmarks\n\nthe last run\n\n{NOTES_MARKER}\nnotes\n', 'b.csv': 'model\nx\n'}
    for name, text in previous.items():
        (tmp_path / name).write_text(text)
    argv = ['--device', 'cpu', '--threads', '1', '--families', 'deit', '--sizes', 'tiny', '--attentions', 'softmax',
            '--no-reference', '--resolutions', '8', '--iters', '1', '--no-train', '--warmup', '0', '--out',
            str(tmp_path / 'b')]
    assert run_cli(benchmark.main, argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: no model was measured (1 skipped, the first: softmax_deit_tiny ") and \
        err[-1].endswith(f"); {tmp_path / 'b'}.md and .csv are unchanged"), err[-1]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == previous


def test_benchmark_table_of_a_numbered_gpu_states_cuda_its_precision_product_and_goals(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: f'test GPU {torch.device(device).index}')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    parser = benchmark.build_parser()
    args = parser.parse_args(['--device', 'cuda:1', '--families', 'deit', '--out', str(tmp_path / 'b')])
    benchmark.check_arguments(parser, args)
    args.load_at_start = 0.0
    row = dict(family='deit', size='tiny', attention='multimax', resolution=224, model='multimax_deit_tiny',
               compiled=False, params_m=5.7, gflops=1.3, infer_img_s=10.0, infer_mm_pct=20.0, infer_best_pct=9.1,
               train_step_ms=50.0, train_mm_pct=20.0, train_best_pct=9.1, infer_matmul_gflop_s=500.0,
               infer_onednn_gflop_s=None, train_matmul_gflop_s=480.0, train_onednn_gflop_s=None, infer_mem_mib=1.0,
               train_mem_mib=2.0, infer_vs_softmax=0.9, train_vs_softmax=0.8)
    row.update({f'{mode}_vs_{base}': None for mode in ('infer', 'train') for base in ('timm', 'eager')})
    benchmark.write_outputs(args, [row], [], 60.0)
    text = (tmp_path / 'b.md').read_text()
    for needle in ('- machine: cuda (test GPU 1)', ', bfloat16 autocast', '(8192² product, bfloat16,',
                   'inference rounds `torch.matmul` 500.0 GFLOP/s; training rounds `torch.matmul` 480.0 GFLOP/s\n',
                   '| MultiMax / softmax training-step time, deit-tiny @ 224 (eager) | 1.25× | ≤ 1.05× (cuda) | no |'):
        assert needle in text, needle
    assert 'inference time' not in text  # the issue sets no inference goal on CUDA
    cpu = parser.parse_args(['--device', 'cpu', '--families', 'deit', '--out', str(tmp_path / 'c')])
    benchmark.check_arguments(parser, cpu)
    assert (args.matmul_size, cpu.matmul_size) == (8192, 2048)  # on a GPU, a product near the card's rate


@pytest.mark.usefixtures('measuring_here')
def test_benchmark_times_both_cpu_matrix_product_libraries_and_runs_linear_layers_through_onednn(tmp_path):
    steps, flops = benchmark.matmul_steps(torch.device('cpu'), 64)
    assert sorted(steps) == ['matmul', 'onednn'] and flops == 2 * 64 ** 3
    out = tmp_path / 'b'
    benchmark.main(['--device', 'cpu', '--families', 'deit', '--sizes', 'tiny', '--attentions', 'softmax',
                    '--resolutions', '32', '--no-reference', '--no-train', '--iters', '1', '--warmup', '0',
                    '--matmul-size', '64', '--onednn', '--out', str(out)])
    with open(str(out) + '.csv') as f:
        row = next(csv.DictReader(f))
    assert float(row['infer_onednn_gflop_s']) > 0
    assert float(row['infer_best_pct']) <= float(row['infer_mm_pct']) + 1e-9
    text = (tmp_path / 'b.md').read_text()
    assert "the models' linear layers, attention products and, in inference, their MLPs' GELU through oneDNN" in text
    assert '- batch 1, min of 1 inference rounds after 0 warm-up calls' in text  # --no-train: no training rounds


COSINE_ATTENTION = """
import torch.nn.functional as F
from models.attention import Mixer, register_attention
from models.attention.layout import merge_heads, split_heads


@register_attention('cosine_of_my_own')
class CosineOfMyOwn(Mixer):
    forms_scores = reduces_keys = True

    def forward(self, q, k, v, ctx):
        h = self.num_heads
        q, k, v = F.normalize(split_heads(q, h), dim=-1), F.normalize(split_heads(k, h), dim=-1), split_heads(v, h)
        return merge_heads(F.scaled_dot_product_attention(q, k, v, scale=10.))


@register_attention('xcit')  # the name of timm's own XCiT models: not an attention with entrypoints
class SameUnderTimmsPrefix(CosineOfMyOwn):
    pass
"""


def test_benchmark_times_an_attention_of_ones_own_beside_the_built_in_ones(tmp_path, monkeypatch, capsys, request):
    """`--attentions` offered the built-in attentions only, and an outside one has no entrypoints: `--imports`
    imports its module (in the measuring processes too) and times it in softmax's architecture. (The command runs
    in this process, its measuring process in one of its own.)"""
    (tmp_path / 'my_attention.py').write_text(COSINE_ATTENTION)
    monkeypatch.chdir(tmp_path)
    # what importing the module does here lasts for this test only: its attentions, the working directory on the
    # import path, the module
    monkeypatch.setattr(registry, '_MIXERS', dict(registry._MIXERS))
    monkeypatch.setattr(sys, 'path', list(sys.path))
    request.addfinalizer(lambda: sys.modules.pop('my_attention', None))
    argv = ['--imports', 'my_attention', '--device', 'cpu', '--threads', '1', '--families', 'deit', '--sizes', 'tiny',
            '--attentions', 'softmax', 'cosine_of_my_own', 'xcit', '--resolutions', '32', '--no-reference',
            '--no-train', '--iters', '1', '--warmup', '0', '--matmul-size', '64', '--out', 'b']
    benchmark.main(argv)
    with open(tmp_path / 'b.csv') as f:
        rows = {row['attention']: row for row in csv.DictReader(f)}
    assert rows['cosine_of_my_own']['model'] == 'softmax_deit_tiny (attn_type cosine_of_my_own)'
    assert rows['xcit']['model'] == 'softmax_deit_tiny (attn_type xcit)'  # timm's xcit_* models are not its own
    assert all(float(row['infer_img_s']) > 0 for row in rows.values())
    capsys.readouterr()
    huge = argv[:argv.index('tiny')] + ['huge'] + argv[argv.index('tiny') + 1:]
    with pytest.raises(SystemExit) as stopped:
        benchmark.main(huge)
    assert stopped.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --sizes huge: no model softmax_deit_huge; softmax_deit has sizes base, small, tiny")
    assert run_cli(benchmark.main, argv[:1] + ['no_such_module'] + argv[2:]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --imports module 'no_such_module' cannot be imported (No module named 'no_such_module'); expected a "
        "module on the import path: in the working directory, on PYTHONPATH or installed")


class Measured(Exception):
    """Raised in place of a measurement, with the config it was given."""


def test_train_throughput_takes_the_class_count_of_given_data_and_names_its_own_overrides(tmp_path, monkeypatch,
                                                                                        capsys):
    """`--data` with other than 10 class folders failed with 'the model has 10 classes (MODEL.NUM_CLASSES)', a
    setting the user never gave; a bad override after `--` was reported for `--opts`, which the script does not
    have, with the script's own overrides and a temporary path in the message."""
    data = tmp_path / 'data'
    for split in ('train', 'val'):
        for c in range(3):
            (data / split / f'c{c}').mkdir(parents=True)

    def measured(cfg, *args):
        raise Measured(cfg.MODEL.NUM_CLASSES)

    monkeypatch.setattr(train_throughput, 'loader_rate', measured)
    with pytest.raises(Measured) as raised:
        train_throughput.main(['--data', str(data), '--', 'DATA.IMG_SIZE', '32'])
    assert raised.value.args == (3,)
    for argv, message in (
            (['--data', str(data), '--classes', '5'],
             f"--classes 5: --data {data} has 3 class folders in train; expected --classes 3 or none"),
            (['--', 'DATA.IMG_SIZE'],
             "the config overrides after -- take KEY VALUE pairs, got an odd number of items: DATA.IMG_SIZE"),
            (['--', 'DATA.IMG_SIZE', '32', '--out', 'x'],
             "the config overrides after -- take KEY VALUE pairs up to the end of the command, got the option --out "
             "among them; expected --out before them")):
        with pytest.raises(SystemExit) as stopped:
            train_throughput.main(argv)
        assert stopped.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f'error: {message}')


def test_train_throughput_measures_loader_and_step_on_imagenet_shaped_images(tmp_path):
    """The throughput script's parts on a tiny model: ImageNet-shaped JPEGs, the DeiT recipe's loader with mixup,
    the training step, and a table that states its setting."""
    data = str(tmp_path / 'data')
    train_throughput.write_images(data, classes=2, per_class=4)
    with Image.open(os.path.join(data, 'train', 'class_000', '0000.jpg')) as image:
        assert image.size == (500, 375) and image.format == 'JPEG'
    args = train_throughput.build_parser().parse_args(
        ['--batch-size', '4', '--workers', '0', '--classes', '2', '--data', data, '--out', str(tmp_path / 't'), '--',
         'DATA.IMG_SIZE', '32', 'MODEL.KWARGS.patch_size', '8', 'MODEL.KWARGS.embed_dim', '16',
         'MODEL.KWARGS.depth', '1', 'MODEL.KWARGS.num_heads', '2'])
    args.opts = [o for o in args.opts if o != '--']
    cfg = train_throughput.load_config(args.cfg, train_throughput.train_opts(args, data) +
                                       ['OUTPUT', str(tmp_path / 'out')])
    info = train_throughput.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu'))
    rates = {'data loader alone': train_throughput.loader_rate(cfg, info, batches=2, repeats=1),
             'model step alone': train_throughput.model_rate(cfg, info, steps=1, repeats=1),
             'train.py (both)': train_throughput.train_py_rate(args, data, str(tmp_path / 'run'), epochs=3)}
    logged = [json.loads(line)['images_per_second'] for line in (tmp_path / 'run' / 'log.jsonl').open()]
    assert len(logged) == 3 and rates['train.py (both)'] == statistics.median(logged[1:])
    assert all(rate > 0 for rate in rates.values())
    (tmp_path / 't.md').write_text(f'an earlier table\n\n{NOTES_MARKER}\nnotes written by hand\n')
    text = train_throughput.write_table(args, cfg, rates, 1.)
    # the notes below an earlier table stay (they were lost, with docs/train_throughput.md's four sections)
    assert (tmp_path / 't.md').read_text() == f'{text}\n{NOTES_MARKER}\nnotes written by hand\n'
    step_alone = rates['model step alone']
    assert f"| train.py (both) | {rates['train.py (both)']:.1f} | {rates['train.py (both)'] / step_alone:.2f} |" in text
    assert f'| model step alone | {step_alone:.1f} | 1.00 |' in text and 'recipe configs/base/deit.yaml' in text


def test_train_throughput_reads_its_images_as_an_image_folder_under_the_demo_recipe(tmp_path):
    """With `--cfg configs/demo/digits.yaml` the loader and the step were measured on the written ImageFolder, then
    train.py, given the recipe's DATA.DATASET 'digits', refused that folder as no digits cache, minutes in."""
    data = str(tmp_path / 'data')
    train_throughput.write_images(data, classes=2, per_class=1)
    args = train_throughput.build_parser().parse_args(
        ['--cfg', os.path.join(os.path.dirname(SCRIPTS), 'configs', 'demo', 'digits.yaml'), '--classes', '2',
         '--out', str(tmp_path / 't')])
    cfg = train_throughput.load_config(args.cfg, train_throughput.train_opts(args, data) +
                                       ['OUTPUT', str(tmp_path / 'out')])
    info = train_throughput.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cpu'))
    assert cfg.DATA.DATASET == 'imagefolder' and resolve_data_root(cfg, info) == data


def test_train_throughput_runs_train_py_with_its_own_threads_and_names_its_failure(tmp_path, monkeypatch):
    """train.py ran with torch's default thread count whatever --threads set here (a 1-thread step against a
    2-thread train.py gave train.py 1.70x the step it contains), and its failure was a CalledProcessError
    traceback. (train.py's command line runs in this process, through the entry function train.py calls.)"""
    args = train_throughput.build_parser().parse_args(['--classes', '2', '--out', str(tmp_path / 't')])
    seen = {}

    def run(command, **kwargs):
        assert command[:2] == [sys.executable, os.path.join(os.path.dirname(SCRIPTS), 'train.py')]
        seen.update(kwargs.get('env') or {})
        with contextlib.redirect_stderr(io.StringIO()) as err:
            status = run_cli(train_main, command[2:])
        return subprocess.CompletedProcess(command, status, stderr=err.getvalue())

    monkeypatch.setattr(subprocess, 'run', run)
    # not the tests' own count, which their children inherit (conftest.py)
    monkeypatch.setattr(torch, 'get_num_threads', lambda: 3)
    with pytest.raises(UsageError) as failed:
        train_throughput.train_py_rate(args, str(tmp_path / 'missing'), str(tmp_path / 'run'), epochs=2)
    assert seen['OMP_NUM_THREADS'] == '3'
    assert str(failed.value) == (f"train.py failed, so no rate of it: data path {str(tmp_path / 'missing')!r} does "
                                 f"not exist; expected a folder with train and val inside")


@pytest.mark.parametrize('flag, value, least', [('--batches', 0, 1), ('--repeats', 0, 1), ('--epochs', 1, 2),
                                               ('--classes', 0, 1), ('--per-class', 0, 1), ('--threads', -1, 0),
                                               ('--workers', -1, 0), ('--batch-size', -2, 0)])
def test_train_throughput_refuses_a_count_below_its_minimum_before_measuring(flag, value, least, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        train_throughput.main([flag, str(value), '--out', str(tmp_path / 't')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f'error: {flag} {value}: expected {least} or more')
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('argv, message', [
    # named as one of the overrides after -- (the script has no --opts)
    (['--', 'TRAIN.EPOCH', '3'],
     "unknown config key TRAIN.EPOCH in the config overrides after --; did you mean TRAIN.EPOCHS?"),
    (['--model', 'inline_deit_tinny'], "unknown model 'inline_deit_tinny'"),
    (['--data', 'missing'], "data path 'missing' does not exist; expected a folder with train and val inside"),
])
def test_train_throughput_checks_config_model_and_data_before_generating_or_measuring(argv, message, tmp_path,
                                                                                     monkeypatch, capsys):
    """A misspelt key or model failed after the images were written and the loader measured, minutes in."""
    monkeypatch.chdir(tmp_path)
    for work in ('write_images', 'loader_rate', 'model_rate', 'train_py_rate'):
        monkeypatch.setattr(train_throughput, work, lambda *args, work=work: pytest.fail(work))
    assert run_cli(train_throughput.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: {message}') and err.count('\n') == 1


def without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process see no CUDA device, as a machine without a GPU does."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)


def test_train_throughput_refuses_a_device_this_machine_lacks_before_generating_data(tmp_path, monkeypatch, capsys):
    without_cuda(monkeypatch)
    monkeypatch.setattr(train_throughput, 'write_images', lambda *args: pytest.fail('generated data'))
    with pytest.raises(SystemExit) as stopped:
        train_throughput.main(['--device', 'cuda', '--out', str(tmp_path / 't')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --device: device 'cuda': no CUDA device is available on this machine; expected 'cpu'")
    assert not list(tmp_path.iterdir())


def test_resolve_device_names_the_bad_device_and_what_this_machine_has(monkeypatch):
    assert resolve_device('cpu') == torch.device('cpu')
    with pytest.raises(UsageError, match=r"^device 'gpu' is not supported; expected 'cpu', 'cuda' or 'cuda:N'$"):
        resolve_device('gpu')
    with pytest.raises(UsageError, match=r"^device 'mps' is not supported"):
        resolve_device('mps')
    without_cuda(monkeypatch)
    with pytest.raises(UsageError, match=r"^device 'cuda:0': no CUDA device is available on this machine"):
        resolve_device('cuda:0')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    assert resolve_device('cuda:1') == torch.device('cuda', 1)
    with pytest.raises(UsageError, match=r"^device 'cuda:2': this machine has 2 CUDA device\(s\); expected an index "
                                         r"below 2$"):
        resolve_device('cuda:2')


@pytest.mark.parametrize('args, message', [
    (['--device', 'cuda'], "--device: device 'cuda': no CUDA device is available on this machine; expected 'cpu'"),
    (['--device', 'cdua'], "--device: device 'cdua' is not supported; expected 'cpu', 'cuda' or 'cuda:N'"),
    (['--batch-size', '0'], '--batch-size 0: expected 1 or more'),
    (['--iters', '0'], '--iters 0: expected 1 or more'),
    (['--train-iters', '0'], '--train-iters 0: expected 1 or more'),
    (['--warmup', '-1'], '--warmup -1: expected 0 or more'),
    (['--threads', '-2'], '--threads -2: expected 0 or more'),
    (['--matmul-size', '0'], '--matmul-size 0: expected 1 or more'),
    (['--timeout', '0'], '--timeout 0: expected 1 or more'),
    (['--train-max-resolution', '0'], '--train-max-resolution 0: expected 1 or more'),
    (['--resolutions', '224', '0'], '--resolutions: resolution 0 is below 1; expected positive numbers or '
                                    'FAMILY=R1,R2 with FAMILY one of deit, pvt, pvt_v2, swin, cswin'),
    (['--resolutions', 'vit=224'], "--resolutions: unknown family 'vit'; expected positive numbers"),
    (['--families', 'deit', '--resolutions', '224', 'swin=448'],
     "--resolutions: swin=448 is for family 'swin', which --families leaves out; expected positive numbers or "
     "FAMILY=R1,R2 with FAMILY one of deit"),
    (['--families', 'deit', 'swin', '--resolutions', 'swin=448'],
     "--resolutions: no resolution for family 'deit'; expected positive numbers or FAMILY=R1,R2 with FAMILY one "
     "of deit, swin"),
    (['--families', 'pvt', '--sizes', 'tiny', 'huge'],
     '--sizes huge: no model softmax_pvt_huge; softmax_pvt has sizes large, medium, small, tiny'),
    (['--families', 'pvt_v2', '--sizes', 'huge'], '--sizes huge: no model softmax_pvt_v2_huge; softmax_pvt_v2 has '
                                                  'sizes tiny, small, medium, large, b0, b1, b2, b2_li, b3, b4, b5'),
])
def test_benchmark_refuses_what_no_measurement_could_take_before_building_a_model(args, message, tmp_path,
                                                                                  monkeypatch, capsys):
    without_cuda(monkeypatch)
    monkeypatch.setattr(benchmark, 'run_group', lambda *a: pytest.fail('measured'))
    with pytest.raises(SystemExit) as stopped:
        benchmark.main(['--attentions', 'softmax', '--out', str(tmp_path / 'b')] + args)
    assert stopped.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.split(' error: ', 1)[1].startswith(message), last
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('flag, message', [
    ('--onednn', "error: --onednn runs on the CPU with oneDNN (torch.backends.mkldnn); got device 'cuda'"),
    ('--ceiling', "error: --ceiling runs on the CPU; got device 'cuda'"),
])
def test_benchmark_refuses_the_cpu_only_measures_on_a_gpu(flag, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(benchmark, 'run_group', lambda *a: pytest.fail('measured'))
    with pytest.raises(SystemExit) as stopped:
        benchmark.main(['--device', 'cuda', flag, '--out', str(tmp_path / 'b')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


class _UncountableOnItsDevice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("no implementation found for 'torch.ops.higher_order.flex_attention'")


def test_benchmark_counts_the_flops_of_a_model_off_the_cpu_on_a_cpu_model_of_its_spec():
    """On CUDA, MultiMax calls compiled FlexAttention, which raises under torch's FLOP counter: the benchmark
    counts a CPU model of the same spec instead, on one image times the batch (the meta device stands in for CUDA,
    a model that raises for MultiMax's CUDA path), with the same FLOPs as the model counted on the CPU."""
    spec = dict(model='softmax_deit_tiny', kwargs=dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                                       num_classes=5, attn_type='multimax'))
    x = torch.randn(3, 3, 32, 32)
    expected = benchmark.model_flops(spec, timm.create_model(spec['model'], **spec['kwargs']), x, train=True)
    assert expected['infer'] > 0 and expected['train'] > 2 * expected['infer']
    assert benchmark.model_flops(spec, _UncountableOnItsDevice(), x.to('meta'), train=True) == expected
    assert benchmark.model_flops(spec, _UncountableOnItsDevice(), x.to('meta'), train=False) == dict(
        infer=expected['infer'], train=None)


def test_benchmark_ceiling_replays_exactly_the_counted_ops_of_a_pass():
    """The ceiling's replay of a tiny softmax DeiT (patch convolution, linear layers, the CPU attention kernel)
    runs only ops the FLOP counter counts, and all of them: the same FLOPs as the pass, forward and backward."""
    model = timm.create_model('softmax_deit_tiny', img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=5)
    x = torch.randn(2, 3, 32, 32)

    def infer():
        with torch.no_grad():
            model(x)

    def train_step():
        model(x).sum().backward()

    for train, step in ((False, infer), (True, train_step)):
        model.train(train)
        replay = benchmark.counted_ops_alone(step)
        counter = benchmark.flop_counter()
        with counter, DispatchRecorder() as recorder:
            replay()
        assert counter.get_total_flops() == benchmark.count_flops(model, x, train) > 0
        assert {op._overloadpacket for op in recorder.ops} <= set(flop_registry) | set(benchmark.FLOP_FORMULAS)
        assert torch.ops.aten.native_layer_norm.default not in recorder.ops


@pytest.mark.usefixtures('measuring_here')
def test_benchmark_ceiling_column_gives_each_model_and_its_compiled_twin_the_eager_models_ceiling(tmp_path):
    out = tmp_path / 'b'
    benchmark.main(['--device', 'cpu', '--families', 'deit', '--sizes', 'tiny', '--attentions', 'softmax',
                    '--resolutions', '32', '--no-reference', '--iters', '1', '--train-iters', '1', '--warmup', '0',
                    '--matmul-size', '64', '--ceiling', '--out', str(out)])
    with open(str(out) + '.csv') as f:
        row = next(csv.DictReader(f))
    assert float(row['infer_ceiling_pct']) > 0 and float(row['train_ceiling_pct']) > 0
    assert '| infer % best | infer ceiling % | train step ms |' in (tmp_path / 'b.md').read_text()
    eager = dict(params_m=1.0, gflops=1.0, infer_img_s=1.0, infer_mm_pct=1.0, infer_best_pct=1.0,
                 infer_ceiling_pct=70.0, train_ceiling_pct=60.0, infer_matmul_gflop_s=1.0, infer_mem_mib=1.0)
    compiled = dict(eager, infer_ceiling_pct=None, train_ceiling_pct=None)
    spec = dict(label='softmax', model='softmax_deit_tiny')
    row = benchmark.result_row(compiled, {'softmax': eager, 'softmax' + benchmark.COMPILED: compiled}, spec,
                               benchmark.COMPILED)
    assert (row['infer_ceiling_pct'], row['train_ceiling_pct']) == (70.0, 60.0)



@pytest.mark.parametrize('code, timeout, expected', [
    ('print("progress"); print(\'[{"kernel": "zoo", "forward_ms": 1.5}]\')', 60,
     [{'kernel': 'zoo', 'forward_ms': 1.5}]),
    ('import sys; print("warming up", file=sys.stderr); raise MemoryError("no room for 4 GiB")', 60,
     'MemoryError: no room for 4 GiB'),
    ('import sys; sys.exit(3)', 60, 'exit status 3'),
    ('import time; time.sleep(30)', 1, 'timeout after 1 s'),
])
def test_the_measuring_process_gives_its_last_json_line_or_why_it_has_none(code, timeout, expected):
    assert benchmark.child_results([sys.executable, '-c', code], timeout) == expected


def documented_fla_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, normalize: bool,
                                    eps: float) -> Tuple[torch.Tensor, None]:
    """What fla-core's normalised linear-attention kernels compute by their documentation, as a masked formula: q, k
    (B, T, H, K), v (B, T, H, V) -> out (B, T, H, V) = Σ_{s≤t} (q_t·k_s) v_s / (Σ_{s≤t} q_t·k_s + eps), times
    `scale` inside both sums; fla-core's own eps is 1e-10."""
    assert normalize
    T = q.shape[1]
    scores = torch.einsum('bthk,bshk->bhts', q, k).mul(scale).tril()
    out = torch.einsum('bhts,bshv->bthv', scores, v) / (scores.sum(-1).transpose(1, 2)[..., None] + eps)
    assert out.shape[1] == T
    return out, None


# with the zoo's normaliser floor, so that the two agree to float64 rounding
FLA_AS_DOCUMENTED = functools.partial(documented_fla_linear_attention, eps=1e-6)


def test_compare_fla_gives_the_kernels_what_the_zoos_causal_linear_mixer_computes():
    """fla-core's kernels take φ(q) and φ(k) with tokens before heads and a scale of 1: given the documented
    computation, the comparison's fla path is the zoo's causal linear mixer, across its chunks."""
    heads, dim, tokens = 3, 24, 150
    q, k, v = (torch.randn(2, tokens, dim, dtype=torch.float64) for _ in range(3))
    zoo = compare_fla.zoo_attention(dim, heads)(q, k, v)
    through_fla = compare_fla.fla_attention(FLA_AS_DOCUMENTED, heads)(q, k, v)
    assert through_fla.shape == zoo.shape == (2, tokens, dim)
    torch.testing.assert_close(through_fla, zoo, rtol=1e-12, atol=1e-12)


def test_compare_fla_measures_errors_memory_and_interleaved_times_and_reports_a_failing_kernel():
    def unnormalised(q, k, v, scale, normalize):
        out, _ = FLA_AS_DOCUMENTED(q, k, v, scale, normalize)
        return out * 2, None

    def failing(*args, **kwargs):
        raise RuntimeError('out of resources: shared memory')

    args = compare_fla.build_parser().parse_args(['--child', '--device', 'cpu', '--tokens', '130', '--batch-size', '2',
                                                  '--heads', '2', '--head-dim', '8', '--dtype', 'float32',
                                                  '--rounds', '3', '--warmup', '1'])
    (args.tokens,) = args.tokens
    kernels = dict(documented=FLA_AS_DOCUMENTED, doubled=unnormalised, failing=failing)
    rows = {row['kernel']: row for row in compare_fla.measure(args, compare_fla.build_attentions(16, 2, kernels))}
    assert list(rows) == ['zoo', 'zoo (compiled)', 'fla documented', 'fla doubled', 'fla failing']
    for name in ('zoo', 'zoo (compiled)', 'fla documented'):
        errors = [rows[name][key] for key in ('out', 'grad_q', 'grad_k', 'grad_v')]
        assert all(0 <= e < 1e-5 for e in errors), (name, errors)  # float32 against float64
        assert rows[name]['forward_ms'] > 0 and rows[name]['train_ms'] > 0
        assert 0 < rows[name]['forward_mib'] < rows[name]['train_mib']
    assert rows['zoo']['forward_vs_zoo'] == rows['zoo']['train_vs_zoo'] == 1.0
    assert rows['fla documented']['train_vs_zoo'] == pytest.approx(rows['zoo']['train_ms'] /
                                                                   rows['fla documented']['train_ms'])
    assert rows['fla doubled']['out'] == pytest.approx(1.0, rel=1e-5)
    assert rows['fla failing'] == dict(tokens=130, kernel='fla failing',
                                       error='RuntimeError: out of resources: shared memory')


@pytest.mark.parametrize('args, message', [
    (['--device', 'cpu'], "--device cpu: fla-core's kernels are Triton kernels for GPUs; expected 'cuda' or 'cuda:N'"),
    (['--tokens', '1024', '0'], '--tokens 0: expected 1 or more'),
    (['--warmup', '-1'], '--warmup -1: expected 0 or more'),
    (['--device', 'cuda:3'], "device 'cuda:3': this machine has 1 CUDA device(s); expected an index below 1"),
    ([], "fla-core cannot be imported (ModuleNotFoundError: import of fla.ops.linear_attn halted; None in "
         "sys.modules); expected it installed (pip install fla-core) on a machine with a CUDA device"),
])
def test_compare_fla_refuses_in_one_line_before_measuring(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setitem(sys.modules, 'fla.ops.linear_attn', None)
    monkeypatch.setattr(compare_fla, 'run_child', lambda *a: pytest.fail('measured'))
    with pytest.raises(SystemExit) as stopped:
        compare_fla.main(args + ['--out', str(tmp_path / 'f')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].split(' error: ', 1)[1] == message
    assert not list(tmp_path.iterdir())


def test_compare_fla_keeps_the_last_results_when_no_kernel_was_measured(tmp_path, monkeypatch, capsys):
    """Every token count failing (a timeout, memory at every size) wrote a table of errors over the last run's
    results, with status 0."""
    monkeypatch.setattr(compare_fla, 'check_arguments', lambda parser, args: None)
    monkeypatch.setattr(compare_fla, 'run_child',
                        lambda args, tokens: [dict(tokens=tokens, kernel='all', error='timeout after 1800 s')])
    out = tmp_path / 'f'
    for suffix, text in (('.json', '[]\n'), ('.md', 'last run\n')):
        out.with_suffix(suffix).write_text(text)
    assert run_cli(compare_fla.main, ['--tokens', '64', '128', '--out', str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: no kernel was measured at any token count (the first: 64 tokens, timeout after 1800 s); {out}.json "
        f"and .md are unchanged")
    assert (out.with_suffix('.json').read_text(), out.with_suffix('.md').read_text()) == ('[]\n', 'last run\n')
    assert sorted(os.listdir(tmp_path)) == ['f.json', 'f.md']


@pytest.mark.parametrize('script, argv, prefix', [
    ('benchmark', ['--attentions', 'softmax'], True),
    ('compare_fla', [], True),
    ('train_throughput', [], True),
    ('attention_stats', ['--models', 'inline_deit_tiny', '--data', '.'], True),
    ('visualize_attention', ['--model', 'inline_deit_tiny', '--image', '.'], False),
])
def test_an_out_that_cannot_be_written_is_one_line_before_any_work(script, argv, prefix, tmp_path, monkeypatch,
                                                                   capsys):
    """A file where `--out` needs a folder stops the script with its arguments, not when it writes its results."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # compare_fla runs on CUDA machines only
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')
    out = blocker / 'out'
    with pytest.raises(SystemExit) as stopped:
        load_script(script).main(argv + ['--out', str(out)])
    assert stopped.value.code == 2
    problem = f"{str(blocker)!r} is a file" if prefix else f"{str(out)!r} cannot be made: {str(blocker)!r} is a file"
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: output folder {problem}; expected a folder (--out {out})")
    assert os.listdir(tmp_path) == ['file']


@pytest.mark.parametrize('script, argv, suffix', [
    ('benchmark', ['--attentions', 'softmax'], '.csv'),
    ('compare_fla', [], '.json'),
    ('train_throughput', [], '.md'),
    ('attention_stats', ['--models', 'inline_deit_tiny', '--data', '.'], '.png'),
])
def test_an_out_whose_file_name_is_a_folder_is_one_line_before_any_work(script, argv, suffix, tmp_path,
                                                                        monkeypatch, capsys):
    """A folder named like one of the files (`b.md/`) was refused by the writer after every model was measured,
    which lost the measurements."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    out = tmp_path / 'out'
    (tmp_path / f'out{suffix}').mkdir()
    with pytest.raises(SystemExit) as stopped:
        load_script(script).main(argv + ['--out', str(out)])
    assert stopped.value.code == 2
    assert re.search(rf"error: --out {re.escape(str(out))}: '{re.escape(str(out))}{suffix}' is a folder; expected a "
                     rf"prefix whose files \(.*{suffix}.*\) are not folders$", capsys.readouterr().err.splitlines()[-1])


# A tiny class-token DeiT for the figures of visualize_attention.py.
TINY_DEIT = ['DATA.IMG_SIZE', '16', 'MODEL.NUM_CLASSES', '10', 'MODEL.KWARGS.patch_size', '4',
             'MODEL.KWARGS.embed_dim', '16', 'MODEL.KWARGS.depth', '2', 'MODEL.KWARGS.num_heads', '2']


def test_visualize_attention_refuses_an_out_holding_an_earlier_run_s_figures_and_overwrite_replaces_them(
        tmp_path, monkeypatch, capsys):
    """A second run into the same --out left the first model's figures (its Grad-CAM) beside the second's, under
    names without the model's: it is refused before any model is built, the first run's files intact, and with
    --overwrite the folder holds exactly the second run's figures, beside the user's own files."""
    visualize = load_script('visualize_attention')
    image, out = tmp_path / 'digit.png', tmp_path / 'figures'
    Image.new('L', (8, 8), 90).save(image)
    common = ['--image', str(image), '--queries', '4,4', '--out', str(out)]
    assert run_cli(visualize.main, ['--model', 'softmax_deit_tiny', *common, '--gradcam', '--opts', *TINY_DEIT]) == 0
    first = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert sorted(first) == ['.visualize_attention.txt', 'digit_blocks-0-attn_y4x4.png', 'digit_blocks-1-attn_y4x4.png',
                             'digit_gradcam.png', 'digit_rollout.png']
    (out / 'notes.txt').write_text('mine\n')
    capsys.readouterr()
    second = ['--model', 'inline_deit_tiny', *common, '--opts', *TINY_DEIT]
    with monkeypatch.context() as patch:
        patch.setattr(visualize, 'load_analysis_model', lambda *args, **kwargs: pytest.fail('model built'))
        with pytest.raises(SystemExit) as stopped:
            visualize.main(second)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"visualize_attention.py: error: --out {out}: the folder holds 4 figure(s) of an "
                                    f"earlier run; expected a new or empty folder, or --overwrite to replace them")
    assert {name: (out / name).read_bytes() for name in first} == first
    assert run_cli(visualize.main, ['--overwrite', *second]) == 0
    assert capsys.readouterr().out.endswith(f"wrote 3 figures to {out} in place of the earlier run's 4\n")
    figures = ['digit_blocks-0-attn_y4x4.png', 'digit_blocks-1-attn_y4x4.png', 'digit_rollout.png']
    assert sorted(os.listdir(out)) == sorted(['.visualize_attention.txt', 'notes.txt', *figures])
    listed = (out / '.visualize_attention.txt').read_text().splitlines()
    assert listed[0].startswith('#') and sorted(listed[1:]) == figures
    assert (out / 'notes.txt').read_text() == 'mine\n'
    assert all((out / name).read_bytes() != first[name] for name in figures)  # the second model's, not the first's


@pytest.mark.parametrize('overwrite', [[], ['--overwrite']])
def test_visualize_attention_refuses_an_out_holding_png_files_it_did_not_write(overwrite, tmp_path, monkeypatch,
                                                                               capsys):
    """PNG files no earlier run listed (figures of a run before the manifest, or the user's own) would stand beside
    the new figures, and --overwrite never removes them: refused either way, before any model is built."""
    visualize = load_script('visualize_attention')
    monkeypatch.setattr(visualize, 'load_analysis_model', lambda *args, **kwargs: pytest.fail('model built'))
    (tmp_path / 'b.png').write_bytes(b'mine')
    (tmp_path / 'a_rollout.png').write_bytes(b'mine too')
    with pytest.raises(SystemExit) as stopped:
        visualize.main(['--model', 'softmax_deit_tiny', '--image', str(tmp_path / 'b.png'), '--out', str(tmp_path),
                        *overwrite])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"visualize_attention.py: error: --out {tmp_path}: the folder holds 2 PNG file(s) that no earlier run listed "
        f"in its .visualize_attention.txt, such as 'a_rollout.png'; expected a folder without other PNG files, which "
        f"--overwrite would leave beside this run's figures: move them away or choose another --out")
    assert sorted(os.listdir(tmp_path)) == ['a_rollout.png', 'b.png']


def test_visualize_attention_checks_its_queries_against_the_input_size_before_building_the_model(
        tmp_path, monkeypatch, capsys):
    """`--queries 400,3` of a 224-pixel model was refused only after its released weights were downloaded and read
    and the images decoded, though the config gives the input size before any of them."""
    import engine.analysis
    visualize = load_script('visualize_attention')
    for step in ('create_model', 'weights_file', 'load_weights'):
        monkeypatch.setattr(engine.analysis, step, lambda *args, called=step, **kwargs: pytest.fail(f'{called} called'))
    monkeypatch.setattr(visualize, 'load_images', lambda *args, **kwargs: pytest.fail('images decoded'))
    image = tmp_path / 'digit.png'
    Image.new('L', (8, 8), 90).save(image)
    argv = ['--model', 'inline_deit_tiny', '--pretrained', '--image', str(image), '--queries', 'cls', '400,3',
            '--out', str(tmp_path / 'figures')]
    assert run_cli(visualize.main, argv) == 2
    assert capsys.readouterr().err == "error: query '400,3' is outside the 224x224 image\n"
    assert not os.listdir(tmp_path / 'figures')  # made to prove it takes files, removed at exit


def test_compare_fla_keeps_the_notes_below_its_table(tmp_path, monkeypatch):
    """docs/fla_comparison.md's reading below its table was overwritten by the next run, as benchmark.py's and
    train_throughput.py's notes are not; notes that are not UTF-8 are kept byte for byte (they gave a traceback
    after the whole run)."""
    monkeypatch.setattr(compare_fla, 'check_arguments', lambda parser, args: None)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'test GPU')
    monkeypatch.setattr(importlib.metadata, 'version', lambda name: '0.6.0')
    measured = dict(tokens=64, kernel='fla chunk_linear_attn', out=1e-3, grad_q=1e-3, grad_k=1e-3, grad_v=1e-3,
                    forward_ms=0.5, train_ms=2.0, forward_mib=32.0, train_mib=96.0, forward_vs_zoo=1.0,
                    train_vs_zoo=1.0)
    monkeypatch.setattr(compare_fla, 'run_child', lambda args, tokens: [measured])
    out = tmp_path / 'f'
    notes = f'{NOTES_MARKER}\n## Reading\nwritten by hand, caf\xe9 in Latin-1\n'.encode('latin-1')
    out.with_suffix('.md').write_bytes(b'the last table\n\n' + notes)
    compare_fla.main(['--tokens', '64', '--out', str(out)])
    text = out.with_suffix('.md').read_bytes()
    assert b'the last table' not in text and b'| 64 | fla chunk_linear_attn |' in text and text.endswith(b'\n' + notes)


def test_compare_fla_refuses_a_machine_without_cuda(tmp_path, monkeypatch, capsys):
    without_cuda(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        compare_fla.main(['--out', str(tmp_path / 'f')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --device cuda: this machine has no CUDA device, and fla-core's kernels are Triton kernels for GPUs; "
        "expected a machine with one")


def test_compare_fla_table_states_its_setting_and_shows_failed_and_unrelated_rows(monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['scripts/compare_fla.py', '--tokens', '4096'])
    args = compare_fla.build_parser().parse_args(['--tokens', '4096'])
    measured = dict(tokens=4096, kernel='fla chunk_linear_attn', out=1.5e-3, grad_q=2e-3, grad_k=3e-3, grad_v=4e-3,
                    forward_ms=0.5, train_ms=2.0, forward_mib=32.0, train_mib=96.0, forward_vs_zoo=3.0,
                    train_vs_zoo=None)
    failed = dict(tokens=65536, kernel='all', error='timeout after 1800 s')
    lines = compare_fla.table(args, [measured, failed], 3.0, 'NVIDIA H100', '0.6.0')
    assert '- device: NVIDIA H100' in lines
    assert '- versions: torch {}, fla-core 0.6.0, Python {}'.format(torch.__version__, platform.python_version()) \
        in lines
    assert '- command: `python scripts/compare_fla.py --tokens 4096` (3 min)' in lines
    assert '| 4096 | fla chunk_linear_attn | 1.5e-03 | 2.0e-03 | 3.0e-03 | 4.0e-03 | 0.500 | 3.00 | 32 | 2.000 | – | ' \
           '96 |' in lines
    assert '| 65536 | all | timeout after 1800 s |' + ' |' * 9 in lines
    header = lines.index('| tokens | kernel | out err | grad q err | grad k err | grad v err | forward ms | '
                         'forward ×zoo | forward MiB | fwd+bwd ms | fwd+bwd ×zoo | fwd+bwd MiB |')
    assert [line.count('|') for line in lines[header:]] == [13] * 4


def child_pids(pid: int):
    """The processes whose parent is `pid`, from Linux's /proc."""
    children = []
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/stat') as f:
                stat = f.read()
        except (OSError, ValueError):
            continue  # not a process, or one that ended
        if int(stat.rsplit(')', 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return children


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
def test_a_stop_during_a_benchmark_is_one_line_and_ends_its_measuring_process(tmp_path, signum):
    """The scripts run through the engine's command-line wrapper, as train.py does: an interruption while the
    benchmark measures is `error: interrupted by SIGINT` (or SIGTERM) and status 128 + the signal, not a
    KeyboardInterrupt traceback, and the measuring process ends with it (after SIGTERM it went on alone, adopted
    by init, for up to --timeout)."""
    command = [sys.executable, os.path.join(SCRIPTS, 'benchmark.py'), '--device', 'cpu', '--threads', '1',
               '--families', 'deit', '--sizes', 'tiny', '--attentions', 'softmax', '--resolutions', '32', '--iters',
               '200', '--warmup', '0', '--no-train', '--matmul-size', '64', '--out', str(tmp_path / 'b')]
    # Ctrl-C as a terminal delivers it, also where this test runs with SIGINT ignored (a job started in the
    # background without job control), which the benchmark would inherit
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    started = ''
    while 'deit-tiny @ 32' not in started and process.poll() is None:
        started += process.stderr.readline()
    deadline = time.monotonic() + 60
    while not child_pids(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    measuring = child_pids(process.pid)
    assert measuring, started
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (128 + signum, f'error: interrupted by {signum.name}\n')
    assert not (tmp_path / 'b').exists() or not os.listdir(tmp_path / 'b')
    # killed as the wrapper unwinds; init may take a moment to collect it
    deadline = time.monotonic() + 10
    while [pid for pid in measuring if os.path.exists(f'/proc/{pid}')] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in measuring if os.path.exists(f'/proc/{pid}')]


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
def test_a_stop_while_train_throughput_writes_its_images_is_one_line_and_removes_them(tmp_path, signum):
    """SIGTERM before train.py ran ended the script silently and left its generated images (about 70 MB with the
    defaults) in the temporary folder; every script now unwinds from SIGTERM as from Ctrl-C."""
    scratch = tmp_path / 'tmp'
    scratch.mkdir()
    command = [sys.executable, os.path.join(SCRIPTS, 'train_throughput.py'), '--classes', '2', '--per-class', '5000',
               '--batches', '1', '--repeats', '1', '--', 'DATA.IMG_SIZE', '32']
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, TMPDIR=str(scratch)),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not any(scratch.rglob('*.jpg')) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None and any(scratch.rglob('*.jpg'))
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (128 + signum, f'error: interrupted by {signum.name}\n')
    assert not list(scratch.iterdir())


def test_the_readme_zoo_table_is_the_one_zoo_table_prints(monkeypatch):
    """The README's table of official models, apart from what zoo_table.py measures (taken from the README here,
    so no model is built): the rows, official top-1, release tags and configs; and every released weights file
    of the zoo has its row."""
    text = open(os.path.join(os.path.dirname(SCRIPTS), 'README.md')).read()
    start = text.index('| model | resolution | params (M) | FLOPs (G) | official top-1 | weights | config |')
    readme = text[start:text.index('\n\n', start)].splitlines()
    measured = {}
    for row in readme[2:]:
        name, resolution, params, flops = [cell.strip() for cell in row.strip('|').split('|')][:4]
        measured[name.strip('`')] = (int(resolution), float(params) * 1e6, float(flops) * 1e9)
    monkeypatch.setattr(zoo_table, 'measure', lambda name: measured[name])
    assert zoo_table.official_table() == readme
    released = {name for name in timm.list_pretrained()
                if name.split('_')[0] in list_attentions() and timm.models.get_pretrained_cfg(name).has_weights}
    listed = {name if '.' in name else f'{name}.{timm.models.get_pretrained_cfg(name).tag}' for name in measured}
    assert released and released <= listed, sorted(released - listed)
