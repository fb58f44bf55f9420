"""PVT v2 family: FLatten-PVTv2 as released and configured (parameter counts, keys, a written-out float64 forward),
softmax PVT v2 against timm's own implementation, checkpoint layouts, pretrained cfgs and the timm API."""
from pathlib import Path
from typing import Dict, Tuple

import pytest
import timm
import timm.optim
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from yacs.config import CfgNode

import models  # noqa: F401  (registers the families)
from models.attention import list_attentions
from models.attention.flatten import FocusedLinearMixer
from models.attention.multimax import MultiMaxMixer
from models.pvt_v2 import PyramidVisionTransformerV2, checkpoint_filter_fn

SIZES = ('b0', 'b1', 'b2', 'b3', 'b4', 'b5')
ALL_NAMES = [f'{attn}_pvt_v2_{size}' for attn in list_attentions() for size in (*SIZES, 'b2_li')]
TINY = dict(img_size=64, embed_dims=[16, 32, 40, 64], num_heads=[1, 2, 5, 8], mlp_ratios=[2, 2, 2, 2],
            depths=[1, 2, 1, 1], num_classes=7)
# FLatten-PVTv2 as the official factories build it (spec inline_flatten.md §3.8).
FLATTEN_ARGS = {
    'b0': dict(embed_dims=[32, 64, 160, 256], depths=[2, 2, 2, 2]),
    'b1': dict(embed_dims=[64, 128, 320, 512], depths=[2, 2, 2, 2]),
    'b2': dict(embed_dims=[64, 128, 320, 512], depths=[3, 4, 6, 3]),
    'b3': dict(embed_dims=[64, 128, 320, 512], depths=[3, 4, 18, 3]),
    'b4': dict(embed_dims=[64, 128, 320, 512], depths=[3, 8, 27, 3]),
}
FLATTEN_COUNTS = {'b0': 3_594_824, 'b1': 12_931_240, 'b2': 22_548_264, 'b3': 38_273_832, 'b4': 51_836_968}
B0_URL = 'https://cloud.tsinghua.edu.cn/f/5d1f01532b104da28e7b/?dl=1'


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, **kwargs) -> PyramidVisionTransformerV2:
    with torch.device('meta'):
        return timm.create_model(name, **kwargs)


