"""Swin family: official golden, parameter counts and key names, a cross-check against timm's Swin, the window
rules, checkpoint loading (official format, unsafe pickles, other models, other resolutions) and the timm API."""
import functools
import json
import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import timm
from PIL import Image
from yacs.config import CfgNode
from timm.models import get_arch_pretrained_cfgs
from timm.models.swin_transformer import SwinTransformer as TimmSwin

from engine.build import create_model, read_weights
from engine.cli import eval_main, train_main
from engine.config import load_config
from engine.errors import USAGE_EXIT_CODE, run_cli
from models.attention import list_attentions
from models.checkpoint import (IMAGENET22K_CLASSES, CheckpointError, imagenet1k_classes,
                               imagenet1k_rows_of_imagenet22k, load_pretrained_into)
from models.swin import SwinTransformer, checkpoint_filter_fn
from golden import load_golden

REPO = Path(__file__).resolve().parents[1]

FLAVOURS = tuple(list_attentions())
SIZES = ('tiny', 'small', 'base', 'base_384', 'large', 'large_384')
ALL_NAMES = [f'{f}_swin_{s}' for f in FLAVOURS for s in SIZES]

# A small model: grids 8, 4, 2, 1; score-forming blocks get 4x4 windows in stage 0, shifted in its 2nd block.
TINY = dict(img_size=32, embed_dim=16, depths=[2, 1, 2, 1], num_heads=[1, 2, 2, 4], num_classes=10)
TINY_WINDOW = dict(window_size=4)


def tiny_kwargs(name):
    """Tiny overrides; inline/flatten keep their official window_size meaning (softmax window derived)."""
    return dict(TINY) if name.startswith(('inline_', 'flatten_')) else dict(TINY, **TINY_WINDOW)


@functools.lru_cache(maxsize=None)
def _meta_model(name, **kwargs):
    with torch.device('meta'):
        return timm.create_model(name, **kwargs)


