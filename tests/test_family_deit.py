"""DeiT family: golden outputs of the official InLine-DeiT, timm's DeiT, parameter counts, loading and the timm API."""
import os
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from yacs.config import CfgNode

import models
from models.attention import list_attentions
from models.checkpoint import CheckpointError
from models.attention.inline import InLineMixer
from models.attention.multimax import MultiMaxMixer
from models.attention.softmax import SoftmaxMixer
from models.vit import DeiT
from golden import load_golden

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
SIZES = ('tiny', 'small', 'base')
ALL_NAMES = [f'{attn}_deit_{size}' for attn in list_attentions() for size in SIZES]


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, **kwargs) -> torch.nn.Module:
    with torch.device('meta'):
        return timm.create_model(name, **kwargs)


# ------------------------------------------------------------------------------------------------ official outputs

def golden_model(spec: dict) -> DeiT:
    assert spec['family'] == 'InLine-DeiT' and spec['ln_eps'] == 1e-6
    return timm.create_model(
        'inline_deit_tiny', img_size=spec['img_size'], patch_size=spec['patch_size'], embed_dim=spec['embed_dim'],
        depth=spec['depth'], num_heads=spec['num_heads'], mlp_ratio=spec['mlp_ratio'], qkv_bias=spec['qkv_bias'],
        num_classes=spec['num_classes'])


def test_golden_inline_deit_float64_and_float32():
    data = load_golden('inline_deit_tiny_like')
    model = golden_model(data['spec']).eval()
    model.load_state_dict(data['state_dict'], strict=True)
    with torch.no_grad():
        out32 = model(data['input'])
        out64 = model.double()(data['input'].double())
    assert (out64 - data['output_fp64']).abs().max() < 1e-10
    assert (out32 - data['output_fp32']).abs().max() < 1e-4


def test_golden_inline_deit_through_checkpoint_filter():
    data = load_golden('inline_deit_tiny_like')
    model = golden_model(data['spec']).eval().double()
    state_dict = models.vit.checkpoint_filter_fn({'model': data['state_dict']}, model)
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        assert (model(data['input'].double()) - data['output_fp64']).abs().max() < 1e-10


@pytest.mark.parametrize('size', SIZES)
def test_softmax_deit_matches_timm_deit(size):
    """timm's own DeiT weights load strictly into softmax_deit_* and give timm's output."""
    torch.manual_seed(0)
    reference = timm.create_model(f'deit_{size}_patch16_224', depth=2).eval()
    model = timm.create_model(f'softmax_deit_{size}', depth=2).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (model(x) - reference(x)).abs().max() < 1e-6


def test_softmax_deit_tiny_full_depth_matches_timm():
    torch.manual_seed(0)
    reference = timm.create_model('deit_tiny_patch16_224').eval()
    model = timm.create_model('softmax_deit_tiny').eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (model(x) - reference(x)).abs().max() < 1e-6


# ------------------------------------------------------------------------------------------------ architecture

@pytest.mark.parametrize('name, expected', [
    ('inline_deit_tiny', 6_477_736), ('inline_deit_small', 16_734_760), ('inline_deit_base', 23_797_096)])
def test_inline_deit_parameter_counts(name, expected):
    assert count(meta_model(name)) == expected


@pytest.mark.parametrize('size', SIZES)
def test_softmax_deit_parameter_counts_equal_timm(size):
    assert count(meta_model(f'softmax_deit_{size}')) == count(meta_model(f'deit_{size}_patch16_224'))


@pytest.mark.parametrize('size', SIZES)
def test_variants_share_the_deit_architecture(size):
    """MultiMax adds its 8 scalars per block, SimA nothing; every variant keeps the DeiT width and depth (the
    official MultiMax-DeiT drops the class token and qkv bias: test_family_multimax_deit.py)."""
    base = meta_model(f'softmax_deit_{size}')
    assert count(meta_model(f'softmax_deit_{size}', attn_type='multimax')) == count(base) + 12 * 8
    assert count(meta_model(f'sima_deit_{size}')) == count(base)
    for attn in ('multimax', 'sima', 'additive'):
        model = meta_model(f'{attn}_deit_{size}')
        assert model.embed_dim == base.embed_dim and len(model.blocks) == 12
        assert model.blocks[0].attn.num_heads == base.blocks[0].attn.num_heads
        assert model.blocks[0].attn.attention_name == attn