def official_flatten_keys(embed_dims, depths, heads=(1, 2, 5, 8), ratios=(8, 8, 4, 4), side=224,
                          kernel_size=5, classes=1000) -> Dict[str, Tuple[int, ...]]:
    """Every state-dict entry of the official FLatten-PVTv2 (LLLL, spatial reduction 1), in the official order."""
    keys: Dict[str, Tuple[int, ...]] = {}
    in_chans = 3
    for i, (C, depth, h, ratio) in enumerate(zip(embed_dims, depths, heads, ratios)):
        k, stride = (7, 4) if i == 0 else (3, 2)
        side = -(-side // stride)
        keys.update({f'patch_embed{i + 1}.proj.weight': (C, in_chans, k, k), f'patch_embed{i + 1}.proj.bias': (C,),
                     f'patch_embed{i + 1}.norm.weight': (C,), f'patch_embed{i + 1}.norm.bias': (C,)})
        hidden, d = C * ratio, C // h
        for j in range(depth):
            b = f'block{i + 1}.{j}.'
            keys.update({
                b + 'norm1.weight': (C,), b + 'norm1.bias': (C,),
                b + 'attn.scale': (1, 1, C), b + 'attn.positional_encoding': (1, side * side, C),
                b + 'attn.q.weight': (C, C), b + 'attn.q.bias': (C,),
                b + 'attn.kv.weight': (2 * C, C), b + 'attn.kv.bias': (2 * C,),
                b + 'attn.proj.weight': (C, C), b + 'attn.proj.bias': (C,),
                b + 'attn.dwc.weight': (d, 1, kernel_size, kernel_size), b + 'attn.dwc.bias': (d,),
                b + 'norm2.weight': (C,), b + 'norm2.bias': (C,),
                b + 'mlp.fc1.weight': (hidden, C), b + 'mlp.fc1.bias': (hidden,),
                b + 'mlp.dwconv.dwconv.weight': (hidden, 1, 3, 3), b + 'mlp.dwconv.dwconv.bias': (hidden,),
                b + 'mlp.fc2.weight': (C, hidden), b + 'mlp.fc2.bias': (C,),
            })
        keys.update({f'norm{i + 1}.weight': (C,), f'norm{i + 1}.bias': (C,)})
        in_chans = C
    keys.update({'head.weight': (classes, embed_dims[-1]), 'head.bias': (classes,)})
    return keys


# ------------------------------------------------------------------------------------------------ FLatten-PVTv2

@pytest.mark.parametrize('size', sorted(FLATTEN_ARGS))
def test_flatten_pvt_v2_parameter_count_and_keys_are_the_official_ones(size):
    model = meta_model(f'flatten_pvt_v2_{size}')
    assert count(model) == FLATTEN_COUNTS[size]
    expected = official_flatten_keys(**FLATTEN_ARGS[size])
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == list(expected.items())
    assert sum(map(lambda shape: torch.Size(shape).numel(), expected.values())) == FLATTEN_COUNTS[size]
    assert all(isinstance(b.attn.mixer, FocusedLinearMixer) and b.attn.sr_ratio == 1
               for i in range(1, 5) for b in model.stages[i - 1].blocks)


def test_flatten_pvt_v2_b0_has_the_186_keys_of_the_release():
    model = meta_model('flatten_pvt_v2_b0')
    assert len(model.state_dict()) == 186
    mixer = model.stages[0].blocks[0].attn.mixer
    assert mixer.focusing_factor == 3 and mixer.dwc.kernel_size == (5, 5) and mixer.dwc.padding == (2, 2)
    assert [model.stages[i - 1].blocks[0].attn.num_heads for i in range(1, 5)] == [1, 2, 5, 8]
    assert model.stages[0].patch_embed.norm.eps == 1e-5
    assert model.stages[0].blocks[0].norm1.eps == 1e-6 and model.stages[3].norm.eps == 1e-6


def test_flatten_pvt_v2_built_from_the_official_constructor_arguments():
    """The official factory's arguments (patch_size and qk_scale have no effect there) build the same model."""
    official = dict(embed_dims=[32, 64, 160, 256], num_heads=[1, 2, 5, 8], mlp_ratios=[8, 8, 4, 4], qkv_bias=True,
                    depths=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1], la_sr_ratios='1111', attn_type='LLLL',
                    focusing_factor=3, kernel_size=5)
    model = meta_model('flatten_pvt_v2_b0', **official)
    assert count(model) == FLATTEN_COUNTS['b0']
    assert list(model.state_dict()) == list(official_flatten_keys(**FLATTEN_ARGS['b0']))


def layer_norm(x, p, name, eps):
    return F.layer_norm(x, x.shape[-1:], p[name + '.weight'], p[name + '.bias'], eps=eps)