def meta_model(name, **kwargs):
    """A model built on the meta device (no memory, fast), cached: read it, never change it."""
    return _meta_model(name, **{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def randomize(model, seed=0):
    """Weights like the goldens': LayerNorm weights 1 + 0.1·N(0,1), everything else 0.1·N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
            is_norm = name.endswith('weight') and p.ndim == 1 and 'norm' in name
            p.copy_(1 + noise if is_norm else noise)
    return model


# ----------------------------------------------------------------------------------------------- golden


@pytest.fixture(scope='module')
def golden():
    return load_golden('flatten_swin_like_LLSS')


def golden_kwargs(golden):
    assert golden['spec']['ln_eps'] == 1e-5
    return {k: golden['spec'][k] for k in ('img_size', 'patch_size', 'embed_dim', 'depths', 'num_heads', 'window_size',
                                           'attn_type', 'focusing_factor', 'kernel_size', 'mlp_ratio', 'qkv_bias',
                                           'num_classes')}


def golden_model(golden):
    model = timm.create_model('flatten_swin_tiny', **golden_kwargs(golden)).eval()
    model.load_state_dict(checkpoint_filter_fn(golden['state_dict'], model), strict=True)
    return model


def test_golden_flatten_swin_fp64_and_fp32(golden):
    model = golden_model(golden)
    with torch.no_grad():
        out32 = model(golden['input'])
        out64 = model.double()(golden['input'].double())
    assert (out64 - golden['output_fp64']).abs().max() < 1e-10
    assert (out32 - golden['output_fp32']).abs().max() < 1e-4


def test_an_official_state_dict_loads_as_it_is_strictly_also_through_timm_s_checkpoint_path(golden, tmp_path):
    """`model.load_state_dict(official)`, as the official code loads its files, and timm's `checkpoint_path`
    (`load_checkpoint`, no filter) take the saved relative position indices and shifted-window masks, which the
    model recomputes: the official outputs."""
    saved = golden['state_dict']
    keys = list(saved)
    assert any(k.endswith('.attn_mask') for k in keys) and any(k.endswith('.relative_position_index') for k in keys)
    model = timm.create_model('flatten_swin_tiny', **golden_kwargs(golden)).eval()
    model.load_state_dict(saved, strict=True)
    torch.save({'model': saved}, tmp_path / 'official.pth')
    through_timm = timm.create_model('flatten_swin_tiny', checkpoint_path=str(tmp_path / 'official.pth'),
                                     **golden_kwargs(golden)).eval()
    for loaded in (model, through_timm):
        with torch.no_grad():
            assert (loaded.double()(golden['input'].double()) - golden['output_fp64']).abs().max() < 1e-10
    assert list(saved) == keys  # the caller's dict is left whole


def test_golden_window_rule_of_the_official_window_size(golden):
    """window_size=56 (official meaning) at 224: L stages global, S stages 7x7 windows, shift 3 on odd blocks of
    stage 2, and stage 3 (7x7 grid) global without shift but with a 7x7 bias table."""
    model = meta_model('flatten_swin_tiny', **{k: v for k, v in golden['spec'].items()
                                               if k in ('embed_dim', 'depths', 'num_heads', 'window_size')})
    attns = [[b.attn for b in stage.blocks] for stage in model.layers]
    assert all(a.attention_name == 'flatten' and a.window is None for s in attns[:2] for a in s)
    assert [a.mixer.positional_encoding.shape[1] for a in attns[0] + attns[1]] == [3136, 3136, 784, 784]
    assert [(a.window, a.shift_size) for a in attns[2]] == [((7, 7), 0), ((7, 7), 3)]
    assert [(a.window, a.shift_size, a.bias_window) for a in attns[3]] == [(None, 0, (7, 7))] * 2
    assert attns[2][1].attn_mask.shape == (4, 49, 49)


@pytest.mark.parametrize('name, window_size, img_size, softmax_window, linear_window', [
    ('flatten_swin_tiny', 56, 224, 7, None),      # linear 56 covers the 56x56 grid
    ('flatten_swin_tiny', 96, 384, 12, None),
    ('flatten_swin_tiny', 28, 224, 7, 28),
    ('inline_swin_tiny', 56, 224, 7, None),
    ('inline_swin_tiny', 112, 448, 14, None),     # InLine: max(7, ws // 8)
    ('inline_swin_tiny', 28, 224, 7, 28),
])
def test_official_window_size_meaning(name, window_size, img_size, softmax_window, linear_window):
    model = meta_model(name, img_size=img_size, window_size=window_size, embed_dim=8, depths=(2, 2, 2, 2),
                       num_heads=(1, 1, 1, 1), attn_type='IISS' if name.startswith('inline') else 'LLSS')
    first, second = model.layers[0].blocks
    expected = None if linear_window is None else (linear_window, linear_window)
    assert first.attn.window == expected and second.attn.window == expected
    assert second.attn.shift_size == (0 if linear_window is None else linear_window // 2)
    softmax = model.layers[2].blocks[1].attn
    assert softmax.window == (softmax_window, softmax_window) and softmax.shift_size == softmax_window // 2


def test_softmax_flavour_window_size_is_the_softmax_window():
    model = meta_model('softmax_swin_tiny', window_size=4, **TINY)
    assert [(b.attn.window, b.attn.shift_size) for b in model.layers[0].blocks] == [((4, 4), 0), ((4, 4), 2)]
    assert [(b.attn.window, b.attn.shift_size, b.attn.bias_window) for b in model.layers[1].blocks] == [
        (None, 0, (4, 4))]


def test_linear_attentions_of_other_flavours_are_global():
    model = meta_model('sima_swin_tiny', window_size=4, **TINY)
    assert all(b.attn.window is None and b.attn.shift_size == 0 for s in model.layers for b in s.blocks)
    assert not any(hasattr(b.attn, 'relative_position_bias_table') for s in model.layers for b in s.blocks)


# ------------------------------------------------------------------------------------- counts and keys

OFFICIAL_PARAMS = {
    'inline_swin_tiny': 29_223_544, 'inline_swin_small': 49_793_296, 'inline_swin_base': 88_350_120,
    'inline_swin_base_384': 88_465_320, 'flatten_swin_tiny': 29_192_384, 'flatten_swin_small': 50_510_288,
    'flatten_swin_base': 88_972_488, 'flatten_swin_base_384': 91_433_928,
}
TIMM_ORIGINALS = {
    'softmax_swin_tiny': 'swin_tiny_patch4_window7_224', 'softmax_swin_small': 'swin_small_patch4_window7_224',
    'softmax_swin_base': 'swin_base_patch4_window7_224', 'softmax_swin_base_384': 'swin_base_patch4_window12_384',
    'softmax_swin_large': 'swin_large_patch4_window7_224', 'softmax_swin_large_384': 'swin_large_patch4_window12_384',
}


@pytest.mark.parametrize('name', list(OFFICIAL_PARAMS))
def test_official_parameter_count(name):
    assert num_params(meta_model(name)) == OFFICIAL_PARAMS[name]


@pytest.mark.parametrize('name', list(TIMM_ORIGINALS))
def test_softmax_parameter_count_equals_timm_swin(name):
    assert num_params(meta_model(name)) == num_params(meta_model(TIMM_ORIGINALS[name]))


@pytest.mark.parametrize('name', list(TIMM_ORIGINALS))
def test_timm_swin_state_dict_becomes_ours_at_full_size(name):
    """timm's full-size Swin state dict (its layout), through the filter, has exactly our keys and shapes."""
    ours = meta_model(name)
    filtered = checkpoint_filter_fn(meta_model(TIMM_ORIGINALS[name]).state_dict(), ours)
    assert {k: v.shape for k, v in filtered.items()} == {k: v.shape for k, v in ours.state_dict().items()}


@pytest.mark.parametrize('name, official_keys, derived', [
    ('softmax_swin_tiny', 190, 12 + 5),   # 12 relative_position_index, 5 attn_mask (odd blocks of stages 0-2)
    ('flatten_swin_tiny', 196, 8 + 3),    # S blocks: stage 2 (6, 3 shifted) and stage 3 (2)
    ('inline_swin_base', 373, 18 + 8),    # IIMS2: stage 2 blocks 2-17 (8 shifted) and stage 3 (2)
])
def test_state_dict_has_the_official_keys_less_derived_buffers(name, official_keys, derived):
    assert len(meta_model(name).state_dict()) == official_keys - derived


@pytest.mark.parametrize('name, shapes', [
    ('flatten_swin_tiny', {
        'patch_embed.proj.weight': (96, 3, 4, 4), 'layers.0.blocks.0.attn.scale': (1, 1, 96),
        'layers.0.blocks.1.attn.positional_encoding': (1, 3136, 96),
        'layers.1.blocks.0.attn.positional_encoding': (1, 784, 192),
        'layers.0.blocks.0.attn.dwc.weight': (32, 1, 5, 5), 'layers.2.blocks.1.attn.relative_position_bias_table':
            (169, 12), 'layers.2.downsample.reduction.weight': (768, 1536), 'norm.weight': (768,),
        'head.weight': (1000, 768)}),
    ('inline_swin_base', {
        'patch_embed.proj.weight': (128, 3, 4, 4), 'layers.0.blocks.0.attn.residual.0.weight': (128, 32, 1),
        'layers.0.blocks.0.attn.residual.2.weight': (1152, 32, 1),
        'layers.2.blocks.1.attn.residual.2.bias': (4608,),
        'layers.2.blocks.2.attn.relative_position_bias_table': (169, 16),
        'layers.0.downsample.reduction.weight': (256, 512), 'layers.0.downsample.norm.weight': (512,)}),
    ('flatten_swin_base_384', {
        'layers.0.blocks.0.attn.positional_encoding': (1, 9216, 128),
        'layers.1.blocks.0.attn.positional_encoding': (1, 2304, 256),
        'layers.2.blocks.0.attn.relative_position_bias_table': (529, 16)}),
])
def test_official_key_shapes(name, shapes):
    state = meta_model(name).state_dict()
    assert {k: tuple(state[k].shape) for k in shapes} == shapes
    assert not any(k.startswith('layers.3.downsample') or 'head.fc' in k for k in state)


def test_no_linear_window_mask_or_table():
    """Linear blocks get no bias table or mask, even when windowed and shifted (the official ignores them)."""
    model = meta_model('inline_swin_tiny', window_size=28)
    attn = model.layers[0].blocks[1].attn
    assert attn.shift_size == 14 and attn.attn_mask is None and attn.bias_window is None


# ------------------------------------------------------------------------------------ timm cross-check


def test_softmax_swin_loads_timm_swin_weights_and_gives_timm_outputs(tmp_path):
    """timm's Swin weights (its layout: downsample at the start of stage i+1, head.fc) with random values, kept as
    the hub keeps them (safetensors) and loaded as a timm user loads a file: shifted windows, masks, bias tables
    and patch merging must agree in float64."""
    kwargs = dict(img_size=128, embed_dim=16, depths=(2, 2, 4, 2), num_heads=(1, 2, 4, 8), window_size=4)
    reference = randomize(TimmSwin(num_classes=10, **kwargs)).double().eval()
    hub_file = tmp_path / 'model.safetensors'
    safetensors.torch.save_file(reference.state_dict(), str(hub_file))
    model = timm.create_model('softmax_swin_tiny', num_classes=10, pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(hub_file), num_classes=10), **kwargs)
    model = model.double().eval()
    x = torch.randn(2, 3, 128, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
        assert (model(x) - expected).abs().max() < 1e-10
        model.float()
        assert (model(x.float()) - expected).abs().max() < 1e-5
    # the renaming is the filter's, so a checkpoint without classifier (timm's num_classes=0) loads too
    headless = {k: v for k, v in reference.state_dict().items() if not k.startswith('head.')}
    model = timm.create_model('softmax_swin_tiny', num_classes=0, **kwargs).double().eval()
    model.load_state_dict(checkpoint_filter_fn(headless, model), strict=True)
    with torch.no_grad():
        assert (model(x) - reference.forward_head(reference.forward_features(x), pre_logits=True)).abs().max() < 1e-10


def test_window_clamps_side_by_side_on_a_grid_its_short_side_fits():
    """On a 7x5 grid (Swin-T's last stage at 224x160) a 7x7 window is one 7x5 window over the whole grid, with a
    13x9 bias table, as in timm: not 5x5 windows over a padded 10x5 grid."""
    kwargs = dict(img_size=(28, 20), embed_dim=16, depths=(2,), num_heads=(2,), window_size=7)
    reference = randomize(TimmSwin(num_classes=10, **kwargs)).double().eval()
    model = timm.create_model('softmax_swin_tiny', num_classes=10, **kwargs).double().eval()
    model.load_state_dict(checkpoint_filter_fn(reference.state_dict(), model), strict=True)
    for block in model.layers[0].blocks:
        assert block.attn.window is None and block.attn.shift_size == 0
        assert block.attn.relative_position_bias_table.shape == (13 * 9, 2)
    x = torch.randn(2, 3, 28, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(x) - reference(x)).abs().max() < 1e-10
    # Swin-T at 224x160: the last stage is global, its tables 13x9 (a 224x224 checkpoint's resize on load)
    trained = meta_model('softmax_swin_tiny', img_size=(224, 160))
    assert [trained.layers[3].blocks[j].attn.window for j in (0, 1)] == [None, None]
    assert trained.layers[3].blocks[1].attn.relative_position_bias_table.shape == (13 * 9, 24)


# --------------------------------------------------------------------------------- every entrypoint


def test_list_models():
    for flavour in FLAVOURS:
        assert timm.list_models(f'{flavour}_swin_*') == sorted(f'{flavour}_swin_{s}' for s in SIZES)
    # released weights carry timm's tags: Swin's own as timm tags them, the papers' 'in1k'
    assert timm.list_models('*_swin_*', pretrained=True) == sorted(
        ['inline_swin_tiny.in1k', 'inline_swin_small.in1k', 'inline_swin_base.in1k', 'flatten_swin_tiny.in1k',
         'flatten_swin_small.in1k', 'flatten_swin_base.in1k', 'flatten_swin_base_384.in1k']
        + [f'softmax_swin_{size}.ms_in1k' for size in ('tiny', 'small', 'base', 'base_384')]
        + [f'softmax_swin_{size}.{tag}' for size in SIZES for tag in ('ms_in22k', 'ms_in22k_ft_in1k')])


@pytest.mark.parametrize('name', list(TIMM_ORIGINALS))
def test_swin_releases_are_timm_s_with_its_tags(name):
    """Every release of Swin's own weights is registered under timm's tag for the same file, with its class count
    and resolution; the ImageNet-1k weights stay the default where they exist, as the papers compare with them."""
    ours, theirs = ({cfg.tag: cfg for cfg in get_arch_pretrained_cfgs(arch).values()}
                    for arch in (name, TIMM_ORIGINALS[name]))
    assert set(ours) == set(theirs)
    for tag, cfg in ours.items():
        assert (cfg.url, cfg.num_classes, cfg.input_size, cfg.pool_size) == (
            theirs[tag].url, theirs[tag].num_classes, theirs[tag].input_size, theirs[tag].pool_size), tag
    assert timm.get_pretrained_cfg(name).tag == ('ms_in22k_ft_in1k' if 'large' in name else 'ms_in1k')
    with torch.device('meta'):
        assert timm.create_model(f'{name}.ms_in22k').num_classes == 21841


@pytest.mark.parametrize('name', ALL_NAMES)
def test_entrypoint_forward_backward(name):
    torch.manual_seed(0)
    model = timm.create_model(name, **tiny_kwargs(name))
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.square().mean().backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_pretrained_cfgs():
    cfg = timm.get_pretrained_cfg('flatten_swin_base_384')
    assert cfg.url == 'https://cloud.tsinghua.edu.cn/f/0d0330cf2e5249f1abb6/?dl=1'
    assert cfg.input_size == (3, 384, 384) and cfg.crop_pct == 1.0 and cfg.interpolation == 'bicubic'
    cfg = timm.get_pretrained_cfg('inline_swin_tiny')
    assert cfg.url == 'https://cloud.tsinghua.edu.cn/f/32810869fcc34410966b/?dl=1'
    assert (cfg.crop_pct, cfg.first_conv, cfg.classifier) == (0.875, 'patch_embed.proj', 'head')
    assert cfg.mean == (0.485, 0.456, 0.406) and cfg.std == (0.229, 0.224, 0.225)
    assert not timm.get_pretrained_cfg('inline_swin_base_384').has_weights
    model = meta_model('softmax_swin_base_384')
    assert model.img_size == (384, 384) and model.layers[2].blocks[1].attn.window == (12, 12)


def test_layer_norm_eps_and_drop_path_rule():
    model = timm.create_model('inline_swin_tiny', drop_path_rate=0.3, **TINY)
    assert all(m.eps == 1e-5 for m in model.modules() if isinstance(m, nn.LayerNorm))
    rates = [getattr(b.drop_path, 'drop_prob', 0.) for s in model.layers for b in s.blocks]
    assert rates == pytest.approx(torch.linspace(0, 0.3, 6).tolist())


# ----------------------------------------------------------------------------------------- checkpoints


def official_checkpoint(model, path):
    """Save `model` the way the official training scripts do: persistent index/mask buffers, a yacs config."""
    state = dict(model.state_dict())
    for name, buffer in model.named_buffers():
        if name.endswith('.attn.attn_mask'):
            state[name.replace('.attn.attn_mask', '.attn_mask')] = buffer
        elif name.endswith('relative_position_index'):
            state[name] = buffer
    config = CfgNode({'MODEL': CfgNode({'TYPE': 'swin', 'NAME': 'tiny'}), 'DATA': CfgNode({'IMG_SIZE': 32})})
    torch.save({'model': state, 'optimizer': {}, 'epoch': 3, 'max_accuracy': 1.0, 'config': config}, path)


@pytest.mark.parametrize('name', ['softmax_swin_tiny', 'inline_swin_tiny'])
def test_official_format_checkpoint_loads_through_timm(tmp_path, name):
    kwargs = tiny_kwargs(name)
    source = randomize(timm.create_model(name, **kwargs)).eval()
    path = tmp_path / 'ckpt_epoch_3.pth'
    official_checkpoint(source, path)
    saved = torch.load(path, weights_only=True)['model']
    assert any(k.endswith('relative_position_index') for k in saved)
    assert any(k.endswith('attn_mask') for k in saved) == (name == 'softmax_swin_tiny')
    model = timm.create_model(name, pretrained=True, **kwargs,
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))


def test_unsafe_checkpoint_is_refused_without_running_it(tmp_path):
    marker = tmp_path / 'ran'

    class Payload:
        def __reduce__(self):
            return os.system, (f'touch {marker}',)

    path = tmp_path / 'evil.pth'
    torch.save({'model': {'head.bias': torch.zeros(10)}, 'config': Payload()}, path)
    with pytest.raises(RuntimeError, match='weights_only'):
        timm.create_model('softmax_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          **tiny_kwargs('softmax_swin_tiny'))
    assert not marker.exists()


def test_checkpoint_of_another_model_fails_with_one_line_key_report(tmp_path):
    path = tmp_path / 'other.pth'
    official_checkpoint(timm.create_model('softmax_swin_tiny', **tiny_kwargs('softmax_swin_tiny')), path)
    with pytest.raises(CheckpointError) as info:
        timm.create_model('flatten_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          **tiny_kwargs('flatten_swin_tiny'))
    message = str(info.value)
    assert '\n' not in message
    assert 'missing: layers.0.blocks.0.attn.scale' in message
    assert 'unexpected: layers.0.blocks.0.attn.relative_position_bias_table' in message


def test_checkpoint_loads_at_another_img_size_with_interpolated_tables(tmp_path):
    """flatten_swin at 32 (grids 8, 4, 2, 1) -> 64 (16, 8, 4, 2): the global FLatten positional encodings and the
    bias tables of the grid-sized softmax windows (2 -> 4, 1 -> 2) are resized bicubically."""
    small = dict(TINY, depths=[1, 1, 1, 1])
    source = randomize(timm.create_model('flatten_swin_tiny', **small))
    path = tmp_path / 'ckpt.pth'
    official_checkpoint(source, path)
    model = timm.create_model('flatten_swin_tiny', pretrained=True, **dict(small, img_size=64),
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10))
    state, old = model.state_dict(), source.state_dict()

    pe = old['layers.0.blocks.0.attn.positional_encoding']                    # (1, 64, 16)
    expected = F.interpolate(pe.reshape(1, 8, 8, 16).permute(0, 3, 1, 2), size=(16, 16), mode='bicubic',
                             align_corners=False).permute(0, 2, 3, 1).reshape(1, 256, 16)
    assert torch.allclose(state['layers.0.blocks.0.attn.positional_encoding'], expected, atol=1e-6)

    table = old['layers.2.blocks.0.attn.relative_position_bias_table']        # (9, 2): window 2
    expected = F.interpolate(table.T.reshape(1, 2, 3, 3), size=(7, 7), mode='bicubic',
                             align_corners=False).reshape(2, 49).T
    assert torch.allclose(state['layers.2.blocks.0.attn.relative_position_bias_table'], expected, atol=1e-6)
    assert state['layers.3.blocks.0.attn.relative_position_bias_table'].shape == (9, 4)
    assert torch.equal(state['layers.0.blocks.0.attn.qkv.weight'], old['layers.0.blocks.0.attn.qkv.weight'])
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)


# --------------------------------------------------------------------------------------------- timm API


def test_features_only_and_intermediates():
    kwargs = tiny_kwargs('softmax_swin_tiny')
    features = timm.create_model('softmax_swin_tiny', features_only=True, **kwargs)
    assert features.feature_info.channels() == [16, 32, 64, 128]
    assert features.feature_info.reduction() == [4, 8, 16, 32]
    x = torch.randn(2, 3, 32, 32)
    assert [tuple(f.shape) for f in features(x)] == [(2, 16, 8, 8), (2, 32, 4, 4), (2, 64, 2, 2), (2, 128, 1, 1)]
    # every stage by default, also of a model with other than four (the default was four stages at any depth)
    three = dict(kwargs, depths=(1, 1, 2), num_heads=(1, 2, 4))
    assert len(timm.create_model('softmax_swin_tiny', features_only=True, **three)(x)) == 3
    pruned = timm.create_model('softmax_swin_tiny', features_only=True, out_indices=(1,), **kwargs)
    assert len(pruned.model.layers) == 2 and pruned.model.layers[1].downsample is None
    assert [tuple(f.shape) for f in pruned(x)] == [(2, 32, 4, 4)]

    model = randomize(timm.create_model('softmax_swin_tiny', **kwargs)).eval()
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, norm=True)
        assert torch.allclose(final, model.forward_features(x))
        assert torch.allclose(inter[-1], final.transpose(1, 2).reshape(2, 128, 1, 1))
        nlc = model.forward_intermediates(x, indices=[0], output_fmt='NLC', intermediates_only=True)
        assert torch.equal(nlc[0].transpose(1, 2).reshape(2, 16, 8, 8), inter[0])
        early, (second,) = model.forward_intermediates(x, indices=[1], stop_early=True)
        assert early.shape == (2, 4, 4, 32) and torch.equal(early.permute(0, 3, 1, 2), second)
        nhwc = model.forward_intermediates(x, norm=True, output_fmt='NHWC', intermediates_only=True)
        assert all(torch.equal(a.permute(0, 3, 1, 2), b) for a, b in zip(nhwc, inter))  # timm's Swin layout
    with pytest.raises(ValueError, match="^output_fmt 'NWC' is not supported; expected 'NCHW', 'NHWC' or 'NLC'$"):
        model.forward_intermediates(x, output_fmt='NWC')