@pytest.mark.parametrize('name, dim, heads, img', [
    ('softmax_deit_tiny', 192, 3, 224), ('softmax_deit_small', 384, 6, 224), ('softmax_deit_base', 768, 12, 224),
    ('inline_deit_tiny', 192, 6, 224), ('inline_deit_small', 320, 10, 288), ('inline_deit_base', 384, 12, 448)])
def test_widths_heads_and_input_sizes(name, dim, heads, img):
    model = meta_model(name)
    assert model.embed_dim == dim and model.blocks[0].attn.num_heads == heads
    assert model.img_size == (img, img) and model.pos_embed.shape == (1, 1 + (img // 16) ** 2, dim)
    assert model.pretrained_cfg['input_size'] == (3, img, img)
    assert model.norm.eps == 1e-6 and model.blocks[0].norm1.eps == 1e-6


def test_inline_deit_has_inline_in_every_block_and_official_keys():
    model = meta_model('inline_deit_tiny')
    assert all(isinstance(block.attn.mixer, InLineMixer) for block in model.blocks)
    keys = set(model.state_dict())
    assert {'cls_token', 'pos_embed', 'patch_embed.proj.weight', 'norm.weight', 'head.weight',
            'blocks.11.attn.residual.2.weight', 'blocks.0.mlp.fc2.bias'} <= keys
    assert model.state_dict()['blocks.0.attn.residual.2.weight'].shape == (1728, 32, 1)


@pytest.mark.parametrize('attn_type', ['inline', ['inline'], 'I'])
def test_attn_type_name_list_or_letter(attn_type):
    model = timm.create_model('softmax_deit_tiny', attn_type=attn_type, **TINY)
    assert all(isinstance(block.attn.mixer, InLineMixer) for block in model.blocks)


def test_attn_type_mixed_letter():
    model = timm.create_model('softmax_deit_tiny', attn_type='M1', **TINY)
    assert [type(b.attn.mixer) for b in model.blocks] == [InLineMixer, SoftmaxMixer]


@pytest.mark.parametrize('attn_type', ['nope', ['inline', 'softmax'], 'IS'])
def test_bad_attn_type_is_a_value_error(attn_type):
    with pytest.raises(ValueError, match='attn_type'):
        timm.create_model('softmax_deit_tiny', attn_type=attn_type, **TINY)


def test_multimax_deit_uses_multimax():
    model = timm.create_model('multimax_deit_tiny', **TINY)
    assert all(isinstance(block.attn.mixer, MultiMaxMixer) for block in model.blocks)


def test_drop_path_rises_linearly_over_blocks():
    model = timm.create_model('inline_deit_tiny', img_size=32, patch_size=8, embed_dim=32, depth=5, num_heads=2,
                              drop_path_rate=0.2)
    rates = [getattr(block.drop_path, 'drop_prob', 0.) for block in model.blocks]
    assert rates == pytest.approx([0., 0.05, 0.1, 0.15, 0.2])


def test_initialisation():
    torch.manual_seed(0)
    model = timm.create_model('softmax_deit_small', depth=2).requires_grad_(False)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(float(m.bias.abs().max()) == 0 for m in linears)
    assert model.blocks[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.pos_embed.std().item() == pytest.approx(0.02, rel=0.1)
    assert all(float((m.weight - 1).abs().max()) == 0 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))


# ------------------------------------------------------------------------------------------------ registry and API

def test_every_name_is_listed():
    assert set(ALL_NAMES) <= set(timm.list_models('*_deit_*'))
    assert timm.list_models('inline_deit_*') == ['inline_deit_base', 'inline_deit_small', 'inline_deit_tiny']


@pytest.mark.parametrize('name', ALL_NAMES)
def test_every_name_runs_forward_and_backward(name):
    torch.manual_seed(0)
    model = timm.create_model(name, **TINY)
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_pretrained_cfgs():
    urls = {
        'softmax_deit_tiny': 'https://dl.fbaipublicfiles.com/deit/deit_tiny_patch16_224-a1311bcf.pth',
        'softmax_deit_small': 'https://dl.fbaipublicfiles.com/deit/deit_small_patch16_224-cd65a155.pth',
        'softmax_deit_base': 'https://dl.fbaipublicfiles.com/deit/deit_base_patch16_224-b5f2ef4d.pth',
        'inline_deit_tiny': 'https://cloud.tsinghua.edu.cn/f/1d6b8191ad6d4114b291/?dl=1',
        'inline_deit_small': 'https://cloud.tsinghua.edu.cn/f/2f3898b07e9247f3beb3/?dl=1',
        'inline_deit_base': 'https://cloud.tsinghua.edu.cn/f/10bdd726d4b0435eb34e/?dl=1',
    }
    for name in ALL_NAMES:
        cfg = timm.models.get_pretrained_cfg(name).to_dict()
        assert cfg['crop_pct'] == 0.875 and cfg['interpolation'] == 'bicubic'
        assert cfg['mean'] == timm.data.IMAGENET_DEFAULT_MEAN and cfg['std'] == timm.data.IMAGENET_DEFAULT_STD
        assert cfg['first_conv'] == 'patch_embed.proj' and cfg['classifier'] == 'head'
        assert (cfg.get('url') or None) == urls.get(name)
    # released weights carry timm's tag: DeiT's own as timm tags them, the papers' 'in1k'
    assert set(timm.list_models('*_deit_*', pretrained=True)) == {
        f"{name}.{'fb_in1k' if name.startswith('softmax_') else 'in1k'}" for name in urls}
    assert timm.create_model('softmax_deit_tiny.fb_in1k').pretrained_cfg['url'] == urls['softmax_deit_tiny']


def test_input_of_another_size_is_a_value_error():
    model = timm.create_model('inline_deit_tiny', **TINY)
    with pytest.raises(ValueError, match=r'\(48, 32\).*\(32, 32\)'):
        model(torch.randn(1, 3, 48, 32))


def test_img_size_must_divide_into_patches():
    with pytest.raises(ValueError, match='img_size'):
        timm.create_model('softmax_deit_tiny', img_size=36, patch_size=8, embed_dim=32, depth=1, num_heads=2)


def test_head_pooling_and_classifier_reset():
    torch.manual_seed(0)
    model = timm.create_model('inline_deit_tiny', **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 17, 32)
        assert torch.equal(model.forward_head(tokens, pre_logits=True), tokens[:, 0])
        assert torch.allclose(model(x), model.head(tokens[:, 0]))
        model.reset_classifier(3, 'avg')
        assert model.get_classifier().out_features == 3 and model.num_classes == 3
        assert torch.allclose(model.forward_head(tokens, pre_logits=True), tokens[:, 1:].mean(1))
        model.reset_classifier(0)
        assert model(x).shape == (2, 32)
    with pytest.raises(ValueError, match='global_pool'):
        model.reset_classifier(3, 'map')
    assert model.no_weight_decay() == {'pos_embed', 'cls_token'}
    assert model.num_features == model.head_hidden_size == 32


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = timm.create_model('inline_deit_tiny', **TINY)
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, model.parameters()))