def reference_flatten_pvt_v2(model: PyramidVisionTransformerV2, x: torch.Tensor, p_focus: float = 3.) -> torch.Tensor:
    """The FLatten-PVTv2 forward written out from the model's weights (spec §2.3.2, §3.8), per head and token."""
    p = model.state_dict()
    B = x.shape[0]
    for s in range(1, 5):
        conv = p[f'patch_embed{s}.proj.weight']
        stride = 4 if s == 1 else 2
        x = F.conv2d(x, conv, p[f'patch_embed{s}.proj.bias'], stride=stride, padding=conv.shape[-1] // 2)
        H, W = x.shape[-2:]
        x = layer_norm(x.flatten(2).mT, p, f'patch_embed{s}.norm', 1e-5)
        for j in range(len(model.stages[s - 1].blocks)):
            b = f'block{s}.{j}.'
            C = x.shape[-1]
            heads = model.stages[s - 1].blocks[j].attn.num_heads
            d = C // heads
            y = layer_norm(x, p, b + 'norm1', 1e-6)
            q = y @ p[b + 'attn.q.weight'].T + p[b + 'attn.q.bias']
            k, v = (y @ p[b + 'attn.kv.weight'].T + p[b + 'attn.kv.bias']).split(C, dim=-1)
            k = k + p[b + 'attn.positional_encoding']
            temperature = torch.log1p(torch.exp(p[b + 'attn.scale']))

            def focus(t):
                t = (torch.clamp(t, min=0) + 1e-6) / temperature
                return t.norm(dim=-1, keepdim=True) * t ** p_focus / (t ** p_focus).norm(dim=-1, keepdim=True)

            fq, fk = focus(q), focus(k)
            out = torch.zeros_like(q)
            n = H * W
            for h in range(heads):
                c = slice(h * d, (h + 1) * d)
                weights = fq[..., c] @ fk[..., c].mT
                out[..., c] = weights @ v[..., c] / (weights.sum(-1, keepdim=True) + n * 1e-6)
                image = v[..., c].mT.reshape(B, d, H, W)
                local = F.conv2d(image, p[b + 'attn.dwc.weight'], p[b + 'attn.dwc.bias'],
                                 padding=p[b + 'attn.dwc.weight'].shape[-1] // 2, groups=d)
                out[..., c] += local.flatten(2).mT
            x = x + out @ p[b + 'attn.proj.weight'].T + p[b + 'attn.proj.bias']
            y = layer_norm(x, p, b + 'norm2', 1e-6)
            y = y @ p[b + 'mlp.fc1.weight'].T + p[b + 'mlp.fc1.bias']
            hidden = y.shape[-1]
            y = F.conv2d(y.mT.reshape(B, hidden, H, W), p[b + 'mlp.dwconv.dwconv.weight'],
                         p[b + 'mlp.dwconv.dwconv.bias'], padding=1, groups=hidden).flatten(2).mT
            x = x + F.gelu(y) @ p[b + 'mlp.fc2.weight'].T + p[b + 'mlp.fc2.bias']
        x = layer_norm(x, p, f'norm{s}', 1e-6)
        if s < 4:
            x = x.mT.reshape(B, -1, H, W)
    return x.mean(1) @ p['head.weight'].T + p['head.bias']


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def test_flatten_pvt_v2_matches_the_written_out_formula_in_float64():
    torch.manual_seed(0)
    model = randomised(timm.create_model('flatten_pvt_v2_b0', **TINY).double().eval())
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        assert (model(x) - reference_flatten_pvt_v2(model, x)).abs().max() < 1e-10


# ------------------------------------------------------------------------------------------------ PVT v2 itself

# b1, b3 and b4 differ from these only in depth
@pytest.mark.parametrize('size', ['b0', 'b2', 'b5', 'b2_li'])
def test_softmax_pvt_v2_has_timm_pvt_v2_parameter_count(size):
    assert count(meta_model(f'softmax_pvt_v2_{size}')) == count(meta_model(f'pvt_v2_{size}'))


def test_pvt_v2_b2_linear_has_the_official_size():
    """The PVT v2 README: PVT-V2-B2-Linear, 22.6 M parameters, 3.9 GFLOPs (multiply-accumulates) at 224."""
    model = meta_model('softmax_pvt_v2_b2_li')
    assert round(count(model) / 1e6, 1) == 22.6
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.empty(1, 3, 224, 224, device='meta'))
    assert round(counter.get_total_flops() / 2e9, 1) == 3.9


@pytest.mark.parametrize('size, img_size', [('b0', (64, 64)), ('b0', (72, 40)), ('b2_li', (64, 64)),
                                             ('b2_li', (72, 40)), ('b2_li', (24, 24))])
def test_softmax_pvt_v2_loads_timm_weights_and_gives_timm_outputs_in_float64(size, img_size):
    """timm's `pvt_v2_b*` (stages.{i}.… keys) renamed to the official keys: spatial reduction 8-4-2-1 with its
    LayerNorm (b2_li: average pooling to 7 × 7, a 1×1 convolution, LayerNorm and GELU in every stage, and a ReLU in
    the MLPs), depthwise-convolution MLP, per-stage norms; any input size with `dynamic_img_size` (24²: stage
    maps smaller than the 7 × 7 pool)."""
    torch.manual_seed(0)
    reference = randomised(timm.create_model(f'pvt_v2_{size}', **{k: v for k, v in TINY.items() if k != 'img_size'}))
    reference = reference.double().eval()
    model = timm.create_model(f'softmax_pvt_v2_{size}', **TINY, dynamic_img_size=True).double().eval()
    model.load_state_dict(checkpoint_filter_fn(reference.state_dict(), model), strict=True)
    x = torch.randn(2, 3, *img_size, dtype=torch.float64)
    with torch.no_grad():
        assert (model(x) - reference(x)).abs().max() < 1e-12
        ours = model.forward_intermediates(x, intermediates_only=True)
        theirs = reference.forward_intermediates(x, intermediates_only=True)
        assert all((a - b).abs().max() < 1e-12 for a, b in zip(ours, theirs))


def test_softmax_pvt_v2_official_keys():
    own = meta_model('softmax_pvt_v2_b2').state_dict()
    expected = {
        'patch_embed1.proj.weight': (64, 3, 7, 7), 'patch_embed2.proj.weight': (128, 64, 3, 3),
        'block1.0.attn.sr.weight': (64, 64, 8, 8), 'block1.0.attn.norm.weight': (64,),
        'block3.5.attn.sr.weight': (320, 320, 2, 2), 'block2.3.mlp.dwconv.dwconv.weight': (1024, 1, 3, 3),
        'norm4.weight': (512,), 'head.weight': (1000, 512),
    }
    assert {k: tuple(own[k].shape) for k in expected} == expected
    assert 'block4.0.attn.sr.weight' not in own and not any('pos_embed' in k or 'cls_token' in k for k in own)


def test_pvt_v2_b2_linear_pools_keys_in_every_stage():
    keys = meta_model('softmax_pvt_v2_b2_li').state_dict()
    assert [tuple(keys[f'block{i}.0.attn.sr.weight'].shape) for i in range(1, 5)] == [
        (64, 64, 1, 1), (128, 128, 1, 1), (320, 320, 1, 1), (512, 512, 1, 1)]
    assert keys.keys() - meta_model('softmax_pvt_v2_b2').state_dict().keys() == {
        f'block4.{j}.attn.{part}' for j in range(3) for part in ('sr.weight', 'sr.bias', 'norm.weight', 'norm.bias')}


@pytest.mark.parametrize('size', ['b0', 'b2', 'b2_li'])
def test_every_attention_keeps_the_pvt_v2_body(size):
    base = meta_model(f'softmax_pvt_v2_{size}')
    depths = [len(base.stages[i - 1].blocks) for i in range(1, 5)]
    multimax = meta_model(f'multimax_pvt_v2_{size}')
    assert count(multimax) == count(base) + 8 * sum(depths)
    assert all(isinstance(b.attn.mixer, MultiMaxMixer) for i in range(1, 5) for b in multimax.stages[i - 1].blocks)
    for attn in ('sima', 'additive', 'inline'):
        keys = meta_model(f'{attn}_pvt_v2_{size}').state_dict()
        assert not any('.attn.sr.' in k for k in keys), 'linear attentions use la_sr_ratios 1'


def test_any_attention_in_any_stage():
    model = timm.create_model('softmax_pvt_v2_b0', **dict(TINY, attn_type=['inline', 'flatten', 'multimax', 'sima']))
    assert [model.stages[i - 1].blocks[0].attn.attention_name for i in range(1, 5)] == [
        'inline', 'flatten', 'multimax', 'sima']
    assert [model.stages[i - 1].blocks[0].attn.sr_ratio for i in range(1, 5)] == [1, 1, 2, 1]
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_initialisation_is_the_official_one():
    torch.manual_seed(0)
    model = timm.create_model('softmax_pvt_v2_b1', depths=[1, 1, 1, 1]).requires_grad_(False)
    proj = model.stages[0].patch_embed.proj
    assert proj.weight.std().item() == pytest.approx((2 / (7 * 7 * 64)) ** 0.5, rel=0.05)
    assert float(proj.bias.abs().max()) == 0
    assert model.stages[0].blocks[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.stages[0].blocks[0].mlp.dwconv.dwconv.weight.std().item() == pytest.approx((2 / 9) ** 0.5, rel=0.05)


def test_drop_path_rises_linearly_over_all_blocks():
    model = timm.create_model('softmax_pvt_v2_b0', **dict(TINY, drop_path_rate=0.4))
    rates = [getattr(b.drop_path, 'drop_prob', 0.) for i in range(1, 5) for b in model.stages[i - 1].blocks]
    assert rates == pytest.approx([0., 0.1, 0.2, 0.3, 0.4])


def test_mismatched_stage_lists_are_value_errors():
    with pytest.raises(ValueError, match='depths'):
        timm.create_model('softmax_pvt_v2_b0', **dict(TINY, depths=[1, 1, 1]))
    with pytest.raises(ValueError, match='global_pool'):
        timm.create_model('softmax_pvt_v2_b0', **dict(TINY, global_pool='token'))



def test_another_input_size_needs_dynamic_img_size():
    model = timm.create_model('flatten_pvt_v2_b0', **TINY)
    with pytest.raises(ValueError, match=r"^input image size 96x96 does not match the model's img_size 64x64; "):
        model(torch.randn(1, 3, 96, 96))
    dynamic = timm.create_model('flatten_pvt_v2_b0', **TINY, dynamic_img_size=True)
    assert dynamic(torch.randn(1, 3, 96, 96)).shape == (1, dynamic.num_classes)


# ------------------------------------------------------------------------------------------------ registry and API

def test_every_name_is_listed():
    assert set(timm.list_models('*_pvt_v2_*')) == set(ALL_NAMES)


@pytest.mark.parametrize('name', ALL_NAMES)
def test_every_name_runs_forward_and_backward(name):
    torch.manual_seed(0)
    model = timm.create_model(name, **dict(TINY, img_size=32))
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_pretrained_cfgs():
    urls = {f'softmax_pvt_v2_{s}': f'https://github.com/whai362/PVT/releases/download/v2/pvt_v2_{s}.pth'
            for s in (*SIZES, 'b2_li')}
    urls['flatten_pvt_v2_b0'] = B0_URL
    for name in ALL_NAMES:
        cfg = timm.models.get_pretrained_cfg(name).to_dict()
        assert cfg['input_size'] == (3, 224, 224) and cfg['crop_pct'] == 0.875 and cfg['interpolation'] == 'bicubic'
        assert cfg['first_conv'] == 'patch_embed1.proj' and cfg['classifier'] == 'head'
        assert (cfg.get('url') or None) == urls.get(name)
    assert set(timm.list_models('*_pvt_v2_*', pretrained=True)) == {f'{name}.in1k' for name in urls}
    for size in FLATTEN_ARGS:
        cfg = timm.models.get_pretrained_cfg(f'flatten_pvt_v2_{size}').to_dict()
        assert cfg['crop_mode'] == 'squash' and cfg['fixed_input_size']
        assert cfg['origin_url'] == 'https://github.com/LeapLabTHU/FLatten-Transformer'


def test_released_b0_is_fetched_by_the_zoo_and_loaded(tmp_path, monkeypatch):
    """`pretrained=True` downloads the nameless release URL into the cache as `flatten_pvt_v2_b0.pth` and loads
    the official training checkpoint (weights under 'model', a pickled config) strictly."""
    torch.manual_seed(0)
    source = randomised(timm.create_model('flatten_pvt_v2_b0')).eval()
    path = tmp_path / 'flatten_pvt_v2_b0.pth'
    official_checkpoint(path, source.state_dict())
    requests = []

    def download(url: str, file_name: str, cache_dir=None) -> str:
        requests.append((url, file_name))
        return str(path)

    monkeypatch.setattr(models.family, 'download_checkpoint', download)
    model = timm.create_model('flatten_pvt_v2_b0', pretrained=True).eval()
    assert requests == [(B0_URL, 'flatten_pvt_v2_b0.pth')]
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))