def test_a_checkpoint_of_non_square_windows_at_another_size_is_refused_in_one_line(tmp_path):
    """Swin at (28, 20) runs its first stage in one 7x5 window (a 117-row bias table); loading it at another size
    failed inside the table resize with "shape '[1, 1, 11, 11]' is invalid for input of size 117"."""
    sizes = dict(embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=7, num_classes=5)
    source = timm.create_model('softmax_swin_tiny', img_size=(28, 20), **sizes)
    torch.save(source.state_dict(), tmp_path / 'swin.pth')
    with pytest.raises(CheckpointError, match=r"^cannot resize a relative position bias table of 117 rows: not that "
                                              r"of a square window, \(2w - 1\)² rows; expected a checkpoint of square "
                                              r"windows, or the model built at the checkpoint's size and resized by "
                                              r"set_input_size$"):
        timm.create_model('softmax_swin_tiny', img_size=28, pretrained=True, **sizes,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / 'swin.pth'), num_classes=5))
    source.set_input_size(28)  # the way it states
    assert source(torch.randn(1, 3, 28, 28)).shape == (1, 5)


def test_bad_sizes_raise_value_errors():
    model = timm.create_model('softmax_swin_tiny', **tiny_kwargs('softmax_swin_tiny'))
    with pytest.raises(ValueError, match='input image size 48x48 does not match the model.s img_size 32x32'):
        model(torch.randn(1, 3, 48, 48))
    with pytest.raises(ValueError, match='img_size 42x42 must have sides that are positive multiples of 4'):
        SwinTransformer(img_size=42, embed_dim=8, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))


