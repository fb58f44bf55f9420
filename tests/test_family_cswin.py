"""CSwin family: blocks against naive float64 re-computations (softmax stripes, InLine and FLatten global branches
with LePE), parameter counts and official key names, the stripe rules, checkpoint loading and the timm API."""
import copy
import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import timm
from yacs.config import CfgNode

from models.attention import list_attentions
from models.checkpoint import CheckpointError
from models.cswin import CSWinBlock, CSWinTransformer

FLAVOURS = tuple(list_attentions())
SIZES = ('tiny', 'small', 'base', 'base_384', 'large', 'large_384')
ALL_NAMES = [f'{f}_cswin_{s}' for f in FLAVOURS for s in SIZES]

# Grids 8, 4, 2, 1: score-forming stages 1-3 use two stripe branches, stage 4 one global branch.
TINY = dict(img_size=32, embed_dim=16, depth=[1, 1, 2, 1], num_heads=[2, 2, 4, 4], split_size=[1, 2, 1, 1],
            num_classes=10)


@functools.lru_cache(maxsize=None)
def _meta_model(name, **kwargs):
    with torch.device('meta'):
        return timm.create_model(name, **kwargs)


def meta_model(name, **kwargs):
    """A model built on the meta device (no memory, fast), cached: read it, never change it."""
    return _meta_model(name, **{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def randomize(module, seed=0):
    """LayerNorm weights 1 + 0.1·N(0,1), every other parameter 0.1·N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1 + noise if name.endswith('weight') and p.ndim == 1 and 'norm' in name else noise)
    return module


def make_block(attn_name, dim, num_heads, grid, split_size, **options):
    block = CSWinBlock(dim, num_heads, grid, attn_name, split_size, 4., True, 0., 0., 0., options)
    return randomize(block).double().eval()


# ------------------------------------------------------------------------------- naive re-computations


def naive_linear(x, layer):
    return x @ layer.weight.T + layer.bias


def naive_mlp_residual(block, x):
    y = F.layer_norm(x, x.shape[-1:], block.norm2.weight, block.norm2.bias, 1e-5)
    hidden = naive_linear(y, block.mlp.fc1)
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    return x + naive_linear(hidden, block.mlp.fc2)


def naive_qkv(block, x):
    y = F.layer_norm(x, x.shape[-1:], block.norm1.weight, block.norm1.bias, 1e-5)
    return naive_linear(y, block.attn.qkv).chunk(3, dim=-1)


def image(tokens, h, w):
    """(n, c) row-major tokens -> (1, c, h, w)."""
    return tokens.T.reshape(1, -1, h, w)


def naive_cswin_softmax_block(block, x):
    """Softmax within stripes, one (y, x) loop per stripe and a per-head loop; LePE = depthwise 3x3 conv of each
    stripe's V image with zero padding at the stripe border."""
    B, N, C = x.shape
    H, W = block.grid_size
    q, k, v = naive_qkv(block, x)
    branches = block.attn.attns
    if len(branches) == 1:
        parts = [(branches[0], slice(0, C), (H, W))]
    else:
        split = branches[0].window[1]
        parts = [(branches[0], slice(0, C // 2), (H, split)), (branches[1], slice(C // 2, C), (split, W))]
    out = torch.zeros_like(x)
    for branch, channels, (wh, ww) in parts:
        d = (channels.stop - channels.start) // branch.num_heads
        for b in range(B):
            for r0 in range(0, H, wh):
                for c0 in range(0, W, ww):
                    idx = [r * W + c for r in range(r0, r0 + wh) for c in range(c0, c0 + ww)]
                    qs, ks, vs = q[b, idx, channels], k[b, idx, channels], v[b, idx, channels]
                    lepe = F.conv2d(image(vs, wh, ww), branch.get_v.weight, branch.get_v.bias, padding=1,
                                    groups=vs.shape[1])
                    mixed = torch.cat([
                        torch.softmax(qs[:, h * d:(h + 1) * d] @ ks[:, h * d:(h + 1) * d].T * d ** -0.5, dim=-1)
                        @ vs[:, h * d:(h + 1) * d] for h in range(branch.num_heads)], dim=1)
                    out[b, idx, channels] = mixed + lepe[0].reshape(vs.shape[1], -1).T
    return naive_mlp_residual(block, x + naive_linear(out, block.attn.proj))


def naive_global_branch_block(block, x, mix):
    """One global branch: x + proj(mix(q, k, v, b) + LePE(v)), then the MLP residual."""
    B, N, C = x.shape
    H, W = block.grid_size
    branch = block.attn.attns[0]
    q, k, v = naive_qkv(block, x)
    out = torch.stack([
        mix(branch, q[b], k[b], v[b], b)
        + F.conv2d(image(v[b], H, W), branch.get_v.weight, branch.get_v.bias, padding=1, groups=C)[0]
        .reshape(C, N).T
        for b in range(B)])
    return naive_mlp_residual(block, x + naive_linear(out, block.attn.proj))


def test_softmax_stripes_match_naive_recomputation():
    x = torch.randn(2, 64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for split in (1, 2, 4):
        block = make_block('softmax', 16, 4, (8, 8), split)
        assert [a.window for a in block.attn.attns] == [(8, split), (split, 8)]
        with torch.no_grad():
            assert (block(x, block.grid_size) - naive_cswin_softmax_block(block, x)).abs().max() < 1e-12
    block = make_block('softmax', 16, 4, (8, 8), 8)     # stripes covering the grid: one global branch
    assert len(block.attn.attns) == 1 and block.attn.attns[0].num_heads == 4
    with torch.no_grad():
        assert (block(x, block.grid_size) - naive_cswin_softmax_block(block, x)).abs().max() < 1e-12


def test_inline_global_branch_matches_naive_recomputation_with_block_input_mean():
    """InLine in a CSwin block: A_ij = (s/N)(q_i·k_j − q_i·k̄) + 1/N per head, plus the local residual whose 3x3
    kernels come from the mean of the UN-normalised block input, plus LePE."""
    block = make_block('inline', 16, 2, (4, 4), 4)
    x = 1 + torch.randn(2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def mix(branch, q, k, v, b):
        N, C = q.shape
        d = C // branch.num_heads
        heads = []
        for h in range(branch.num_heads):
            qh, kh, vh = (t[:, h * d:(h + 1) * d] for t in (q, k, v))
            weights = (d ** -0.5 / N) * (qh @ kh.T - qh @ kh.mean(0, keepdim=True).T) + 1 / N
            heads.append(weights @ vh)
        kernels = branch.mixer.residual(x[b].mean(0)[None, :, None]).reshape(C, 1, 3, 3)
        local = F.conv2d(image(v, 4, 4), kernels, padding=1, groups=C)[0].reshape(C, N).T
        return torch.cat(heads, dim=1) + local

    with torch.no_grad():
        assert (block(x, block.grid_size) - naive_global_branch_block(block, x, mix)).abs().max() < 1e-12


def test_flatten_global_branch_matches_naive_recomputation():
    """FLatten in a CSwin block: positional encoding on K, focused map over all C channels, per-head normalised
    linear attention, the head-shared 5x5 depthwise conv of V, plus LePE."""
    block = make_block('flatten', 16, 2, (4, 4), 4, focusing_factor=3, kernel_size=5)
    branch = block.attn.attns[0]
    assert branch.mixer.positional_encoding.shape == (1, 16, 16) and branch.mixer.dwc.weight.shape == (8, 1, 5, 5)
    x = torch.randn(2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def focus(t, scale):
        t = (torch.relu(t) + 1e-6) / F.softplus(scale)
        return t.norm(dim=-1, keepdim=True) * t ** 3 / (t ** 3).norm(dim=-1, keepdim=True)

    def mix(branch, q, k, v, b):
        N, C = q.shape
        d = C // branch.num_heads
        phi_q = focus(q, branch.mixer.scale[0, 0])
        phi_k = focus(k + branch.mixer.positional_encoding[0], branch.mixer.scale[0, 0])
        heads = []
        for h in range(branch.num_heads):
            scores = phi_q[:, h * d:(h + 1) * d] @ phi_k[:, h * d:(h + 1) * d].T
            heads.append(scores @ v[:, h * d:(h + 1) * d] / (scores.sum(1, keepdim=True) + N * 1e-6))
        v_heads = v.T.reshape(branch.num_heads, d, 4, 4)
        local = F.conv2d(v_heads, branch.mixer.dwc.weight, branch.mixer.dwc.bias, padding=2, groups=d).reshape(C, N).T
        return torch.cat(heads, dim=1) + local

    with torch.no_grad():
        assert (block(x, block.grid_size) - naive_global_branch_block(block, x, mix)).abs().max() < 1e-12


# ------------------------------------------------------------------------------------- counts and keys

OFFICIAL_PARAMS = {
    'inline_cswin_tiny': 20_604_520, 'inline_cswin_small': 33_032_872, 'inline_cswin_base': 73_413_640,
    'inline_cswin_base_384': 73_413_640, 'flatten_cswin_tiny': 21_201_768, 'flatten_cswin_small': 35_451_752,
    'flatten_cswin_base': 74_867_032, 'flatten_cswin_base_384': 78_369_112,
}


def original_cswin_params(embed_dim, depth, num_classes=1000):
    """Closed form of the original CSwin: a block of width d has 12d² + 23d parameters (qkv 3d² + 3d, proj
    d² + d, two LayerNorms 4d, LePE depthwise 3x3 convs over all d channels 10d, MLP 8d² + 5d)."""
    dims = [embed_dim * 2 ** i for i in range(4)]
    stem = 3 * embed_dim * 49 + embed_dim + 2 * embed_dim
    blocks = sum(n * (12 * d * d + 23 * d) for n, d in zip(depth, dims))
    merges = sum(2 * d * d * 9 + 2 * d + 4 * d for d in dims[:3])
    return stem + blocks + merges + 2 * dims[3] + dims[3] * num_classes + num_classes


@pytest.mark.parametrize('name', list(OFFICIAL_PARAMS))
def test_official_parameter_count(name):
    assert num_params(meta_model(name)) == OFFICIAL_PARAMS[name]


@pytest.mark.parametrize('size, embed_dim, depth, readme_millions', [
    ('tiny', 64, (1, 2, 21, 1), 23), ('small', 64, (2, 4, 32, 2), 35), ('base', 96, (2, 4, 32, 2), 78),
    ('base_384', 96, (2, 4, 32, 2), 78), ('large', 144, (2, 4, 32, 2), 173), ('large_384', 144, (2, 4, 32, 2), 173),
])
def test_softmax_parameter_count(size, embed_dim, depth, readme_millions):
    count = num_params(meta_model(f'softmax_cswin_{size}'))
    assert count == original_cswin_params(embed_dim, depth)
    # the README rounds T/S/B up (22.3M is listed as 23M) and L (173.26M) down
    assert readme_millions in (math.floor(count / 1e6), math.ceil(count / 1e6))


def test_large_heads_are_the_official_ones():
    """CSwin-L has 24 heads in its last two stages (head widths 24 and 48), as the official entrypoint."""
    model = meta_model('softmax_cswin_large')
    assert [(stage.blocks[0].attn.dim, stage.blocks[0].attn.num_heads) for stage in model.stages] == [
        (144, 6), (288, 12), (576, 24), (1152, 24)]


def test_other_flavours_keep_the_original_architecture():
    count = num_params(meta_model('softmax_cswin_tiny'))
    # MultiMax adds 8 scalars per attention: two stripe branches in stages 1-3, one branch in stage 4.
    assert num_params(meta_model('multimax_cswin_tiny')) == count + 8 * (2 * (1 + 2 + 21) + 1)
    assert num_params(meta_model('sima_cswin_tiny')) == count


def test_original_key_listing():
    """Spec: the original CSWin_64_12211_tiny_224 has 418 keys with these names and shapes."""
    state = meta_model('softmax_cswin_tiny').state_dict()
    assert len(state) == 418
    shapes = {
        'stage1_conv_embed.0.weight': (64, 3, 7, 7), 'stage1_conv_embed.0.bias': (64,),
        'stage1_conv_embed.2.weight': (64,), 'stage1.0.qkv.weight': (192, 64), 'stage1.0.qkv.bias': (192,),
        'stage1.0.norm1.weight': (64,), 'stage1.0.proj.weight': (64, 64), 'stage1.0.attns.0.get_v.weight':
            (32, 1, 3, 3), 'stage1.0.attns.1.get_v.bias': (32,), 'stage1.0.mlp.fc1.weight': (256, 64),
        'stage1.0.mlp.fc2.weight': (64, 256), 'stage1.0.norm2.bias': (64,), 'merge1.conv.weight': (128, 64, 3, 3),
        'merge1.norm.weight': (128,), 'stage3.20.attns.1.get_v.weight': (128, 1, 3, 3),
        'stage4.0.attns.0.get_v.weight': (512, 1, 3, 3), 'norm.weight': (512,), 'head.weight': (1000, 512),
    }
    assert {k: tuple(state[k].shape) for k in shapes} == shapes
    assert 'stage4.0.attns.1.get_v.weight' not in state and not any('.attn.' in k for k in state)
    block_keys = [k[len('stage2.1.'):] for k in state if k.startswith('stage2.1.')]
    assert [k.split('.')[0] for k in block_keys] == ['qkv'] * 2 + ['norm1'] * 2 + ['proj'] * 2 + ['attns'] * 4 + [
        'mlp'] * 4 + ['norm2'] * 2


@pytest.mark.parametrize('name, shapes', [
    ('inline_cswin_tiny', {
        'stage1.0.attns.0.get_v.weight': (64, 1, 3, 3), 'stage1.0.attns.0.residual.0.weight': (64, 32, 1),
        'stage1.0.attns.0.residual.2.weight': (576, 32, 1), 'stage2.3.attns.0.residual.2.bias': (1152,),
        'stage3.0.attns.1.get_v.weight': (128, 1, 3, 3), 'stage4.0.attns.0.get_v.weight': (512, 1, 3, 3)}),
    ('flatten_cswin_tiny', {
        'stage1.0.attns.0.scale': (1, 1, 64), 'stage1.0.attns.0.positional_encoding': (1, 3136, 64),
        'stage2.0.attns.0.positional_encoding': (1, 784, 128), 'stage1.0.attns.0.dwc.weight': (32, 1, 5, 5),
        'stage1.0.attns.0.get_v.weight': (64, 1, 3, 3), 'stage3.17.attns.0.get_v.weight': (128, 1, 3, 3)}),
    ('flatten_cswin_base_384', {
        'stage1.0.attns.0.positional_encoding': (1, 9216, 96), 'stage2.5.attns.0.positional_encoding':
            (1, 2304, 192), 'stage1.0.attns.0.dwc.weight': (24, 1, 5, 5)}),
])
def test_official_key_shapes(name, shapes):
    state = meta_model(name).state_dict()
    assert len(state) == {'inline_cswin_tiny': 430, 'flatten_cswin_tiny': 430}.get(name, len(state))
    assert {k: tuple(state[k].shape) for k in shapes} == shapes


def test_stripe_rules():
    windows = lambda model, s: [a.window for a in model.stages[s - 1].blocks[0].attn.attns]
    original = meta_model('softmax_cswin_tiny')
    assert [windows(original, s) for s in (1, 2, 3, 4)] == [
        [(56, 1), (1, 56)], [(28, 2), (2, 28)], [(14, 7), (7, 14)], [None]]
    assert [windows(meta_model('softmax_cswin_base_384'), s) for s in (3, 4)] == [[(24, 12), (12, 24)], [None]]
    inline = meta_model('inline_cswin_tiny')          # la '56-28-14-7' covers the grids: one global branch
    assert [windows(inline, s) for s in (1, 2, 3, 4)] == [[None], [None], [(14, 7), (7, 14)], [None]]
    assert windows(meta_model('inline_cswin_tiny', la_split_size='28-28-14-7'), 1) == [(56, 28), (28, 56)]
    assert windows(meta_model('inline_cswin_tiny', la_split_size=[28, 28, 14, 7]), 1) == [(56, 28), (28, 56)]
    mixed = meta_model('inline_cswin_tiny', attn_type='IIMS2')
    assert [b.attn.attention_name for b in mixed.stages[2].blocks[:3]] == ['inline', 'inline', 'softmax']
    assert windows(mixed, 3) == [None]
    assert all(windows(meta_model('sima_cswin_tiny'), s) == [None] for s in (1, 2, 3, 4))


# --------------------------------------------------------------------------------- every entrypoint


def test_list_models():
    for flavour in FLAVOURS:
        assert timm.list_models(f'{flavour}_cswin_*') == sorted(f'{flavour}_cswin_{s}' for s in SIZES)
    assert timm.list_models('*_cswin_*', pretrained=True) == sorted(
        [f'{name}.in1k' for name in ['inline_cswin_tiny', 'inline_cswin_small', 'inline_cswin_base',
                                     'flatten_cswin_tiny', 'softmax_cswin_tiny', 'softmax_cswin_small',
                                     'softmax_cswin_base', 'softmax_cswin_base_384']]
        + ['softmax_cswin_large.in22k_ft_in1k', 'softmax_cswin_large.in22k', 'softmax_cswin_large_384.in22k_ft_in1k'])


@pytest.mark.parametrize('name', ALL_NAMES)
def test_entrypoint_forward_backward(name):
    torch.manual_seed(0)
    model = timm.create_model(name, **TINY)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.square().mean().backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_pretrained_cfgs():
    cfg = timm.get_pretrained_cfg('inline_cswin_tiny')
    assert cfg.url == 'https://cloud.tsinghua.edu.cn/f/49fa2ecc543647c4b970/?dl=1'
    assert (cfg.crop_pct, cfg.interpolation, cfg.first_conv, cfg.classifier) == (
        0.875, 'bicubic', 'stage1_conv_embed.0', 'head')
    cfg = timm.get_pretrained_cfg('flatten_cswin_base_384')
    assert not cfg.has_weights and cfg.input_size == (3, 384, 384) and cfg.crop_pct == 0.875
    cfg = timm.get_pretrained_cfg('softmax_cswin_base_384')
    assert cfg.url.endswith('/v0.1.0/cswin_base_384.pth') and cfg.crop_pct == 1.0
    assert timm.get_pretrained_cfg('softmax_cswin_tiny').crop_pct == 0.9
    release = 'https://github.com/microsoft/CSWin-Transformer/releases/download/v0.1.0/'
    cfg = timm.get_pretrained_cfg('softmax_cswin_large')   # the default: fine-tuned on ImageNet-1k
    assert (cfg.tag, cfg.url, cfg.num_classes, cfg.crop_pct) == (
        'in22k_ft_in1k', release + 'cswin_large_224.pth', 1000, 0.9)
    cfg = timm.get_pretrained_cfg('softmax_cswin_large.in22k')
    assert (cfg.url, cfg.num_classes, cfg.input_size) == (release + 'cswin_large_22k_224.pth', 21841, (3, 224, 224))
    cfg = timm.get_pretrained_cfg('softmax_cswin_large_384')
    assert (cfg.url, cfg.input_size, cfg.crop_pct) == (release + 'cswin_large_384.pth', (3, 384, 384), 1.0)
    with torch.device('meta'):
        assert timm.create_model('softmax_cswin_large.in22k').head.out_features == 21841


def test_layer_norm_eps_drop_path_rule_and_init():
    model = timm.create_model('flatten_cswin_tiny', drop_path_rate=0.3, **TINY)
    assert all(m.eps == 1e-5 for m in model.modules() if isinstance(m, nn.LayerNorm))
    rates = [getattr(b.drop_path, 'drop_prob', 0.) for s in (1, 2, 3, 4) for b in model.stages[s - 1].blocks]
    assert rates == pytest.approx(torch.linspace(0, 0.3, 5).tolist())
    assert torch.equal(model.head.bias, torch.zeros(10)) and torch.equal(model.norm.weight, torch.ones(128))
    assert torch.equal(model.stages[0].blocks[0].attn.attns[0].mixer.positional_encoding, torch.zeros(1, 64, 16))


# ----------------------------------------------------------------------------------------- checkpoints


def official_checkpoint(path, model=None, ema=None):
    """An official InLine/FLatten main_ema.py checkpoint: 'model', 'state_dict_ema' and a yacs 'config'."""
    config = CfgNode({'MODEL': CfgNode({'TYPE': 'inline_cswin_tiny'}), 'DATA': CfgNode({'IMG_SIZE': 32})})
    content = {'model': model.state_dict(), 'optimizer': {}, 'epoch': 3, 'config': config}
    if ema is not None:
        content['state_dict_ema'] = ema.state_dict()
    torch.save(content, path)


def test_official_format_checkpoint_loads_the_ema_weights_through_timm(tmp_path):
    raw = randomize(timm.create_model('inline_cswin_tiny', **TINY), seed=1)
    ema = randomize(timm.create_model('inline_cswin_tiny', **TINY), seed=2).eval()
    path = tmp_path / 'max_ema_acc.pth'
    official_checkpoint(path, raw, ema)
    model = timm.create_model('inline_cswin_tiny', pretrained=True, **TINY,
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ema(x))


def test_state_dict_hooks_round_trip_and_copies():
    model = randomize(timm.create_model('flatten_cswin_tiny', **TINY)).eval()
    clone = timm.create_model('flatten_cswin_tiny', **TINY).eval()
    assert str(clone.load_state_dict(model.state_dict(), strict=True)) == '<All keys matched successfully>'
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(clone(x), model(x))
        assert torch.equal(copy.deepcopy(model)(x), model(x))
    state = model.state_dict()
    del state['stage2.0.qkv.weight']
    # named as the state dict names it, not by its module path (stages.1.blocks.0.attn.qkv.weight)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "stage2\.0\.qkv\.weight"'):
        clone.load_state_dict(state)


def test_unsafe_checkpoint_is_refused_without_running_it(tmp_path):
    marker = tmp_path / 'ran'

    class Payload:
        def __reduce__(self):
            return os.system, (f'touch {marker}',)

    path = tmp_path / 'evil.pth'
    torch.save({'state_dict': {'head.bias': torch.zeros(10)}, 'args': Payload()}, path)
    with pytest.raises(RuntimeError, match='weights_only'):
        timm.create_model('softmax_cswin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    assert not marker.exists()


def test_checkpoint_of_another_model_fails_with_one_line_key_report(tmp_path):
    path = tmp_path / 'other.pth'
    official_checkpoint(path, timm.create_model('softmax_cswin_tiny', **TINY))
    with pytest.raises(CheckpointError) as info:
        timm.create_model('inline_cswin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    message = str(info.value)
    assert '\n' not in message
    assert 'missing: stage1.0.attns.0.residual.0.weight' in message
    assert 'unexpected: stage1.0.attns.1.get_v.weight' in message


def test_checkpoint_loads_at_another_img_size_with_interpolated_encodings(tmp_path):
    """flatten_cswin at 32 (grids 8, 4, 2, 1) -> 64 (16, 8, 4, 2): global FLatten positional encodings resized."""
    source = randomize(timm.create_model('flatten_cswin_tiny', **TINY))
    path = tmp_path / 'ckpt.pth'
    official_checkpoint(path, source)
    model = timm.create_model('flatten_cswin_tiny', pretrained=True, **dict(TINY, img_size=64),
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10))
    state, old = model.state_dict(), source.state_dict()
    for key, side, dim in (('stage1.0.attns.0.positional_encoding', 8, 16),
                           ('stage2.0.attns.0.positional_encoding', 4, 32)):
        expected = F.interpolate(old[key].reshape(1, side, side, dim).permute(0, 3, 1, 2), size=(2 * side,) * 2,
                                 mode='bicubic', align_corners=False).permute(0, 2, 3, 1).reshape(1, -1, dim)
        assert torch.allclose(state[key], expected, atol=1e-6)
    assert torch.equal(state['stage3.1.attns.1.get_v.weight'], old['stage3.1.attns.1.get_v.weight'])
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)


# --------------------------------------------------------------------------------------------- timm API


def test_features_only_and_intermediates():
    features = timm.create_model('softmax_cswin_tiny', features_only=True, **TINY)
    assert features.feature_info.channels() == [16, 32, 64, 128]
    assert features.feature_info.reduction() == [4, 8, 16, 32]
    x = torch.randn(2, 3, 32, 32)
    assert [tuple(f.shape) for f in features(x)] == [(2, 16, 8, 8), (2, 32, 4, 4), (2, 64, 2, 2), (2, 128, 1, 1)]
    pruned = timm.create_model('softmax_cswin_tiny', features_only=True, out_indices=(1,), **TINY)
    assert len(pruned.model.stages) == 2
    assert [tuple(f.shape) for f in pruned(x)] == [(2, 32, 4, 4)]

    model = randomize(timm.create_model('softmax_cswin_tiny', **TINY)).eval()
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, norm=True)
        assert torch.allclose(final, model.forward_features(x))
        assert final.shape == (2, 1, 1, 128) and torch.allclose(inter[-1], final.permute(0, 3, 1, 2))
        nlc = model.forward_intermediates(x, indices=[1], output_fmt='NLC', intermediates_only=True, stop_early=True)
        assert torch.equal(nlc[0].transpose(1, 2).reshape(2, 32, 4, 4), inter[1])


def test_bad_arguments_raise_value_errors():
    model = timm.create_model('softmax_cswin_tiny', **TINY)
    with pytest.raises(ValueError, match='input image size 64x64 does not match the model.s img_size 32x32'):
        model(torch.randn(1, 3, 64, 64))
    small = dict(TINY, depth=(1, 1, 1, 1))
    with pytest.raises(ValueError, match='patch_size 16 is not supported'):
        CSWinTransformer(patch_size=16, **small)
    with pytest.raises(ValueError, match="la_split_size '56-28' must give 4"):
        CSWinTransformer(la_split_size='56-28', **small)
    with pytest.raises(ValueError, match='img_size 30x30 must have sides that are positive multiples of 4'):
        CSWinTransformer(**dict(small, img_size=30))


def test_classifier_weight_decay_groups_and_grad_checkpointing():
    model = randomize(timm.create_model('inline_cswin_tiny', **TINY))
    assert model.no_weight_decay() == set()
    groups = list(timm.models.group_parameters(model, model.group_matcher()).values())
    # stem, 5 blocks (a merge joins the first block of its stage, as timm's Swin downsampling; the final norm the
    # last block), head; parameter names are the module's (`stages.{i}.embed` is the official `merge{i}`)
    assert len(groups) == 7 and groups[0][0] == 'stages.0.embed.0.weight'
    assert {'stages.1.embed.conv.weight', 'stages.1.blocks.0.norm1.weight'} <= set(groups[2])
    assert groups[5][-2:] == ['norm.weight', 'norm.bias'] and groups[6] == ['head.weight', 'head.bias']
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