def official_checkpoint(path: Path, state_dict: dict) -> None:
    config = CfgNode()
    config.MODEL = CfgNode()
    config.MODEL.TYPE = 'flatten_pvt_v2_b0'
    torch.save({'model': state_dict, 'optimizer': {}, 'epoch': 300, 'max_accuracy': 71.1, 'config': config}, path)


def test_timm_layout_checkpoint_loads_through_timm(tmp_path):
    torch.manual_seed(0)
    reference = timm.create_model('pvt_v2_b0', **{k: v for k, v in TINY.items() if k != 'img_size'}).eval()
    torch.save(reference.state_dict(), tmp_path / 'timm.pth')
    model = timm.create_model('softmax_pvt_v2_b0', pretrained=True, **TINY,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'timm.pth'), num_classes=7)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-5)


def test_head_pooling_and_classifier_reset():
    torch.manual_seed(0)
    model = timm.create_model('softmax_pvt_v2_b0', **TINY).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        features = model.forward_features(x)  # the last stage's map, as timm's PVT v2
        assert features.shape == (2, 64, 2, 2) and model.output_fmt == 'NCHW'
        assert torch.allclose(model(x), model.head(features.mean((2, 3))))
        model.reset_classifier(0)
        assert model(x).shape == (2, 64) and model.num_classes == 0
        model.reset_classifier(4)
        assert model(x).shape == (2, 4)
    assert model.no_weight_decay() == set()