def test_classifier_weight_decay_groups_and_grad_checkpointing():
    kwargs = dict(tiny_kwargs('multimax_swin_tiny'), drop_path_rate=0.)
    model = randomize(timm.create_model('multimax_swin_tiny', **kwargs))
    tables = {n for n, _ in model.named_parameters() if 'relative_position_bias_table' in n}
    assert len(tables) == 6 and model.no_weight_decay() == tables
    groups = list(timm.models.group_parameters(model, model.group_matcher()).values())
    # stem, 6 blocks (a patch merging or the final norm joins the block before it), head
    assert len(groups) == 8 and groups[-1] == ['head.weight', 'head.bias']
    assert 'layers.0.downsample.reduction.weight' in groups[2] and 'norm.weight' in groups[6]
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(grads, model.parameters()))

    model.eval()
    model.reset_classifier(3)
    assert model.get_classifier().out_features == 3 and not model.head.training
    assert model(x).shape == (2, 3)
    model.reset_classifier(0, '')
    assert model(x).shape == (2, 1, 1, 128)
    with pytest.raises(ValueError, match="global_pool 'map'"):
        model.reset_classifier(0, 'map')


# ------------------------------------------------------------------------- ImageNet-22k to ImageNet-1k

# Facts of Swin's map22kto1k.txt, the rows its fine-tuning keeps of a 21841-class classifier: the first ten, the
# row of teddy bear (class 850, a synset outside the ImageNet-21k list) and the last five.
SWIN_22K_ROWS = {**dict(enumerate([359, 368, 460, 475, 486, 492, 496, 514, 516, 525])), 849: 11137, 850: 5564,
                 851: 11168, **dict(zip(range(995, 1000), [21181, 21196, 21200, 21369, 21817]))}