def test_features_only_and_intermediates():
    torch.manual_seed(0)
    kwargs = dict(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2)
    features = timm.create_model('inline_deit_tiny', features_only=True, out_indices=(1, 3), **kwargs)
    assert features.feature_info.channels() == [32, 32] and features.feature_info.reduction() == [8, 8]
    x = torch.randn(2, 3, 32, 32)
    assert [f.shape for f in features(x)] == [(2, 32, 4, 4)] * 2
    model = timm.create_model('inline_deit_tiny', **kwargs).eval()
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x, indices=2)
        assert torch.allclose(final, model.forward_features(x))
        assert [t.shape for t in intermediates] == [(2, 32, 4, 4)] * 2
        tokens = model.forward_intermediates(x, indices=[0], output_fmt='NLC', intermediates_only=True)[0]
        embedded = torch.cat([model.cls_token.expand(2, -1, -1), model.patch_embed(x)], dim=1) + model.pos_embed
        assert torch.allclose(tokens, model.blocks[0](embedded, model.grid_size)[:, 1:])
    default = timm.create_model('inline_deit_tiny', features_only=True, **kwargs)
    assert len(default(x)) == 3 and len(default.model.blocks) == 4


@pytest.mark.parametrize('global_pool', ['avg', 'token', 'avgmax', ''])
def test_fc_norm_norms_the_pooled_features_as_timms_deit(global_pool):
    """timm's `fc_norm=True` (the final norm after pooling, its `fc_norm` keys) was a TypeError. Its default here
    stays the official DeiT's: the norm on the tokens, at every pooling."""
    torch.manual_seed(0)
    ours = timm.create_model('softmax_deit_tiny', global_pool=global_pool, fc_norm=True, **TINY).eval()
    theirs = timm.create_model('deit_tiny_patch16_224', global_pool=global_pool, fc_norm=True, **TINY).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.forward_intermediates(x, norm=True), theirs.forward_intermediates(x, norm=True),
                                   rtol=0, atol=1e-6)
    default = timm.create_model('softmax_deit_tiny', global_pool=global_pool, **TINY)
    assert 'norm.weight' in default.state_dict() and 'fc_norm.weight' not in default.state_dict()
    ours.prune_intermediate_layers(1)  # the head's norm goes with the head, as in timm
    theirs.prune_intermediate_layers(1)
    assert isinstance(ours.fc_norm, nn.Identity) and isinstance(theirs.fc_norm, nn.Identity)
    with pytest.raises(ValueError, match=r"^fc_norm 'yes' is not a bool; expected True or False$"):
        timm.create_model('softmax_deit_tiny', fc_norm='yes')