def test_layer_decay_gives_each_stage_norm_the_rate_of_the_stage_s_last_block():
    """A stage's norm follows its blocks: grouped with the stage's first block, it got a lower learning rate under
    layer decay than the blocks before it. A stage's patch embedding shares its first block's rate."""
    model = timm.create_model('softmax_pvt_v2_b0', **TINY)
    groups = timm.optim.create_optimizer_v2(model, 'adamw', layer_decay=0.5).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    scale = {names[id(p)]: group['lr_scale'] for group in groups for p in group['params']}
    last_blocks = [d - 1 for d in TINY['depths']]
    for stage, last in enumerate(last_blocks):
        assert scale[f'stages.{stage}.norm.weight'] == scale[f'stages.{stage}.blocks.{last}.norm1.weight']
        if stage > 0:  # the first one is the stem
            assert scale[f'stages.{stage}.patch_embed.proj.weight'] == scale[f'stages.{stage}.blocks.0.norm1.weight']
    # stem, the 5 blocks, head: 0.5 ** 6 up to 1
    assert sorted(set(scale.values())) == [0.5 ** k for k in range(6, -1, -1)]


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = timm.create_model('softmax_pvt_v2_b0', **TINY)
    x = torch.randn(2, 3, 64, 64)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, model.parameters()))