def test_imagenet1k_rows_of_the_imagenet22k_classifier_are_swin_s():
    rows = imagenet1k_rows_of_imagenet22k()
    assert len(rows) == len(set(rows)) == 1000 and max(rows) < IMAGENET22K_CLASSES
    assert {i: rows[i] for i in SWIN_22K_ROWS} == SWIN_22K_ROWS


def imagenet22k_swin_checkpoint(name, path, **kwargs):
    """A Swin trained on 21841 classes, saved as Swin's releases are ({'model': ...})."""
    source = randomize(timm.create_model(name, **dict(kwargs, num_classes=IMAGENET22K_CLASSES)))
    torch.save({'model': source.state_dict()}, path)
    return source


def test_a_1000_class_fine_tuning_start_keeps_the_imagenet1k_rows_of_an_imagenet22k_classifier(tmp_path, caplog):
    """As Swin's fine-tuning from its ImageNet-22k weights: by train.py's start (MODEL.PRETRAINED), by
    `load_pretrained_into` for another attention, by the checkpoint filter and by timm's `pretrained=True` with
    the ImageNet-22k tag; a model of another class count starts with a new classifier."""
    kwargs = {k: v for k, v in tiny_kwargs('softmax_swin_tiny').items() if k != 'num_classes'}
    path = tmp_path / 'swin_tiny_patch4_window7_224_22k.pth'
    source = imagenet22k_swin_checkpoint('softmax_swin_tiny', path, **kwargs)
    rows = list(imagenet1k_rows_of_imagenet22k())
    expected_weight, expected_bias = source.head.weight[rows], source.head.bias[rows]

    opts = ['MODEL.NAME', 'softmax_swin_tiny', 'DATA.IMG_SIZE', '32', 'MODEL.NUM_CLASSES', '1000',
            *[item for key, value in kwargs.items() if key != 'img_size'
              for item in (f'MODEL.KWARGS.{key}', str(list(value) if isinstance(value, tuple) else value))]]
    cfg = load_config(None, opts)
    with caplog.at_level(logging.INFO):
        started = create_model(cfg, read_weights(str(path)), source=str(path))
    assert torch.equal(started.head.weight, expected_weight) and torch.equal(started.head.bias, expected_bias)
    assert torch.equal(started.patch_embed.proj.weight, source.patch_embed.proj.weight)
    assert "classifier rows of the 1000 ImageNet-1k classes from the weights' 21841 ImageNet-22k" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):  # MODEL.PRETRAINED_STRICT False
        started = create_model(cfg, read_weights(str(path)), source=str(path), strict=False)
    assert torch.equal(started.head.weight, expected_weight)
    assert "classifier rows of the 1000 ImageNet-1k classes from the weights' 21841 ImageNet-22k" in caplog.text
    # train.py names the data's classes: ImageNet's folders take the rows, others a new classifier
    started = create_model(cfg, read_weights(str(path)), source=str(path), classes=imagenet1k_classes())
    assert torch.equal(started.head.weight, expected_weight)
    numbered = [str(i) for i in range(1000)]
    for strict in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            started = create_model(cfg, read_weights(str(path)), source=str(path), strict=strict, classes=numbered)
        assert started.head.weight.shape == expected_weight.shape
        assert not torch.equal(started.head.weight, expected_weight)
        assert torch.equal(started.patch_embed.proj.weight, source.patch_embed.proj.weight)
        assert (f"{path}: kept none of the weights' 21841 ImageNet-22k classifier rows: the data's classes are not "
                f"ImageNet-1k's (class 0 is '0', not 'n01440764'), so those rows would start the wrong "
                f"classes") in caplog.text
        assert "took the classifier rows" not in caplog.text

    other_attention = timm.create_model('inline_swin_tiny', **dict(tiny_kwargs('inline_swin_tiny'), num_classes=1000))
    report = load_pretrained_into(other_attention, str(path))
    assert 'head.weight' in report.loaded and torch.equal(other_attention.head.weight, expected_weight)

    model = timm.create_model('softmax_swin_tiny', **kwargs, num_classes=1000)
    model.load_state_dict(checkpoint_filter_fn(torch.load(path, weights_only=True), model))
    assert torch.equal(model.head.bias, expected_bias)

    # timm's loader drops a classifier whose class count differs from the pretrained cfg's (21841 here)
    model = timm.create_model('softmax_swin_tiny.ms_in22k', pretrained=True, num_classes=1000,
                              pretrained_cfg_overlay=dict(file=str(path)), **kwargs)
    assert torch.equal(model.head.weight, expected_weight) and torch.equal(model.head.bias, expected_bias)

    ten_classes = timm.create_model('softmax_swin_tiny', **kwargs, num_classes=10)
    report = load_pretrained_into(ten_classes, str(path))
    assert 'head.weight' in report.new and 'head.weight' in report.dropped