def test_intermediates_with_prefix_tokens_and_as_a_dict_equal_timms_deit():
    # timm's own DeiT (its VisionTransformer) with the same weights: the prefix-token pairs and the dictionary that
    # class-token feature extractors read
    torch.manual_seed(0)
    ours = timm.create_model('softmax_deit_tiny', **TINY).eval()
    theirs = timm.create_model('deit_tiny_patch16_224', **TINY).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 32, 32)
    calls = [dict(return_prefix_tokens=True, output_fmt='NLC', intermediates_only=True),
             dict(return_prefix_tokens=True, indices=[0], norm=True),
             dict(return_prefix_tokens=True, output_dict=True),
             dict(output_dict=True, intermediates_only=True, output_fmt='NLC'),
             dict(indices=[0], stop_early=True)]  # the final features normed after the first block
    with torch.no_grad():
        for kwargs in calls:
            torch.testing.assert_close(ours.forward_intermediates(x, **kwargs),
                                       theirs.forward_intermediates(x, **kwargs), rtol=0, atol=1e-6, msg=str(kwargs))
        # positional arguments in timm's order: indices, return_prefix_tokens, norm (norm was the third)
        torch.testing.assert_close(ours.forward_intermediates(x, [0], True, True),
                                   theirs.forward_intermediates(x, [0], True, True), rtol=0, atol=1e-6)
        pairs = ours.forward_intermediates(x, return_prefix_tokens=True, intermediates_only=True)
        assert [(spatial.shape, prefix.shape) for spatial, prefix in pairs] == [((2, 32, 4, 4), (2, 1, 32))] * 2
        headless = timm.create_model('multimax_deit_tiny', **TINY).eval()  # no prefix tokens: no pairs, as in timm
        assert [t.shape for t in headless.forward_intermediates(x, return_prefix_tokens=True,
                                                                intermediates_only=True)] == [(2, 32, 4, 4)] * 2


# ------------------------------------------------------------------------------------------------ checkpoints

def official_checkpoint(path: Path, state_dict: dict) -> None:
    config = CfgNode()
    config.MODEL = CfgNode()
    config.MODEL.TYPE = 'inline_deit_tiny'
    torch.save({'model': state_dict, 'optimizer': {}, 'epoch': 300, 'max_accuracy': 74.5, 'config': config}, path)