def test_features_only_and_intermediates():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    features = timm.create_model('softmax_pvt_v2_b0', features_only=True, **TINY)
    assert features.feature_info.channels() == [16, 32, 40, 64]
    assert features.feature_info.reduction() == [4, 8, 16, 32]
    assert [f.shape for f in features(x)] == [(2, 16, 16, 16), (2, 32, 8, 8), (2, 40, 4, 4), (2, 64, 2, 2)]
    pruned = timm.create_model('softmax_pvt_v2_b0', features_only=True, out_indices=(0, 2), **TINY)
    assert [f.shape for f in pruned(x)] == [(2, 16, 16, 16), (2, 40, 4, 4)]
    assert not hasattr(pruned.model, 'block4') and not hasattr(pruned.model, 'norm4')
    model = timm.create_model('softmax_pvt_v2_b0', **TINY).eval()
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x, indices=[1, 3], output_fmt='NLC')
        assert torch.allclose(final, model.forward_features(x))
        assert [t.shape for t in intermediates] == [(2, 64, 32), (2, 4, 64)]
        assert torch.allclose(intermediates[1], final.flatten(2).transpose(1, 2))


def test_fullgraph_compile_matches_eager_with_four_attentions():
    torch.compiler.reset()
    torch.manual_seed(0)
    model = timm.create_model('softmax_pvt_v2_b0', **dict(TINY, attn_type=['flatten', 'inline', 'multimax', 'sima']))
    x = torch.randn(2, 3, 64, 64)
    compiled = torch.compile(model, fullgraph=True, backend='eager')
    try:
        assert (compiled(x) - model(x)).abs().max() < 1e-5
    finally:
        torch.compiler.reset()