def test_train_py_fine_tunes_other_1000_classes_from_imagenet22k_weights_with_a_new_classifier(tmp_path):
    """The 22k-to-1k recipe on 1000 numbered class folders (0, 1, 10, 100, ... in class order): ImageNet-1k's rows
    would start each from an unrelated ImageNet class, and train.py said it took them."""
    kwargs = {k: v for k, v in tiny_kwargs('softmax_swin_tiny').items() if k not in ('num_classes', 'img_size')}
    path = tmp_path / 'swin_tiny_patch4_window7_224_22k.pth'
    imagenet22k_swin_checkpoint('softmax_swin_tiny', path, img_size=32, **kwargs)
    for split in ('train', 'val'):
        for label in range(1000):
            (tmp_path / 'data' / split / str(label)).mkdir(parents=True)
            Image.new('RGB', (8, 8), (label % 256, 0, 0)).save(tmp_path / 'data' / split / str(label) / 'a.png')
    opts = ['DATA.IMG_SIZE', '32', 'DATA.BATCH_SIZE', '500', 'DATA.NUM_WORKERS', '0', 'TRAIN.EPOCHS', '1',
            'TRAIN.WARMUP_EPOCHS', '0', 'TRAIN.ACCUMULATION_STEPS', '1',
            *[item for key, value in kwargs.items()
              for item in (f'MODEL.KWARGS.{key}', str(list(value) if isinstance(value, tuple) else value))]]
    argv = ['--cfg', str(REPO / 'configs' / 'softmax' / 'swin_tiny_22kto1k.yaml'), '--data-path',
            str(tmp_path / 'data'), '--pretrained', str(path), '--output', str(tmp_path / 'run'), '--opts', *opts]
    assert train_main(argv) == 0
    log = (tmp_path / 'run' / 'train.log').read_text()
    assert (f"{path}: kept none of the weights' 21841 ImageNet-22k classifier rows: the data's classes are not "
            f"ImageNet-1k's (class 0 is '0', not 'n01440764')") in log
    assert f"{path}: re-initialised the classifier for 1000 classes (the weights have 21841)" in log


