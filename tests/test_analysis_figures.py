"""The figures and the analysis scripts: the simplex points against their closed forms, and both scripts on tiny
models writing non-empty PNG, CSV and Markdown files, with one-line errors for bad input."""
import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pytest
import timm
import torch
from PIL import Image

import engine.analysis
import engine.checkpoint
import engine.loops
from engine.analysis import load_analysis_model
from engine.errors import UsageError, run_cli
from models.analysis import matrices, plots, record_attention
from models.attention import registry
from models.attention.additive import AdditiveMixer
from models.attention.linear import LinearMixer
from models.attention import build_attention, register_attention
from models.analysis.plots import SIMPLEX_TEMPERATURES, plot_simplex, simplex_logits, simplex_points

from reference import max_abs_err
from test_scripts import load_script

visualize = load_script('visualize_attention')
attention_stats = load_script('attention_stats')

TINY = ['DATA.IMG_SIZE', '16', 'MODEL.NUM_CLASSES', '10', 'MODEL.KWARGS.patch_size', '4', 'MODEL.KWARGS.embed_dim',
        '16', 'MODEL.KWARGS.depth', '2', 'MODEL.KWARGS.num_heads', '2']


def closed_form_sparsemax(z: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto the simplex: τ from the k(z) largest entries, p = max(z − τ, 0)."""
    ordered = z.sort(dim=-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    cumulative = ordered.cumsum(dim=-1)
    support = (1 + k * ordered > cumulative).to(z.dtype)
    size = support.sum(dim=-1, keepdim=True)
    tau = (cumulative.gather(-1, size.long() - 1) - 1) / size
    return (z - tau).clamp(min=0)


def test_simplex_points_equal_their_closed_forms():
    logits = simplex_logits(steps=9)
    points = simplex_points(logits, torch.tensor([0.1, 0.2, -0.3, 0.4]), torch.tensor([0.5, 0.3, 0.2, 0.1]))
    for t in SIMPLEX_TEMPERATURES:
        e = torch.exp(logits / t)
        assert max_abs_err(points[f'softmax T={t:g}'], e / e.sum(dim=-1, keepdim=True)) < 1e-12
    assert max_abs_err(points['sparsemax'], closed_form_sparsemax(logits)) < 1e-12
    assert (points['sparsemax'] == 0).any()  # the grid reaches the simplex's edges
    for p in points.values():
        assert max_abs_err(p.sum(dim=-1), torch.ones(len(logits), dtype=torch.float64)) < 1e-12


def test_a_figure_interrupted_while_written_leaves_the_previous_one(tmp_path, monkeypatch):
    """Ctrl-C half-way through writing a figure over that of an earlier run keeps the earlier figure whole, leaves
    no temporary file and frees the figure."""
    path = tmp_path / 'simplex.png'
    plot_simplex(str(path))
    before = path.read_bytes()
    write_whole = matplotlib.figure.Figure.savefig

    def interrupted(fig, target, **kwargs):
        buffer = io.BytesIO()
        write_whole(fig, buffer, **{**kwargs, 'format': 'png'})
        half = buffer.getvalue()[:len(buffer.getvalue()) // 2]
        if isinstance(target, (str, os.PathLike)):
            Path(target).write_bytes(half)
        else:
            target.write(half)
        raise KeyboardInterrupt
    monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', interrupted)
    with pytest.raises(KeyboardInterrupt):
        plot_simplex(str(path), torch.tensor([0.1, 0.2, -0.3, 0.4]), torch.tensor([0.5, 0.3, 0.2, 0.1]))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ['simplex.png']
    assert plt.get_fignums() == []


@pytest.mark.parametrize('name', ['multimax', 'additive'])
def test_a_one_head_figure_keeps_its_whole_title(tmp_path, monkeypatch, name):
    """One head's panel is narrower than the attention, query and layer name on one line: the title was cut at
    both ends ('nax: query token 18, layers.0.blocks.1')."""
    model = timm.create_model('softmax_swin_tiny', attn_type=name, img_size=32, embed_dim=16, depths=[2, 1, 1, 1],
                              num_heads=[1, 2, 2, 2], window_size=4, num_classes=5).eval()
    figures = []
    monkeypatch.setattr(plots, '_save', lambda fig, path: figures.append(fig))
    with torch.no_grad(), record_attention(model, ['layers.0.blocks.1.attn'], [(0.5, 0.5)]) as rec:
        model(torch.randn(1, 3, 32, 32))
    plots.plot_query_maps(np.zeros((32, 32)), rec[0], 0, str(tmp_path / 'q.png'))
    fig = figures[0]
    renderer = fig.canvas.get_renderer()
    box, title = fig.bbox, fig._suptitle.get_text()
    extent = fig._suptitle.get_window_extent(renderer)
    assert title.endswith('\nlayers.0.blocks.1.attn') and box.x0 <= extent.x0 and extent.x1 <= box.x1
    plt.close(fig)


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp('images')
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8), mode='L').save(folder / f'{i}.png')
    return folder


def test_visualize_attention_names_each_image_s_figures_by_its_path_under_the_folder(tmp_path, capsys):
    """Images of one name in two class folders (`val/a/0.png`, `val/b/0.png`, as an ImageNet tree holds them) each
    get their figures: the second image's replaced the first one's, and the count said otherwise. Its progress
    over the images is no bar where stderr is no terminal."""
    for folder in ('a', 'b'):
        (tmp_path / 'val' / folder).mkdir(parents=True)
        Image.new('L', (8, 8), 40 if folder == 'a' else 200).save(tmp_path / 'val' / folder / '0.png')
    out = tmp_path / 'figures'
    argv = ['--model', 'softmax_deit_tiny', '--image', str(tmp_path / 'val'), '--layers', '-1', '--queries', 'cls',
            '--out', str(out), '--opts'] + TINY
    assert run_cli(visualize.main, argv) == 0
    assert sorted(os.listdir(out)) == [visualize.MANIFEST, 'a-0_blocks-1-attn_cls.png', 'a-0_rollout.png',
                                       'b-0_blocks-1-attn_cls.png', 'b-0_rollout.png']
    assert '\r' not in capsys.readouterr().err


def test_visualize_attention_gives_images_of_one_stem_and_repeated_queries_one_figure_each(tmp_path, capsys):
    """`x.png` and `x.jpg` in one folder, and a query given twice, wrote figures under one name, the second over the
    first, and the count said otherwise."""
    (tmp_path / 'val').mkdir()
    for extension, grey in (('png', 40), ('jpg', 200)):
        Image.new('L', (8, 8), grey).save(tmp_path / 'val' / f'x.{extension}')
    out = tmp_path / 'figures'
    argv = ['--model', 'softmax_deit_tiny', '--image', str(tmp_path / 'val'), '--layers', '-1', '--queries', '3,3',
            '03,3', 'cls', 'cls', '--out', str(out), '--opts'] + TINY
    assert run_cli(visualize.main, argv) == 0
    names = sorted(os.listdir(out))
    figures = [f'x-{extension}_{figure}.png' for extension in ('jpg', 'png')
               for figure in ('blocks-1-attn_y3x3', 'blocks-1-attn_cls', 'rollout')]
    assert names == sorted([visualize.MANIFEST, *figures])
    assert capsys.readouterr().out.endswith(f"wrote 6 figures to {out}\n")
    with pytest.raises(UsageError, match=r"^images 'v/a b\.png' and 'v/a-b\.png' would write figures of one name "
                                         r"\(a-b-png_\.\.\.\); expected paths that differ in more than punctuation$"):
        visualize.figure_stems(['v/a b.png', 'v/a-b.png', 'v/a_b.png'], 'v')
    # names in other scripts than Latin, or that differ in an accent, were one name or refused as punctuation
    assert visualize.figure_stems(['v/猫.png', 'v/犬.png', 'v/été.png', 'v/ête.png'], 'v') == ['猫', '犬', 'été', 'ête']


@pytest.fixture
def renamed_additive():
    """Additive attention under another name, as a user's subclass that keeps its `forward`."""
    @register_attention('renamed_additive')
    class RenamedAdditive(AdditiveMixer):
        pass
    yield RenamedAdditive.attention_name
    del registry._MIXERS[RenamedAdditive.attention_name]


@pytest.mark.parametrize('model', ['additive_deit_tiny', 'additive_pvt_tiny', 'renamed_additive_deit_tiny'])
def test_additive_class_token_models_say_why_they_draw_no_rollout_and_no_queries(images, tmp_path, capsys, model,
                                                                                 request):
    """They drew neither, silently, where the other class-token models say why; additive attention is known by
    its weights (pools), not its name: a renamed subclass drew pool figures as token queries, and failed."""
    opts = TINY if 'deit' in model else LATE_CLASS_TOKEN['softmax_pvt_tiny']
    attention = 'additive'
    if model.startswith('renamed'):
        attention = request.getfixturevalue('renamed_additive')
        model, opts = 'additive_deit_tiny', opts + ['MODEL.KWARGS.attn_type', attention]
    out = tmp_path / 'figures'
    argv = ['--model', model, '--image', str(images), '--max-images', '1', '--queries', '4,4', '--out', str(out),
            '--opts'] + opts
    assert run_cli(visualize.main, argv) == 0
    printed = capsys.readouterr().out
    assert (f"{attention} attention's layers pool the tokens: their figures show each pool's weights, not "
            f"--queries\n" in printed)
    assert (f'no attention rollout: {attention} attention pools the tokens into global vectors and forms no '
            'token-to-token weights to multiply through the layers\n' in printed)
    assert any(name.endswith('_pool0.png') for name in os.listdir(out))


def test_visualize_attention_writes_figures(images, tmp_path):
    out = tmp_path / 'figures'
    # the class-token DeiT with MultiMax blocks: class-token queries and rollout, MultiMax's sigma curve
    argv = ['--model', 'softmax_deit_tiny', '--image', str(images), '--max-images', '2', '--layers', '0',
            'blocks.1.attn', '--queries', '4,12', 'cls', '--gradcam', '--simplex', '--out', str(out), '--opts',
            'MODEL.KWARGS.attn_type', 'multimax'] + TINY
    assert run_cli(visualize.main, argv) == 0
    names = sorted(os.listdir(out))
    assert '0_blocks-0-attn_y4x12.png' in names and '1_blocks-1-attn_cls.png' in names
    assert {'0_rollout.png', '0_gradcam.png', 'multimax_sigma.png', 'simplex.png'} <= set(names)
    figures = [name for name in names if name != visualize.MANIFEST]
    assert all(os.path.getsize(out / name) > 1000 for name in figures)
    # every figure listed for the next run's --overwrite, beside a line that says what the file is
    assert sorted((out / visualize.MANIFEST).read_text().splitlines()[1:]) == figures


def test_a_query_pixel_is_the_token_of_its_patch_at_any_image_size():
    """Pixel 60 of an 88-pixel image lies in patch 15 of 22 (4 pixels each); as the fraction 60 / 88 it was taken for
    patch 14. The pixel's centre is inside its patch at every size."""
    assert visualize.parse_queries(['60,60', '0,87', 'cls'], 88, True) == [
        (60.5 / 88, 60.5 / 88), (0.5 / 88, 87.5 / 88), 0]
    torch.manual_seed(0)
    attn = build_attention('softmax', 16, 4, (22, 22)).eval()
    for pixel in range(88):
        with torch.no_grad(), record_attention(attn, queries=visualize.parse_queries([f'{pixel},{pixel}'], 88, False)) \
                as rec:
            attn(torch.randn(1, 22 * 22, 16), (22, 22))
        assert rec[0].queries.tolist() == [(pixel // 4) * 22 + pixel // 4], pixel


# Models whose class token joins late (PVT's last stage, SimA-XCiT's class attention), at tiny sizes.
LATE_CLASS_TOKEN = {
    'softmax_pvt_tiny': ['DATA.IMG_SIZE', '32', 'MODEL.KWARGS.embed_dims', '[8,16,16,16]', 'MODEL.KWARGS.num_heads',
                         '[1,2,2,2]', 'MODEL.KWARGS.depths', '[1,1,1,1]'],
    'sima_nano_12_p16': ['DATA.IMG_SIZE', '32', 'MODEL.KWARGS.embed_dim', '16', 'MODEL.KWARGS.depth', '1',
                         'MODEL.KWARGS.num_heads', '2'],
}


@pytest.mark.parametrize('model, opts, layer', [
    ('softmax_pvt_tiny', LATE_CLASS_TOKEN['softmax_pvt_tiny'], 'stages-3-blocks-0-attn'),
    ('sima_nano_12_p16', LATE_CLASS_TOKEN['sima_nano_12_p16'], 'blocks-0-attn'),
])
def test_class_token_models_without_a_rollout_draw_the_rest(images, tmp_path, capsys, model, opts, layer):
    """PVT's stages mix different tokens and XCiT's blocks mix channels, so the rollout the script adds for
    class-token models is not defined there: it says so and draws the other figures."""
    out = tmp_path / 'figures'
    argv = ['--model', model, '--image', str(images), '--max-images', '1', '--gradcam', '--out', str(out), '--opts']
    assert run_cli(visualize.main, argv + opts) == 0
    printed = capsys.readouterr().out
    assert "no attention rollout: rollout needs every token's row over the same tokens, a class token among them; " \
           "layer " in printed
    names = os.listdir(out)
    assert '0_gradcam.png' in names and any(name.startswith(f'0_{layer}_') for name in names)
    assert not any('rollout' in name for name in names)


@pytest.mark.parametrize('model, opts, layer, way', [
    ('softmax_pvt_tiny', LATE_CLASS_TOKEN['softmax_pvt_tiny'], 'stages.0.blocks.0.attn',
     'or --layers that hold the class token'),
    ('sima_nano_12_p16', LATE_CLASS_TOKEN['sima_nano_12_p16'], 'blocks.0.attn',
     'no layer this script records holds it'),
])
def test_a_class_token_query_on_a_layer_without_one_is_one_line(images, tmp_path, capsys, model, opts, layer, way):
    """PVT's class token joins in its last stage and SimA-XCiT's in its class attention: 'cls' on an earlier layer
    drew the top-left patch's row under a 'cls' file name. The way out names other layers only where one holds the
    token: SimA-XCiT's class attention is not recorded."""
    out = tmp_path / 'figures'
    argv = ['--model', model, '--image', str(images), '--max-images', '1', '--layers', layer, '--queries', 'cls',
            '--out', str(out), '--opts']
    assert run_cli(visualize.main, argv + opts) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: query 'cls': layer {layer} has no class token (its tokens are the ") \
        and err.endswith(f"grid); expected Y,X points for it, {way}\n")
    assert not out.exists() or not os.listdir(out)


@pytest.mark.parametrize('change,message', [
    (['--layers', 'blocks.7.attn'], "error: unknown layer 'blocks.7.attn'"),
    (['--queries', '16,3'], "error: query '16,3' is outside the 16x16 image"),
    # argparse read '-1,3' as an unknown option: "argument --queries: expected at least one argument"
    (['--queries', '-1,3'], "error: query '-1,3' is outside the image; expected Y,X pixel coordinates from its "
                            "top-left corner, 0 or more"),
    (['--queries', '3,-1'], "error: query '3,-1' is outside the image; expected Y,X pixel coordinates from its "
                            "top-left corner, 0 or more"),
    (['--image', 'missing.png'], "error: image 'missing.png' not found"),
])
def test_visualize_attention_names_bad_input_in_one_line(images, tmp_path, capsys, change, message):
    argv = {'--model': 'softmax_deit_tiny', '--image': str(images), '--out': str(tmp_path)}
    argv[change[0]] = change[1]
    argv = [part for pair in argv.items() for part in pair]
    assert run_cli(visualize.main, argv + ['--opts'] + TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count('\n') == 1


@pytest.mark.parametrize('script, data', [('visualize_attention', '--image'), ('attention_stats', '--data')])
def test_a_required_option_after_opts_is_named_as_misplaced_not_missing(images, tmp_path, capsys, script, data):
    main = {'visualize_attention': visualize.main, 'attention_stats': attention_stats.main}[script]
    argv = ['--models' if script == 'attention_stats' else '--model', 'softmax_deit_tiny', data, str(images),
            '--opts', 'MODEL.KWARGS.depth', '2', '--out', str(tmp_path / 'out')]
    assert run_cli(main, argv) == 2
    assert capsys.readouterr().err == ("error: --opts takes KEY VALUE pairs up to the end of the command, got the "
                                       "option --out among them; expected --out before --opts\n")
    assert not list(tmp_path.iterdir())


def test_a_failed_run_removes_the_empty_out_folders_it_made(images, tmp_path):
    """A query outside the image fails after `--out new/figures` was made to prove that it takes files: both new
    folders go, and the folder that was there before stays."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts',
                          'visualize_attention.py')
    failed = subprocess.run([sys.executable, script, '--model', 'softmax_deit_tiny', '--image', str(images),
                             '--queries', '16,3', '--out', str(tmp_path / 'new' / 'figures'), '--opts'] + TINY,
                            capture_output=True, text=True, timeout=300)
    assert (failed.returncode, failed.stderr) == (2, "error: query '16,3' is outside the 16x16 image\n")
    assert tmp_path.is_dir() and not list(tmp_path.iterdir())


def test_visualize_attention_refuses_no_images_before_building_the_model(images, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        visualize.main(['--model', 'softmax_deit_tiny', '--image', str(images), '--max-images', '0',
                        '--out', str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith('error: --max-images 0: expected 1 or more')
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('flag', ['--max-images', '--batch-size'])
def test_attention_stats_refuses_a_count_below_one_before_building_a_model(flag, images, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        attention_stats.main(['--models', 'softmax_deit_tiny', '--data', str(images), flag, '0',
                              '--out', str(tmp_path / 'stats')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f'error: {flag} 0: expected 1 or more')
    assert not list(tmp_path.iterdir())


def test_attention_stats_writes_csv_markdown_and_plot(images, tmp_path, monkeypatch, capsys):
    """...and shows its progress as train.py does: whole lines, not bar fragments, where stderr is no terminal."""
    monkeypatch.setattr(engine.loops, 'PLAIN_PROGRESS_SECONDS', 0.0)
    out = tmp_path / 'stats'
    argv = ['--models', 'softmax_deit_tiny', 'linear_deit_tiny', 'inline_deit_tiny', '--data', str(images),
            '--batch-size', '2', '--out', str(out), '--opts'] + TINY
    assert run_cli(attention_stats.main, argv) == 0
    err = capsys.readouterr().err
    assert '\r' not in err
    for model in ('softmax_deit_tiny', 'linear_deit_tiny', 'inline_deit_tiny'):  # 3 images in batches of 2
        progress = [line.split('] ', 1)[1] for line in err.splitlines() if f'] {model} ' in line]
        assert [line.split(',')[0] for line in progress] == [f'{model} 1/2 (50%)', f'{model} 2/2 (100%)']
    with open(f'{out}.csv') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 2 * 2  # models x layers x heads
    by_model = {row['model']: row for row in rows}
    assert float(by_model['softmax_deit_tiny']['negative']) == 0
    assert 0 < float(by_model['softmax_deit_tiny']['effective_tokens']) <= 17
    markdown = open(f'{out}.md').read()
    assert '| **inline_deit_tiny** | all |' in markdown and 'attention_stats.py' in markdown
    assert os.path.getsize(f'{out}.png') > 1000


def test_attention_stats_bold_row_averages_the_layers_not_the_heads():
    """A layer of 1 head and one of 4 (Swin's stages have 3 to 24): the bold row is the mean of the two layer means,
    as its header says, where it used to weigh the 4-head layer four times; a statistic a layer lacks (NaN) leaves
    the mean of the others."""
    statistics = attention_stats.STATISTICS

    def row(layer: str, value: float) -> dict:
        return dict(model='m', layer=layer, head=0, **{key: value for key in statistics}) | dict(negative=float('nan'))
    rows = [row('layers.0', 1.0)] + [row('layers.1', 3.0 + head) for head in range(4)]
    rows[0]['negative'] = 2.0
    lines = attention_stats.markdown_table(rows)
    cells = {line.split(' | ')[1]: line.strip('| ').split(' | ')[2:] for line in lines[2:]}
    entropy = statistics.index('entropy')
    negative = statistics.index('negative')
    assert cells['layers.0'][entropy] == '1' and cells['layers.1'][entropy] == '4.5'
    assert cells['all'][entropy] == '2.75'  # (1 + 4.5) / 2, not (1 + 3 + 4 + 5 + 6) / 5 = 3.8
    assert cells['layers.1'][negative] == '–' and cells['all'][negative] == '2'


def test_attention_stats_stopped_while_writing_keeps_the_previous_three_files(images, tmp_path, monkeypatch):
    """A stop after the new table was written and before its figure left the new CSV and Markdown beside the
    previous run's figure (or, on a first run, without one)."""
    out = tmp_path / 'stats'
    argv = ['--models', 'softmax_deit_tiny', '--data', str(images), '--batch-size', '2', '--out', str(out),
            '--opts'] + TINY
    assert run_cli(attention_stats.main, argv) == 0
    previous = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(previous) == ['stats.csv', 'stats.md', 'stats.png']

    def stopped_at_the_figure(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(attention_stats, 'plot_layer_curves', stopped_at_the_figure)
    argv[1] = 'linear_deit_tiny'
    with pytest.raises(KeyboardInterrupt):
        attention_stats.main(argv)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == previous


def test_a_folder_named_like_an_output_file_is_one_line_and_keeps_the_previous_files(images, tmp_path, capsys):
    """A folder `stats.png` in the way of the figure: a traceback after the new table and Markdown had taken their
    names beside no figure. Now one line naming it before any measuring, status 2, and the previous CSV and
    Markdown kept; a writer that meets such a folder all the same says so in one line too."""
    out = tmp_path / 'stats'
    argv = ['--models', 'softmax_deit_tiny', '--data', str(images), '--batch-size', '2', '--out', str(out),
            '--opts'] + TINY
    assert run_cli(attention_stats.main, argv) == 0
    (tmp_path / 'stats.png').unlink()
    (tmp_path / 'stats.png').mkdir()
    previous = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    capsys.readouterr()
    argv[1] = 'linear_deit_tiny'
    with pytest.raises(SystemExit) as stopped:
        attention_stats.main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --out {out}: {str(out) + '.png'!r} is a folder; expected a prefix whose files (.csv, .md, .png) are "
        f"not folders")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ['stats.csv', 'stats.md', 'stats.png']
    assert run_cli(lambda argv: engine.checkpoint.atomic_write_text(str(out) + '.png', 'figure'), []) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: cannot write {str(out) + '.png'!r} (Is a directory); "
                                                        f"expected a file name that no folder has")


def test_attention_stats_refuses_an_attention_without_weights_before_measuring(images, tmp_path, monkeypatch,
                                                                                capsys):
    """A user's attention registered without a weight function stopped attention_stats.py with a traceback, after
    the models before it were measured."""
    monkeypatch.delitem(matrices._MATRICES, LinearMixer)
    argv = ['--models', 'softmax_deit_tiny', 'linear_deit_tiny', '--data', str(images), '--out',
            str(tmp_path / 'stats'), '--opts'] + TINY
    assert run_cli(attention_stats.main, argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: linear_deit_tiny: no attention matrix is defined for LinearMixer; register one with "
        "models.analysis.attention_matrix")
    assert not list(tmp_path.iterdir())


def test_the_analysis_scripts_take_a_model_saved_for_the_hub_with_its_weights(images, tmp_path):
    """`--model(s) local-dir:FOLDER`: the saved architecture (another attention than its name's) with the saved
    weights, not random ones; SimA's scores are signed where softmax's never are."""
    torch.manual_seed(0)
    saved = timm.create_model('softmax_deit_tiny', attn_type='sima', img_size=16, patch_size=4, embed_dim=16, depth=2,
                              num_heads=2, num_classes=10)
    timm.models.save_for_hf(saved, str(tmp_path / 'saved'))
    name = f'local-dir:{tmp_path / "saved"}'
    model, cfg = load_analysis_model(name, None)
    assert (cfg.MODEL.NAME, cfg.MODEL.KWARGS.attn_type, cfg.DATA.IMG_SIZE) == ('softmax_deit_tiny', 'sima', 16)
    assert model.state_dict().keys() == saved.state_dict().keys()
    assert all(torch.equal(value, saved.state_dict()[key]) for key, value in model.state_dict().items())
    out = tmp_path / 'stats'
    assert run_cli(attention_stats.main, ['--models', name, '--data', str(images), '--batch-size', '2',
                                          '--out', str(out)]) == 0
    with open(f'{out}.csv') as f:
        rows = list(csv.DictReader(f))
    assert {row['model'] for row in rows} == {name} and len(rows) == 2 * 2
    assert max(float(row['negative']) for row in rows) > 0


def test_the_analysis_scripts_name_their_own_option_for_a_hub_folder_without_weights(images, tmp_path, capsys):
    saved = timm.create_model('softmax_deit_tiny', img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2)
    timm.models.save_for_hf(saved, str(tmp_path / 'saved'))
    os.remove(tmp_path / 'saved' / 'pytorch_model.bin')
    name = f'local-dir:{tmp_path / "saved"}'
    for script, option in ((attention_stats, '--models'), (visualize, '--model')):
        other = ['--data', str(images)] if script is attention_stats else ['--image', str(images)]
        assert run_cli(script.main, [option, name, *other, '--out', str(tmp_path / 'out')]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {option} {name!r}: the folder holds no weights; expected ") and \
            err.count('\n') == 1, err
    assert not [path for path in tmp_path.rglob('out*') if path.is_file()]  # no figure, table or plot written


SWIN_TINY = dict(img_size=32, embed_dim=16, depths=[2, 1, 1, 1], num_heads=[1, 2, 2, 2], window_size=4,
                 num_classes=10)


def test_an_official_release_file_is_drawn_with_its_weights(images, tmp_path):
    """`--model NAME --checkpoint RELEASE`: a release in the official layout, with the derived buffers official Swin
    files hold, loads through the family's filter (as eval.py loads it), not as a bare state dict."""
    torch.manual_seed(0)
    weights = timm.create_model('inline_swin_tiny', **SWIN_TINY).state_dict()
    release = dict(weights)
    release['layers.0.blocks.0.attn.relative_position_index'] = torch.zeros(16, 16, dtype=torch.long)
    release['layers.0.blocks.1.attn_mask'] = torch.zeros(4, 16, 16)
    torch.save({'model': release, 'epoch': 300}, tmp_path / 'inline_swin_t.pth')
    opts = ['DATA.IMG_SIZE', '32', 'MODEL.KWARGS.embed_dim', '16', 'MODEL.KWARGS.depths', '[2,1,1,1]',
            'MODEL.KWARGS.num_heads', '[1,2,2,2]', 'MODEL.KWARGS.window_size', '4']
    model, cfg = load_analysis_model('inline_swin_tiny', str(tmp_path / 'inline_swin_t.pth'), opts)
    assert cfg.MODEL.NUM_CLASSES == 10  # taken from the weights, as eval.py --model takes it
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    argv = ['--model', 'inline_swin_tiny', '--checkpoint', str(tmp_path / 'inline_swin_t.pth'), '--image',
            str(images), '--max-images', '1', '--out', str(tmp_path / 'figures'), '--opts', *opts]
    assert run_cli(visualize.main, argv) == 0
    assert len(os.listdir(tmp_path / 'figures')) == 2 + 1  # the figures and their manifest


def test_a_release_file_is_measured_with_its_model_s_name_as_each_script_takes_it(images, tmp_path, capsys):
    """A file without our config (an official release) alone: each script names its own way to give the model
    (attention_stats.py said `--cfg FILE or --model NAME`, options it does not have); `--models NAME=FILE` measures
    the file's weights."""
    torch.manual_seed(0)
    source = timm.create_model('inline_swin_tiny', **SWIN_TINY)
    release = tmp_path / 'inline_swin_t.pth'
    torch.save({'model': source.state_dict(), 'epoch': 300}, release)
    opts = ['--opts', 'DATA.IMG_SIZE', '32', 'MODEL.KWARGS.embed_dim', '16', 'MODEL.KWARGS.depths', '[2,1,1,1]',
            'MODEL.KWARGS.num_heads', '[1,2,2,2]', 'MODEL.KWARGS.window_size', '4']
    out = str(tmp_path / 'stats')
    assert run_cli(attention_stats.main, ['--checkpoints', str(release), '--data', str(images), '--out', out]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint {str(release)!r} stores no config of this engine; expected "
                                       f"it with the model whose weights it holds: --models NAME={release}\n")
    assert run_cli(visualize.main, ['--checkpoint', str(release), '--image', str(images), '--out',
                                    str(tmp_path / 'figures')]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint {str(release)!r} stores no config of this engine; expected "
                                       f"--model NAME with it, the model whose weights it holds\n")
    measured = {}

    def measure(model, inputs, batch_size, label):
        measured[label] = {k: v.clone() for k, v in model.state_dict().items()}
        return real_measure(model, inputs, batch_size, label)

    real_measure = attention_stats.measure
    argv = ['--models', f'inline_swin_tiny={release}', 'softmax_swin_tiny', '--data', str(images), '--out', out,
            *opts[:-2]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_stats, 'measure', measure)
        assert run_cli(attention_stats.main, argv) == 0
    assert set(measured) == {'inline_swin_tiny', 'softmax_swin_tiny'}
    assert all(torch.equal(value, source.state_dict()[key]) for key, value in measured['inline_swin_tiny'].items())


@pytest.mark.parametrize('script, argv, message', [
    ('visualize', ['--model', 'softmax_deit_tiny', '--checkpoint', 'best.pth', '--pretrained'],
     'error: --pretrained loads the released weights of --model NAME; expected --model without --checkpoint'),
    ('visualize', ['--model', 'linear_deit_tiny', '--pretrained'],
     "error: --pretrained: model 'linear_deit_tiny' has no released weights; expected a name that "
     "timm.list_pretrained() lists"),
    ('attention_stats', ['--checkpoints', 'best.pth', '--pretrained'],
     'error: --pretrained loads the released weights of --models NAME ...; expected --models'),
    # --ema without a checkpoint drew or measured random weights without a word
    ('visualize', ['--model', 'softmax_deit_tiny', '--ema'],
     'error: --ema reads the EMA weights of a checkpoint; expected --checkpoint PATH'),
    ('attention_stats', ['--models', 'softmax_deit_tiny', '--ema'],
     'error: --ema reads the EMA weights of checkpoints; expected --checkpoints PATH ... or --models NAME=FILE'),
    ('attention_stats', ['--models', 'softmax_deit_tiny=best.pth', '--pretrained'],
     "error: --pretrained loads the released weights of --models NAME, but softmax_deit_tiny=best.pth gives a file's; "
     "expected one or the other"),
    ('attention_stats', ['--models', 'inline_deit_tiny', 'sima_deit_tiny', '--pretrained'],
     "error: --pretrained: model 'sima_deit_tiny' has no released weights; expected a name that "
     "timm.list_pretrained() lists"),
])
def test_pretrained_without_released_weights_is_refused_before_any_work(images, tmp_path, capsys, script, argv,
                                                                        message):
    main = visualize.main if script == 'visualize' else attention_stats.main
    data = ['--image', str(images)] if script == 'visualize' else ['--data', str(images)]
    with pytest.raises(SystemExit) as stopped:
        main([*argv, *data, '--out', str(tmp_path / 'out')])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)
    assert not list(tmp_path.iterdir())


# Runs `python SCRIPT ARGS` for each case of argv[1] (JSON: [module, SCRIPT, *ARGS] each) with `module` hidden, as a
# Python without it runs the script, and prints each case's exit status and error output (JSON). torch and timm, most
# of a start's seconds and neither an analysis dependency, load once: each case's process forks from this one after
# them, imports the rest as the script does, and ends with the status and output the interpreter would give it, but
# at once, without the seconds the interpreter takes to tear torch down (nor the exit handlers that would remove a
# folder the script made: one left is seen).
HIDDEN_IMPORTS = """
import json, os, runpy, sys, traceback
import timm, torch
done = []
for missing, *argv in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(write, 2)
        sys.modules[missing], sys.argv = None, argv
        try:
            runpy.run_path(argv[0], run_name='__main__')
            status = 0
        except SystemExit as stop:
            status = stop.code  # the scripts exit with a number
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stderr.flush()
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as err:
        said = err.read()
    done.append([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), said])
print(json.dumps(done))
"""
MISSING_DEPENDENCY = [
    ('visualize_attention.py', ['--model', 'softmax_deit_tiny'], 'matplotlib'),
    ('visualize_attention.py', ['--model', 'softmax_deit_tiny', '--gradcam'], 'pytorch_grad_cam'),
    ('attention_stats.py', ['--models', 'softmax_deit_tiny'], 'entmax'),
]


@pytest.fixture(scope='module')
def runs_without_a_dependency(images, tmp_path_factory) -> Dict[str, Tuple[int, str, Path]]:
    """The exit status, error output and folder of `--out` of each case of MISSING_DEPENDENCY, by module, run in
    one process (see HIDDEN_IMPORTS)."""
    scripts = Path(__file__).resolve().parents[1] / 'scripts'
    cases, folders = [], {}
    for script, argv, missing in MISSING_DEPENDENCY:
        folders[missing] = tmp_path_factory.mktemp(missing)
        data = ['--image', str(images)] if script == 'visualize_attention.py' else ['--data', str(images)]
        cases.append([missing, str(scripts / script), *argv, *data, '--out', str(folders[missing] / 'out')])
    done = subprocess.run([sys.executable, '-c', HIDDEN_IMPORTS, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {missing: (*result, folders[missing]) for (missing, *_), result in zip(cases, results)}


@pytest.mark.parametrize('missing', [missing for *_, missing in MISSING_DEPENDENCY])
def test_a_missing_analysis_dependency_is_one_line_before_any_work(runs_without_a_dependency, missing):
    """Without the `analysis` extra, the scripts name the missing module and the extra that installs it."""
    status, err, folder = runs_without_a_dependency[missing]
    assert (status, err) == (2, f"error: {missing} is not installed; expected the 'analysis' extra: pip install "
                                f"'swappable-attention-zoo[analysis]' (pip install -e '.[analysis]' in a clone)\n")
    assert not list(folder.iterdir())


def test_a_model_without_attention_layers_of_the_zoo_is_refused_before_its_weights_are_fetched(images, tmp_path, capsys,
                                                                                                 monkeypatch):
    monkeypatch.setattr(engine.analysis, 'weights_file', lambda *args: pytest.fail('downloaded'))
    argv = ['--model', 'test_resnet', '--pretrained', '--image', str(images), '--out', str(tmp_path / 'out')]
    assert run_cli(visualize.main, argv) == 2
    assert capsys.readouterr().err == ("error: model 'test_resnet' has no attention layer of this zoo; expected one of "
                                       "the zoo's models (timm.list_models('*_deit_*') and friends)\n")


@pytest.mark.parametrize('models, message', [
    # --models takes no labels (LABEL=PATH is a --checkpoints form)
    (['softmax_deit_tiny', 'softmax_deit_tiny'], "error: model 'softmax_deit_tiny' is measured twice; expected each "
                                                 "model of --models once"),
    (['softmax_deit_tiny', 'softmax_deit_tny'], "error: unknown model 'softmax_deit_tny': expected a model "),
])
def test_attention_stats_checks_every_model_before_measuring_the_first(models, message, images, tmp_path,
                                                                       monkeypatch, capsys):
    """Two models with one label, or a second model that cannot be built, are refused before any image is measured,
    not after the first model's whole run."""
    measured = []
    monkeypatch.setattr(attention_stats, 'measure', lambda *args: measured.append(args[-1]) or [])
    argv = ['--models', *models, '--data', str(images), '--out', str(tmp_path / 'stats'), '--opts'] + TINY
    assert run_cli(attention_stats.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count('\n') == 1, err
    assert measured == [] and not list(tmp_path.iterdir())


def test_attention_stats_takes_checkpoint_paths_that_hold_an_equals_sign(tmp_path):
    """A sweep folder such as `lr=1e-3`: the path was split at its last '=' into a label and '1e-3/best.pth'."""
    path = tmp_path / 'lr=1e-3' / 'best.pth'
    path.parent.mkdir()
    path.write_bytes(b'')
    assert attention_stats.labelled_checkpoint(str(path)) == ('', str(path))
    assert attention_stats.labelled_checkpoint(f'mine={path}') == ('mine', str(path))
    assert attention_stats.labelled_checkpoint('runs/best.pth') == ('', 'runs/best.pth')
    assert attention_stats.labelled_checkpoint('a=') == ('', 'a=')  # named as the checkpoint not found


@pytest.mark.parametrize('script', ['attention_stats', 'benchmark'])
def test_an_out_prefix_that_is_a_folder_is_refused(script, images, tmp_path, capsys):
    """`--out DIR/` wrote the hidden files DIR/.csv, DIR/.md and DIR/.png."""
    argv = {'attention_stats': ['--models', 'softmax_deit_tiny', '--data', str(images)],
            'benchmark': ['--families', 'deit']}[script]
    with pytest.raises(SystemExit) as stopped:
        load_script(script).main([*argv, '--out', f'{tmp_path}{os.sep}'])
    assert stopped.value.code == 2
    example = {'attention_stats': 'stats', 'benchmark': 'benchmark'}[script]  # the benchmark was told 'stats'
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --out {tmp_path}{os.sep}: is a folder; expected a path prefix of the files, such as "
        f"{tmp_path / example}")
    assert not list(tmp_path.iterdir())


def test_a_script_s_out_folder_loses_the_temporary_files_of_runs_killed_while_writing(tmp_path):
    """SIGTERM while a script wrote its table left `.stats.csv.<pid>.<hex>.tmp`, which no later run removed; the
    temporary file of a process that still runs stays."""
    finished = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    killed = tmp_path / f'.stats.csv.{finished.stdout.strip()}.0123abcd.tmp'
    running = tmp_path / f'.stats.md.{os.getpid()}.4567cdef.tmp'
    for path in (killed, running):
        path.write_text('half a table')
    engine.checkpoint.prepare_script_out(argparse.ArgumentParser(), str(tmp_path / 'stats'), prefix=True)
    assert [p.name for p in tmp_path.iterdir()] == [running.name]


def test_layer_curves_keep_one_colour_per_model_and_a_legend_of_every_model(monkeypatch, tmp_path):
    """A statistic that does not apply to one attention (additive's distance has none) leaves its line out of that
    panel; the other lines keep their colours, and the legend names every model in its colour."""
    rows = [dict(model=model, depth=depth, entropy=1.0 + i + depth,
                 distance_px=np.nan if model == 'additive' else 10.0 + i)
            for i, model in enumerate(('softmax', 'additive', 'linear')) for depth in (0, 1)]
    saved = []
    monkeypatch.setattr(plots, '_save', lambda fig, path: saved.append(fig))
    plots.plot_layer_curves(rows, ('entropy', 'distance_px'), str(tmp_path / 'curves.png'))
    fig, = saved
    entropy, distance = fig.axes
    colour_of = {text.get_text(): handle.get_color() for handle, text in zip(fig.legends[0].legend_handles,
                                                                             fig.legends[0].get_texts())}
    assert list(colour_of) == ['softmax', 'additive', 'linear'] and len(set(colour_of.values())) == 3
    first_value = {line.get_ydata()[0]: line.get_color() for ax in (entropy, distance) for line in ax.get_lines()}
    assert first_value == {1.0: colour_of['softmax'], 2.0: colour_of['additive'], 3.0: colour_of['linear'],
                           10.0: colour_of['softmax'], 12.0: colour_of['linear']}
    assert len(distance.get_lines()) == 2
    plt.close(fig)


def test_a_folder_gives_images_of_every_class_and_every_format_the_training_data_takes(tmp_path):
    """`--max-images` spreads over the sorted files (the first N of an ImageFolder split were its first class), and
    the analysis scripts read every image format train.py and eval.py read (.ppm and .pgm were skipped)."""
    for label, ext in zip('abc', ('.png', '.ppm', '.pgm')):
        (tmp_path / label).mkdir()
        for i in range(3):
            Image.new('L' if ext == '.pgm' else 'RGB', (8, 8)).save(tmp_path / label / f'{i}{ext}')
    found = engine.analysis.find_images(str(tmp_path), 3)
    assert [Path(f).relative_to(tmp_path).as_posix() for f in found] == ['a/0.png', 'b/0.ppm', 'c/0.pgm']
    assert len(engine.analysis.find_images(str(tmp_path))) == len(engine.analysis.find_images(str(tmp_path), 20)) == 9


def test_a_folder_of_linked_class_folders_is_read_as_the_training_data_reads_it(tmp_path):
    """Class folders that are links (a split assembled from elsewhere) were skipped: no images, or some classes
    silently missing. A link loop is entered once, and each folder read once."""
    for label in 'ab':
        (tmp_path / 'store' / label).mkdir(parents=True)
        Image.new('RGB', (8, 8)).save(tmp_path / 'store' / label / '0.png')
    (tmp_path / 'linked').mkdir()
    (tmp_path / 'linked' / 'a').symlink_to(tmp_path / 'store' / 'a', target_is_directory=True)
    (tmp_path / 'linked' / 'b').symlink_to(tmp_path / 'store' / 'b', target_is_directory=True)
    (tmp_path / 'store' / 'a' / 'loop').symlink_to(tmp_path / 'store', target_is_directory=True)
    found = engine.analysis.find_images(str(tmp_path / 'linked'))
    assert sorted(os.path.realpath(f) for f in found) == [str(tmp_path / 'store' / label / '0.png') for label in 'ab']


@pytest.mark.parametrize('script', ['attention_stats', 'visualize_attention'])
def test_an_accelerator_asked_of_the_analysis_scripts_is_refused_not_ignored(images, tmp_path, capsys, script):
    """`--opts DEVICE cuda` was accepted and the scripts ran on the CPU without a word."""
    if script == 'attention_stats':
        main, argv = attention_stats.main, ['--models', 'softmax_deit_tiny', '--data', str(images)]
    else:
        main, argv = visualize.main, ['--model', 'softmax_deit_tiny', '--image', str(images)]
    out = tmp_path / 'out'
    assert run_cli(main, argv + ['--out', str(out / 'stats'), '--opts', 'DEVICE', 'cuda'] + TINY) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("error: DEVICE 'cuda': the analysis scripts run on the CPU; "
                                                        "expected DEVICE cpu (or auto)")


def test_a_key_map_is_drawn_over_the_part_of_the_image_its_keys_cover(monkeypatch, tmp_path):
    """PVT v2 at 80: stage 0's 20×20 grid under stride 8 has 2×2 keys over its first 16×16 cells, 64 of 80 pixels;
    the map was stretched over all 80, the last 16 drawn as part of the last key cell."""
    model = timm.create_model('softmax_pvt_v2_b0', img_size=80, num_classes=0).eval()
    drawn = []
    overlay = plots._overlay
    monkeypatch.setattr(plots, '_overlay', lambda *args, **kwargs: drawn.append(overlay(*args, **kwargs)) or drawn[-1])
    with record_attention(model, layers=[0], queries=[0]) as rec, torch.no_grad():
        model(torch.randn(1, 3, 80, 80))
    plots.plot_query_maps(np.zeros((80, 80)), rec[0], 0, str(tmp_path / 'map.png'))
    assert rec[0].key_grid == (2, 2)
    assert [image.get_extent() for image in drawn] == [[0.0, 64.0, 64.0, 0.0]]


def test_a_padded_grid_s_map_and_query_are_drawn_on_the_cells_of_their_stride(monkeypatch, tmp_path):
    """Swin at 40, stage 2: the 3×3 grid padded from 5×5 before the merging has 16-pixel cells over 48 pixels. The
    map is drawn over those 48, cut at the image's 40, and pixel 30's query marked at the centre of its cell (1, 1),
    (24, 24); the map was stretched over the 40 pixels, and the marker put at 33 in cell (2, 2)."""
    model = timm.create_model('softmax_swin_tiny', img_size=40, embed_dim=16, depths=[2, 1, 1, 1],
                              num_heads=[1, 2, 2, 2], window_size=4, num_classes=5).eval()
    figures = []
    monkeypatch.setattr(plots, '_save', lambda fig, path: figures.append(fig))
    with torch.no_grad(), record_attention(model, ['layers.2.blocks.0.attn'],
                                           visualize.parse_queries(['30,30'], 40, False)) as rec:
        model(torch.randn(1, 3, 40, 40))
    assert rec[0].queries.tolist() == [4]
    plots.plot_query_maps(np.zeros((40, 40)), rec[0], 0, str(tmp_path / 'q.png'))
    panels = [ax for ax in figures[0].axes if ax.get_title().startswith('head')]
    assert len(panels) == 2
    for ax in panels:
        assert [image.get_extent() for image in ax.get_images()] == [[0.0, 40.0, 40.0, 0.0], [0.0, 48.0, 48.0, 0.0]]
        assert ax.get_xlim() == (0.0, 40.0) and ax.get_ylim() == (40.0, 0.0)
        marker, = ax.get_lines()
        assert marker.get_xydata().tolist() == [[24.0, 24.0]]
    plt.close(figures[0])
