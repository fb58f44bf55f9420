"""MultiMax-DeiT as the MultiMax code builds it: keys and parameter counts, a written-out float64 forward, σ
disabled equals the paper's softmax baseline, official state dicts load, and the class-token DeiT with MultiMax
stays available."""
from typing import Dict, Tuple

import pytest
import timm
import torch
import torch.nn.functional as F

import models  # noqa: F401  (registers the families)
from models.attention.multimax import MultiMaxMixer, multimax_modulation
from models.attention.softmax import SoftmaxMixer
from models.vit import DeiT
from reference import naive_sigma, naive_softmax

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
WIDTHS = {'tiny': (192, 3), 'small': (384, 6), 'base': (768, 12)}
SMALL_PARAMS = 22_036_176
# The softmax baseline of the paper: the same body without σ (no class token, mean pooling, qkv without bias).
BASELINE = dict(attn_type='softmax', multimax_logits=False)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, **kwargs) -> DeiT:
    with torch.device('meta'):
        return timm.create_model(name, **kwargs)


def official_keys(dim: int, depth: int = 12, patches: int = 196, classes: int = 1000,
                  patch: int = 16) -> Dict[str, Tuple[int, ...]]:
    """Every state-dict entry of the MultiMax code's VisionTransformer, in its order (spec §1.6)."""
    keys = {'pos_embed': (1, patches, dim), 'ranges': (4,), 'ts': (4,),
            'patch_embed.proj.weight': (dim, 3, patch, patch), 'patch_embed.proj.bias': (dim,)}
    for i in range(depth):
        b = f'blocks.{i}.'
        keys.update({
            b + 'norm1.weight': (dim,), b + 'norm1.bias': (dim,), b + 'attn.ranges': (4,), b + 'attn.ts': (4,),
            b + 'attn.qkv.weight': (3 * dim, dim), b + 'attn.proj.weight': (dim, dim), b + 'attn.proj.bias': (dim,),
            b + 'norm2.weight': (dim,), b + 'norm2.bias': (dim,), b + 'mlp.fc1.weight': (4 * dim, dim),
            b + 'mlp.fc1.bias': (4 * dim,), b + 'mlp.fc2.weight': (dim, 4 * dim), b + 'mlp.fc2.bias': (dim,),
        })
    keys.update({'norm.weight': (dim,), 'norm.bias': (dim,), 'head.weight': (classes, dim), 'head.bias': (classes,)})
    return keys


# ------------------------------------------------------------------------------------------------ architecture

def test_small_built_from_the_official_arguments_has_165_keys_and_22036176_parameters():
    # DeiT's factory passes qkv_bias=True, which the MultiMax file ignores: its qkv has no bias.
    model = meta_model('multimax_deit_small', patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4,
                       qkv_bias=True)
    state = model.state_dict()
    assert len(state) == 165 and count(model) == SMALL_PARAMS
    assert [(k, tuple(v.shape)) for k, v in state.items()] == list(official_keys(384).items())


@pytest.mark.parametrize('size', sorted(WIDTHS))
def test_every_size_is_deit_less_class_token_and_qkv_bias_plus_the_multimax_scalars(size):
    dim, heads = WIDTHS[size]
    model = meta_model(f'multimax_deit_{size}')
    deit = count(meta_model(f'deit_{size}_patch16_224'))
    assert count(model) == deit - 12 * 3 * dim - dim - dim + (12 + 1) * 8
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == list(official_keys(dim).items())
    assert model.blocks[0].attn.num_heads == heads and model.global_pool == 'avg' and model.num_prefix_tokens == 0
    assert all(isinstance(block.attn.mixer, MultiMaxMixer) for block in model.blocks)
    assert model.norm.eps == 1e-6 and model.blocks[0].norm1.eps == 1e-6


def test_the_class_token_deit_with_multimax_stays_available():
    model = meta_model('softmax_deit_small', attn_type='multimax')
    assert count(model) == 22_050_760 and 'cls_token' in model.state_dict()
    assert 'blocks.0.attn.qkv.bias' in model.state_dict() and 'ranges' not in model.state_dict()
    assert all(isinstance(block.attn.mixer, MultiMaxMixer) for block in model.blocks)