def test_eval_py_scores_imagenet22k_swin_weights_on_imagenet1k_folders_by_their_imagenet1k_rows(tmp_path, capsys):
    """eval.py refused ImageNet-22k weights on ImageNet-1k's class folders (21841 classes, 1000 folders); they
    now score through the ImageNet-1k rows of their classifier, as the fine-tuning starts: the numbers of those rows
    saved as a 1000-class checkpoint, by --model with the 22k tag or without, and by --cfg of 1000 classes. Other
    1000 class folders are one line, before any image is read."""
    kwargs = {k: v for k, v in tiny_kwargs('softmax_swin_tiny').items() if k not in ('num_classes', 'img_size')}
    path = tmp_path / 'swin_tiny_patch4_window7_224_22k.pth'
    source = imagenet22k_swin_checkpoint('softmax_swin_tiny', path, img_size=32, **kwargs)
    rows = list(imagenet1k_rows_of_imagenet22k())
    narrowed = dict(source.state_dict(),
                    **{'head.weight': source.head.weight[rows], 'head.bias': source.head.bias[rows]})
    torch.save({'model': narrowed}, tmp_path / 'narrowed.pth')
    generator = torch.Generator().manual_seed(0)
    for folder, names in (('imagenet', imagenet1k_classes()), ('numbered', [str(i) for i in range(1000)]),
                          ('ten', imagenet1k_classes()[:10])):
        for name in names:
            (tmp_path / folder / 'val' / name).mkdir(parents=True)
            pixels = torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8, generator=generator).numpy()
            Image.fromarray(pixels).save(tmp_path / folder / 'val' / name / 'a.png')
    opts = ['DATA.IMG_SIZE', '32', 'DATA.NUM_WORKERS', '0', 'TEST.BATCH_SIZE', '250',
            *[item for key, value in kwargs.items()
              for item in (f'MODEL.KWARGS.{key}', str(list(value) if isinstance(value, tuple) else value))]]

    def evaluate(argv, data='imagenet'):
        code = run_cli(eval_main, [*argv, '--data-path', str(tmp_path / data), '--opts', *opts])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = evaluate(['--model', 'softmax_swin_tiny', '--checkpoint', str(tmp_path / 'narrowed.pth')])
    expected = json.loads(out.splitlines()[-1])
    assert code == 0 and expected['count'] == 1000
    for argv in (['--model', 'softmax_swin_tiny.ms_in22k', '--checkpoint', str(path)],
                 ['--model', 'softmax_swin_tiny', '--checkpoint', str(path)],
                 ['--cfg', str(REPO / 'configs' / 'softmax' / 'swin_tiny_22kto1k.yaml'), '--checkpoint', str(path)]):
        code, out, err = evaluate(argv)
        result = json.loads(out.splitlines()[-1])
        assert code == 0, err
        assert [result[k] for k in ('top1', 'top5', 'loss', 'count')] == \
            [expected[k] for k in ('top1', 'top5', 'loss', 'count')], argv
        assert "classifier rows of the 1000 ImageNet-1k classes from the weights' 21841 ImageNet-22k" in err
    code, out, err = evaluate(['--model', 'softmax_swin_tiny.ms_in22k', '--checkpoint', str(path)], 'numbered')
    assert code == USAGE_EXIT_CODE and out == ''
    assert err.strip().splitlines()[-1] == (
        f"error: checkpoint {str(path)!r} classifies the 21841 ImageNet-22k classes, of which it evaluates "
        f"ImageNet-1k's on 1000 class folders, but those of {tmp_path / 'numbered' / 'val'} are not ImageNet-1k's "
        f"(class 0 is '0', not 'n01440764'); expected ImageNet-1k's class folders in order")
    # elsewhere the classifier's rows are the class count, as before
    code, out, err = evaluate(['--cfg', str(REPO / 'configs' / 'softmax' / 'swin_tiny_22kto1k.yaml'), '--checkpoint',
                               str(path)], 'ten')
    assert code == USAGE_EXIT_CODE and err.strip().splitlines()[-1] == (
        f"error: checkpoint {str(path)!r} has a 21841-class classifier but MODEL.NUM_CLASSES is 1000; expected a "
        f"checkpoint for 1000 classes")
    code, out, err = evaluate(['--model', 'softmax_swin_tiny.ms_in22k', '--checkpoint', str(path)], 'ten')
    assert code == USAGE_EXIT_CODE and err.strip().splitlines()[-1] == (
        f"error: checkpoint {str(path)!r} is for 21841 classes but {tmp_path / 'ten'}/val has 10 class folders; "
        f"expected the dataset the checkpoint was trained on")


def test_cswin_starts_a_new_classifier_from_imagenet22k_weights(tmp_path):
    """CSwin's fine-tuning from ImageNet-22k (`--fine-22k`) drops the classifier; so does the zoo's start."""
    kwargs = dict(img_size=32, embed_dim=16, depth=[1, 1, 2, 1], num_heads=[2, 2, 4, 4], split_size=[1, 2, 1, 1])
    source = randomize(timm.create_model('softmax_cswin_tiny', **kwargs, num_classes=IMAGENET22K_CLASSES))
    path = tmp_path / 'cswin_large_22k_224.pth'
    torch.save({'state_dict_ema': source.state_dict()}, path)
    model = timm.create_model('softmax_cswin_tiny', **kwargs, num_classes=1000)
    report = load_pretrained_into(model, str(path))
    assert report.new == ['head.weight', 'head.bias'] and 'stage1_conv_embed.0.weight' in report.loaded