def test_official_format_checkpoint_loads_through_timm(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model('inline_deit_tiny', **TINY).eval()
    path = tmp_path / 'ckpt.pth'
    official_checkpoint(path, source.state_dict())
    loaded = timm.create_model('inline_deit_tiny', pretrained=True, **TINY,
                               pretrained_cfg_overlay=dict(file=str(path), num_classes=10)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), source(x))


def test_checkpoint_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / 'marker'

    class Exploit:
        def __reduce__(self):
            return os.system, (f'touch {marker}',)

    model = timm.create_model('inline_deit_tiny', **TINY)
    path = tmp_path / 'evil.pth'
    torch.save({'model': model.state_dict(), 'config': Exploit()}, path)
    # named by the zoo's reader, as train.py and eval.py name it, where timm's said 'Unsupported global: os.system'
    with pytest.raises(CheckpointError, match=r"^pretrained weights file '.*evil\.pth' is refused: it pickles objects "
                                              r"outside the allow-list of tensors and plain containers \("):
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY,
                          pretrained_cfg_overlay=dict(file=str(path), num_classes=10))
    with pytest.raises(CheckpointError, match='refused'):
        models.checkpoint.load_checkpoint_file(str(path))
    assert not marker.exists()


def test_checkpoint_of_another_model_fails_with_one_line_report(tmp_path):
    path = tmp_path / 'softmax.pth'
    official_checkpoint(path, timm.create_model('softmax_deit_tiny', **TINY).state_dict())
    with pytest.raises(CheckpointError) as info:
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY,
                          pretrained_cfg_overlay=dict(file=str(path), num_classes=10))
    message = str(info.value)
    assert '\n' not in message and 'missing: blocks.0.attn.residual.0.weight' in message


def test_checkpoint_at_another_resolution_resizes_pos_embed(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model('inline_deit_tiny', **TINY)
    path = tmp_path / 'ckpt.pth'
    official_checkpoint(path, source.state_dict())
    overrides = dict(TINY, img_size=48)
    model = timm.create_model('inline_deit_tiny', pretrained=True, **overrides,
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10))
    old = source.pos_embed.detach()
    grid = old[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(6, 6), mode='bicubic', align_corners=False).flatten(2).transpose(1, 2)
    assert model.pos_embed.shape == (1, 37, 32)
    assert torch.equal(model.pos_embed[:, :1], old[:, :1])
    assert torch.allclose(model.pos_embed[:, 1:], expected, atol=1e-6)
    assert torch.equal(model.blocks[1].attn.mixer.residual[2].weight, source.blocks[1].attn.mixer.residual[2].weight)
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 10)


def test_checkpoint_with_another_class_count_gets_a_fresh_head(tmp_path):
    path = tmp_path / 'ckpt.pth'
    source = timm.create_model('inline_deit_tiny', **TINY)
    official_checkpoint(path, source.state_dict())
    model = timm.create_model('inline_deit_tiny', pretrained=True, **dict(TINY, num_classes=4),
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10))
    assert model.head.out_features == 4
    assert torch.equal(model.pos_embed, source.pos_embed)


def test_a_checkpoint_of_another_width_and_grid_is_named_in_the_shapes_of_the_file():
    """`pos_embed` is resampled to the model's grid before the keys are checked; the report names the shape the
    file holds, not the resampled one."""
    other = timm.create_model('softmax_deit_tiny', **dict(TINY, img_size=64, embed_dim=16))
    model = timm.create_model('softmax_deit_tiny', **TINY)
    with pytest.raises(CheckpointError) as info:
        models.vit.checkpoint_filter_fn(other.state_dict(), model)
    assert 'pos_embed (1, 65, 16) vs (1, 17, 32)' in str(info.value)


def test_distilled_deit_checkpoint_fails_with_one_line_report():
    distilled = timm.create_model('deit_tiny_distilled_patch16_224', **TINY)
    model = timm.create_model('softmax_deit_tiny', **TINY)
    with pytest.raises(CheckpointError) as info:
        models.vit.checkpoint_filter_fn({'model': distilled.state_dict()}, model)
    message = str(info.value)
    assert '\n' not in message and 'unexpected: dist_token, head_dist.weight, head_dist.bias' in message
    assert 'mis-shaped: pos_embed (1, 18, 32) vs (1, 17, 32)' in message