def test_softmax_baseline_is_the_same_body_without_sigma():
    model = meta_model('multimax_deit_small', **BASELINE)
    expected = {k: v for k, v in official_keys(384).items() if not k.endswith(('ranges', 'ts'))}
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == list(expected.items())
    assert count(model) == SMALL_PARAMS - 13 * 8
    assert all(isinstance(block.attn.mixer, SoftmaxMixer) for block in model.blocks)


def test_pretrained_cfgs_carry_the_paper_and_deit_evaluation():
    for size in WIDTHS:
        cfg = timm.models.get_pretrained_cfg(f'multimax_deit_{size}').to_dict()
        assert not cfg.get('url') and cfg['origin_url'] == 'https://github.com/ZhouYuxuanYX/MultiMax'
        assert cfg['crop_pct'] == 0.875 and cfg['interpolation'] == 'bicubic' and cfg['input_size'] == (3, 224, 224)


# ------------------------------------------------------------------------------------------------ outputs

def randomised(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def reference_multimax_deit(model: DeiT, x: torch.Tensor) -> torch.Tensor:
    """The MultiMax code's forward written out from the model's weights: σ before every softmax and on the logits."""
    p = model.state_dict()
    patch = p['patch_embed.proj.weight'].shape[-1]
    x = F.conv2d(x, p['patch_embed.proj.weight'], p['patch_embed.proj.bias'], stride=patch).flatten(2).mT
    x = x + p['pos_embed']
    C = x.shape[-1]
    for i in range(len(model.blocks)):
        b = f'blocks.{i}.'
        heads = model.blocks[i].attn.num_heads
        d = C // heads
        y = F.layer_norm(x, (C,), p[b + 'norm1.weight'], p[b + 'norm1.bias'], eps=1e-6)
        q, k, v = (y @ p[b + 'attn.qkv.weight'].T).split(C, dim=-1)
        out = torch.zeros_like(q)
        for h in range(heads):
            c = slice(h * d, (h + 1) * d)
            scores = q[..., c] @ k[..., c].mT * d ** -0.5
            out[..., c] = naive_softmax(naive_sigma(scores, p[b + 'attn.ranges'], p[b + 'attn.ts'])) @ v[..., c]
        x = x + out @ p[b + 'attn.proj.weight'].T + p[b + 'attn.proj.bias']
        y = F.layer_norm(x, (C,), p[b + 'norm2.weight'], p[b + 'norm2.bias'], eps=1e-6)
        y = F.gelu(y @ p[b + 'mlp.fc1.weight'].T + p[b + 'mlp.fc1.bias'])
        x = x + y @ p[b + 'mlp.fc2.weight'].T + p[b + 'mlp.fc2.bias']
    x = F.layer_norm(x, (C,), p['norm.weight'], p['norm.bias'], eps=1e-6).mean(1)
    return naive_sigma(x @ p['head.weight'].T + p['head.bias'], p['ranges'], p['ts'])


def test_forward_matches_the_written_out_formula_in_float64():
    torch.manual_seed(0)
    model = randomised(timm.create_model('multimax_deit_small', **TINY)).double().eval()
    assert float(model.ranges.detach().abs().min()) > 0
    assert float(model.blocks[1].attn.mixer.ts.detach().abs().min()) > 0
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        out = model(x)
        assert (out - reference_multimax_deit(model, x)).abs().max() < 1e-10
        logits = model.head(model.forward_head(model.forward_features(x), pre_logits=True))
        assert (out - logits).abs().max() > 1e-3, 'σ changes the logits'


def test_with_sigma_disabled_it_equals_the_softmax_baseline():
    torch.manual_seed(0)
    model = randomised(timm.create_model('multimax_deit_small', **TINY)).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(('ranges', 'ts')):
                param.zero_()
    baseline = timm.create_model('multimax_deit_small', **TINY, **BASELINE).double().eval()
    baseline.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith(('ranges', 'ts'))})
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        assert (model(x) - baseline(x)).abs().max() < 1e-12


def test_an_official_state_dict_loads_strictly_through_timm(tmp_path):
    torch.manual_seed(0)
    source = randomised(timm.create_model('multimax_deit_tiny', **TINY)).eval()
    official = {k: source.state_dict()[k] for k in official_keys(32, depth=2, patches=16, classes=10, patch=8)}
    torch.save(official, tmp_path / 'multimax.pth')
    model = timm.create_model('multimax_deit_tiny', pretrained=True, **TINY,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'multimax.pth'), num_classes=10)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))


def test_logits_keep_the_model_dtype_and_stay_float32_under_autocast():
    # timm's contract: a model moved to bfloat16 answers in bfloat16; under autocast σ's float32 result is kept
    model = timm.create_model('multimax_deit_tiny', **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert model(x).dtype == torch.float32
        low = model.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, rtol=0.1, atol=0.1)


def test_head_pre_logits_and_reset_classifier():
    torch.manual_seed(0)
    model = randomised(timm.create_model('multimax_deit_small', **TINY)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 16, 32)
        pooled = model.forward_head(tokens, pre_logits=True)
        assert torch.allclose(pooled, tokens.mean(1))
        assert torch.allclose(model(x), multimax_modulation(model.head(pooled), model.ranges, model.ts))
        model.reset_classifier(0)
        assert torch.allclose(model(x), pooled), 'no σ on features'
    with pytest.raises(ValueError, match="global_pool 'token' needs the class token"):
        timm.create_model('multimax_deit_small', global_pool='token', **TINY)


def test_sigma_on_the_logits_lives_and_goes_with_the_classifier(tmp_path):
    # without a classifier σ's `ranges` and `ts` would get no gradient, which distributed training refuses; a
    # checkpoint of the classified model still loads into the headless one, and a new classifier keeps trained σ
    torch.manual_seed(0)
    source = randomised(timm.create_model('multimax_deit_tiny', **TINY)).eval()
    torch.save(source.state_dict(), tmp_path / 'multimax.pth')
    headless = timm.create_model('multimax_deit_tiny', pretrained=True, **dict(TINY, num_classes=0),
                                 pretrained_cfg_overlay=dict(file=str(tmp_path / 'multimax.pth'), num_classes=10))
    assert headless.ranges is None and headless.ts is None and 'ranges' not in headless.state_dict()
    x = torch.randn(2, 3, 32, 32)
    headless(x).sum().backward()
    assert [n for n, p in headless.named_parameters() if p.grad is None] == []
    with torch.no_grad():
        assert torch.equal(headless.eval()(x), source.forward_head(source.forward_features(x), pre_logits=True))

    trained = source.ranges.detach().clone()
    source.reset_classifier(5)
    assert torch.equal(source.ranges.detach(), trained)
    source.reset_classifier(0)
    assert source.ranges is None and source.ts is None
    source.to(torch.float64).reset_classifier(3)
    assert source.ranges.dtype == source.ts.dtype == torch.float64 and source.ranges.shape == (4,)
    assert float(source.ts.detach().abs().min()) > 0, 'a new σ takes the official init'
    source(x.double()).sum().backward()
    assert source.ranges.grad is not None and source.ts.grad is not None


def test_training_reaches_every_parameter():
    torch.manual_seed(0)
    model = timm.create_model('multimax_deit_small', **TINY)
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
    assert model.no_weight_decay() == {'pos_embed', 'cls_token'}


def test_fullgraph_compile_matches_eager():
    torch.compiler.reset()
    torch.manual_seed(0)
    model = randomised(timm.create_model('multimax_deit_small', **TINY)).eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model, fullgraph=True, backend='eager')
    try:
        with torch.no_grad():
            assert (compiled(x) - model(x)).abs().max() < 1e-5
    finally:
        torch.compiler.reset()
