"""SimA's XCiT-style models as the official code builds them (parameter counts, the 371 keys of sima_small_12_p16,
a written-out float64 forward with both class-attention norms and both product orders, official state dicts), the
timm API, TorchScript and FX, and the DeiT-S -> SimA variant with LayerScale."""
import argparse
import math
import warnings
from typing import List, Tuple

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.optim import param_groups_weight_decay

import models  # noqa: F401  (registers the families)
from models.attention.sima import SimAMixer, sima_attention
from models.attention.softmax import SoftmaxMixer
from models.xcit_sima import SimAXCiT, checkpoint_filter_fn
from test_timm_contracts import TimmTracer

# (embed_dim, depth, heads, eta, tokens_norm) of the official factories (spec §2.5)
SIZES = {
    'nano_12': (128, 12, 4, 1.0, False), 'tiny_12': (192, 12, 4, 1.0, True), 'small_12': (384, 12, 8, 1.0, True),
    'tiny_24': (192, 24, 4, 1e-5, True), 'small_24': (384, 24, 8, 1e-5, True),
    'medium_24': (512, 24, 8, 1e-5, True), 'large_24': (768, 24, 16, 1e-5, True),
}
NAMES = [f'sima_{size}_p{patch}' for size in SIZES for patch in (16, 8)]
# Measured here; the spec's rounded figures (millions, §2.5) are checked against them below.
COUNTS = {
    'sima_nano_12_p16': 3_053_176, 'sima_nano_12_p8': 3_048_968,
    'sima_tiny_12_p16': 6_716_224, 'sima_tiny_12_p8': 6_706_456,
    'sima_small_12_p16': 26_253_208, 'sima_small_12_p8': 26_212_936,
    'sima_tiny_24_p16': 12_116_800, 'sima_tiny_24_p8': 12_107_032,
    'sima_small_24_p16': 47_671_192, 'sima_small_24_p8': 47_630_920,
    'sima_medium_24_p16': 84_395_560, 'sima_medium_24_p8': 84_323_432,
    'sima_large_24_p16': 189_095_752, 'sima_large_24_p8': 188_932_264,
}
SPEC_MILLIONS = {
    'sima_nano_12_p16': 3.05, 'sima_tiny_12_p16': 6.72, 'sima_small_12_p16': 26.25, 'sima_tiny_24_p16': 12.12,
    'sima_small_24_p16': 47.67, 'sima_medium_24_p16': 84.40, 'sima_large_24_p16': 189.10,
    'sima_small_12_p8': 26.21,
}
TINY = dict(embed_dim=16, depth=2, num_heads=2, num_classes=7)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(name, device='meta', **kwargs)


def official_keys(dim: int, depth: int, patch: int = 16, classes: int = 1000,
                  cls_layers: int = 2) -> List[Tuple[str, Tuple[int, ...]]]:
    """Every state-dict entry of the official model, in its order (spec §2.6)."""
    keys = [('cls_token', (1, 1, dim))]
    stages = 4 if patch == 16 else 3
    chans = 3
    for s in range(stages):
        width = dim // 2 ** (stages - 1 - s)
        bn = f'patch_embed.proj.{2 * s}.1.'
        keys += [(f'patch_embed.proj.{2 * s}.0.weight', (width, chans, 3, 3)),
                 (bn + 'weight', (width,)), (bn + 'bias', (width,)), (bn + 'running_mean', (width,)),
                 (bn + 'running_var', (width,)), (bn + 'num_batches_tracked', ())]
        chans = width
    hidden = 4 * dim
    for i in range(depth):
        b = f'blocks.{i}.'
        keys += [(b + 'gamma1', (dim,)), (b + 'gamma2', (dim,)), (b + 'gamma3', (dim,)),
                 (b + 'norm1.weight', (dim,)), (b + 'norm1.bias', (dim,)),
                 (b + 'attn.qkv.weight', (3 * dim, dim)), (b + 'attn.qkv.bias', (3 * dim,)),
                 (b + 'attn.proj.weight', (dim, dim)), (b + 'attn.proj.bias', (dim,)),
                 (b + 'norm2.weight', (dim,)), (b + 'norm2.bias', (dim,)),
                 (b + 'mlp.fc1.weight', (hidden, dim)), (b + 'mlp.fc1.bias', (hidden,)),
                 (b + 'mlp.fc2.weight', (dim, hidden)), (b + 'mlp.fc2.bias', (dim,)),
                 (b + 'norm3.weight', (dim,)), (b + 'norm3.bias', (dim,)),
                 (b + 'local_mp.conv1.weight', (dim, 1, 3, 3)), (b + 'local_mp.conv1.bias', (dim,)),
                 (b + 'local_mp.bn.weight', (dim,)), (b + 'local_mp.bn.bias', (dim,)),
                 (b + 'local_mp.bn.running_mean', (dim,)), (b + 'local_mp.bn.running_var', (dim,)),
                 (b + 'local_mp.bn.num_batches_tracked', ()),
                 (b + 'local_mp.conv2.weight', (dim, 1, 3, 3)), (b + 'local_mp.conv2.bias', (dim,))]
    for j in range(cls_layers):
        b = f'cls_attn_blocks.{j}.'
        keys += [(b + 'gamma1', (dim,)), (b + 'gamma2', (dim,)),
                 (b + 'norm1.weight', (dim,)), (b + 'norm1.bias', (dim,)),
                 (b + 'attn.qkv.weight', (3 * dim, dim)), (b + 'attn.qkv.bias', (3 * dim,)),
                 (b + 'attn.proj.weight', (dim, dim)), (b + 'attn.proj.bias', (dim,)),
                 (b + 'norm2.weight', (dim,)), (b + 'norm2.bias', (dim,)),
                 (b + 'mlp.fc1.weight', (hidden, dim)), (b + 'mlp.fc1.bias', (hidden,)),
                 (b + 'mlp.fc2.weight', (dim, hidden)), (b + 'mlp.fc2.bias', (dim,))]
    keys += [('norm.weight', (dim,)), ('norm.bias', (dim,)), ('head.weight', (classes, dim)), ('head.bias', (classes,)),
             ('pos_embeder.token_projection.weight', (dim, 64, 1, 1)), ('pos_embeder.token_projection.bias', (dim,))]
    return keys


# ------------------------------------------------------------------------------------------------ architecture

@pytest.mark.parametrize('name', NAMES)
def test_parameter_counts_are_the_official_ones(name):
    model = meta_model(name)
    assert count(model) == COUNTS[name]
    if name in SPEC_MILLIONS:
        assert round(COUNTS[name] / 1e6, 2) == SPEC_MILLIONS[name]
    dim, depth, heads, eta, tokens_norm = SIZES[name[len('sima_'):name.rindex('_')]]
    patch = int(name.rsplit('_p', 1)[1])
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == official_keys(dim, depth, patch)
    assert (model.blocks[0].attn.num_heads, model.cls_attn_blocks[0].attn.num_heads) == (heads, heads)
    assert all(b.tokens_norm == tokens_norm for b in model.cls_attn_blocks)


@pytest.mark.parametrize('size', ['small_12', 'tiny_24'])
def test_counts_are_timm_xcit_less_the_attention_temperatures(size):
    """SimA is XCiT without the per-head temperature of its attention (timm splits the class attention's qkv into
    q, k, v, with the same parameters)."""
    dim, depth, heads, _, _ = SIZES[size]
    for patch in (16, 8):
        xcit = count(meta_model(f'xcit_{size}_p{patch}_224'))
        assert count(meta_model(f'sima_{size}_p{patch}')) == xcit - depth * heads


def test_small_12_p16_has_the_371_official_keys():
    model = meta_model('sima_small_12_p16')
    state = model.state_dict()
    expected = official_keys(384, 12)
    assert len(state) == len(expected) == 371
    assert [(k, tuple(v.shape)) for k, v in state.items()] == expected
    assert isinstance(model.blocks[0].attn.mixer, SimAMixer) and model.blocks[0].attn.num_heads == 8
    assert model.blocks[0].norm1.eps == model.cls_attn_blocks[0].norm2.eps == model.norm.eps == 1e-6


def test_layer_scale_and_initialisation_are_the_official_ones():
    torch.manual_seed(0)
    model = timm.create_model('sima_tiny_24_p16', depth=2).requires_grad_(False)
    gammas = [p for n, p in model.named_parameters() if '.gamma' in n]
    assert len(gammas) == 2 * 3 + 2 * 2 and all(torch.all(g == 1e-5) for g in gammas)
    assert model.blocks[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert float(model.blocks[0].attn.qkv.bias.abs().max()) == 0
    assert model.cls_token.std().item() == pytest.approx(0.02, rel=0.2)
    assert all(float((m.weight - 1).abs().max()) == 0 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    # convolutions keep PyTorch's default init (kaiming-uniform, a = sqrt(5): bound 1 / sqrt(fan_in))
    conv = model.patch_embed.proj[6][0]
    assert float(conv.weight.abs().max()) <= 1 / math.sqrt(96 * 9)
    assert torch.all(timm.create_model('sima_small_12_p8', depth=1).blocks[0].gamma3 == 1.0)


def test_drop_path_is_uniform_over_the_sima_blocks_and_absent_from_class_attention():
    model = timm.create_model('sima_nano_12_p16', depth=4, drop_path_rate=0.3)
    assert [b.drop_path.drop_prob for b in model.blocks] == [0.3] * 4
    assert not any(type(m).__name__ == 'DropPath' for m in model.cls_attn_blocks.modules())


def test_any_registry_attention_in_the_patch_blocks():
    model = meta_model('sima_small_12_p16', attn_type='softmax', depth=2)
    assert all(isinstance(b.attn.mixer, SoftmaxMixer) for b in model.blocks)
    assert [k for k, _ in official_keys(384, 2)] == list(model.state_dict())
    assert not timm.models.get_pretrained_cfg('sima_small_12_p16').has_weights
    flatten = timm.create_model('sima_nano_12_p16', attn_type='flatten', **TINY)
    assert flatten(torch.randn(1, 3, 48, 32)).shape == (1, 7)


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match='patch_size 4 is not supported'):
        timm.create_model('sima_nano_12_p16', patch_size=4)
    with pytest.raises(ValueError, match='embed_dim 20 must be a multiple of 8'):
        timm.create_model('sima_nano_12_p16', embed_dim=20, num_heads=2)
    with pytest.raises(ValueError, match='eta'):
        timm.create_model('sima_nano_12_p16', eta=0)


# ------------------------------------------------------------------------------------------------ outputs

def randomised(model: SimAXCiT, seed: int = 0) -> SimAXCiT:
    """Weights far from their init, BatchNorm statistics away from (0, 1), and one query channel of the first
    SimA block and of the first class-attention block so small that each eps (1e-12, 1e-6) decides its norm."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in model.named_buffers():
            if name.endswith('running_mean'):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen, dtype=b.dtype))
            elif name.endswith('running_var'):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen, dtype=b.dtype))
        for qkv in (model.blocks[0].attn.qkv, model.cls_attn_blocks[0].attn.qkv):
            qkv.weight[0].mul_(1e-10)
            qkv.bias[0].mul_(1e-10)
    return model


def layer_norm(x, p, name):
    return F.layer_norm(x, x.shape[-1:], p[name + '.weight'], p[name + '.bias'], eps=1e-6)


def batch_norm(x, p, name):
    return F.batch_norm(x, p[name + '.running_mean'], p[name + '.running_var'], p[name + '.weight'],
                        p[name + '.bias'], training=False, eps=1e-5)


def mlp(x, p, name):
    x = F.gelu(x @ p[name + '.fc1.weight'].T + p[name + '.fc1.bias'])
    return x @ p[name + '.fc2.weight'].T + p[name + '.fc2.bias']


def l1(x, eps):
    """Each channel over the tokens (dim -2) divided by the sum of its absolute values, at least eps."""
    return x / torch.maximum(x.abs().sum(-2, keepdim=True), torch.tensor(eps, dtype=x.dtype))


def fourier(H: int, W: int) -> torch.Tensor:
    """(H*W, 64): the sine-cosine encoding of spec §2.4, rows then columns."""
    k = torch.arange(32, dtype=torch.float64)
    dim_t = 10000 ** (2 * torch.floor(k / 2) / 32)
    rows = (torch.arange(H, dtype=torch.float64) + 1) / (H + 1e-6) * 2 * math.pi
    cols = (torch.arange(W, dtype=torch.float64) + 1) / (W + 1e-6) * 2 * math.pi
    even = (k % 2 == 0)

    def enc(a):
        angle = a[:, None] / dim_t
        return torch.where(even, angle.sin(), angle.cos())

    return torch.cat([enc(rows)[:, None].expand(H, W, 32), enc(cols)[None].expand(H, W, 32)], -1).reshape(H * W, 64)


def reference_sima_xcit(model: SimAXCiT, x: torch.Tensor, patch: int, heads: int, tokens_norm: bool) -> torch.Tensor:
    """The official forward written out from the model's weights (spec §2.2-§2.4), per head."""
    p = model.state_dict()
    stages = 4 if patch == 16 else 3
    for s in range(stages):
        x = F.conv2d(x, p[f'patch_embed.proj.{2 * s}.0.weight'], stride=2, padding=1)
        x = batch_norm(x, p, f'patch_embed.proj.{2 * s}.1')
        x = F.gelu(x) if s < stages - 1 else x
    B, C, H, W = x.shape
    d = C // heads
    proj = p['pos_embeder.token_projection.weight'].reshape(C, 64)
    x = x.flatten(2).mT + fourier(H, W) @ proj.T + p['pos_embeder.token_projection.bias']
    for i in range(len(model.blocks)):
        b = f'blocks.{i}.'
        y = layer_norm(x, p, b + 'norm1')
        q, k, v = (y @ p[b + 'attn.qkv.weight'].T + p[b + 'attn.qkv.bias']).split(C, -1)
        out = torch.cat([l1(q[..., h * d:(h + 1) * d], 1e-12)
                         @ (l1(k[..., h * d:(h + 1) * d], 1e-12).mT @ v[..., h * d:(h + 1) * d])
                         for h in range(heads)], -1)
        x = x + p[b + 'gamma1'] * (out @ p[b + 'attn.proj.weight'].T + p[b + 'attn.proj.bias'])
        y = layer_norm(x, p, b + 'norm3').mT.reshape(B, C, H, W)
        y = F.gelu(F.conv2d(y, p[b + 'local_mp.conv1.weight'], p[b + 'local_mp.conv1.bias'], padding=1, groups=C))
        y = F.conv2d(batch_norm(y, p, b + 'local_mp.bn'), p[b + 'local_mp.conv2.weight'],
                     p[b + 'local_mp.conv2.bias'], padding=1, groups=C)
        x = x + p[b + 'gamma3'] * y.flatten(2).mT
        x = x + p[b + 'gamma2'] * mlp(layer_norm(x, p, b + 'norm2'), p, b + 'mlp')
    x = torch.cat([p['cls_token'].expand(B, -1, -1), x], 1)
    for j in range(len(model.cls_attn_blocks)):
        b = f'cls_attn_blocks.{j}.'
        y = layer_norm(x, p, b + 'norm1')
        q, k, v = (y @ p[b + 'attn.qkv.weight'].T + p[b + 'attn.qkv.bias']).split(C, -1)
        cls = []
        for h in range(heads):
            c = slice(h * d, (h + 1) * d)
            weights = l1(q[..., c], 1e-6)[:, :1] @ l1(k[..., c], 1e-6).mT  # the class query against all keys
            cls.append(weights @ v[..., c])
        cls = torch.cat(cls, -1) @ p[b + 'attn.proj.weight'].T + p[b + 'attn.proj.bias']
        x = x + p[b + 'gamma1'] * torch.cat([cls, y[:, 1:]], 1)  # the patch tokens: their normalised selves
        x = layer_norm(x, p, b + 'norm2') if tokens_norm else torch.cat([layer_norm(x[:, :1], p, b + 'norm2'),
                                                                          x[:, 1:]], 1)
        x = x + torch.cat([p[b + 'gamma2'] * mlp(x[:, :1], p, b + 'mlp'), x[:, 1:]], 1)
    return layer_norm(x, p, 'norm')[:, 0] @ p['head.weight'].T + p['head.bias']


# nano: class token normed alone, patch 16 on a 2x3 grid (6 tokens < 8 channels a head: (Q̂K̂ᵀ)V); tiny: every token
# normed, patch 8 on an odd 5x3 grid (15 tokens: Q̂(K̂ᵀV)).
@pytest.mark.parametrize('name, size, tokens_norm, patch', [
    ('sima_nano_12_p16', (32, 48), False, 16), ('sima_tiny_12_p8', (40, 24), True, 8)])
def test_forward_matches_the_written_out_formula_in_float64(name, size, tokens_norm, patch):
    torch.manual_seed(0)
    model = randomised(timm.create_model(name, **TINY)).double().eval()
    assert model.cls_attn_blocks[0].tokens_norm == tokens_norm
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    with torch.no_grad():
        out = model(x)
        assert (out - reference_sima_xcit(model, x, patch, 2, tokens_norm)).abs().max() < 1e-10
        # the same reference with the other norm differs: tokens_norm is what the formula says
        assert (out - reference_sima_xcit(model, x, patch, 2, not tokens_norm)).abs().max() > 1e-4


@pytest.mark.parametrize('tokens', [5, 8, 40])
def test_both_product_orders_give_the_same_attention(tokens):
    """(Q̂K̂ᵀ)V for fewer tokens than channels a head, Q̂(K̂ᵀV) otherwise: the same values."""
    gen = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(2, 3, tokens, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    qn, kn = l1(q, 1e-12), l1(k, 1e-12)
    out = sima_attention(q, k, v)
    assert (out - (qn @ kn.mT) @ v).abs().max() < 1e-12
    assert (out - qn @ (kn.mT @ v)).abs().max() < 1e-12


def test_training_mode_returns_plain_logits():
    torch.manual_seed(0)
    model = timm.create_model('sima_nano_12_p16', **TINY).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 7)
    out.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bfloat16_model_follows_float32():
    """The positional encoding's angles and the ℓ1 sums run in float32 at least, as the official code's under
    autocast; a bfloat16 model (built so by timm's `dtype`) stays close to its float32 self."""
    torch.manual_seed(0)
    model = randomised(timm.create_model('sima_nano_12_p16', **TINY)).eval()
    half = timm.create_model('sima_nano_12_p16', **TINY, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    half.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        expected, out = model(x), half(x.to(torch.bfloat16)).float()
    assert torch.isfinite(out).all() and (out - expected).abs().max() < 0.1 * expected.abs().max()


def test_input_sides_must_be_multiples_of_the_patch_size():
    model = timm.create_model('sima_nano_12_p16', **TINY).eval()
    with pytest.raises(ValueError, match=r'^input image size 40x32 must have sides that are positive multiples of '
                                         r'16$'):
        model(torch.randn(1, 3, 40, 32))
    assert model(torch.randn(1, 3, 64, 16)).shape == (1, 7)  # any multiple, no table to resample
    fixed = timm.create_model('sima_nano_12_p16', **TINY, img_size=32, dynamic_img_size=False)
    with pytest.raises(ValueError, match=r"^input image size 64x32 does not match the model's img_size 32x32"):
        fixed(torch.randn(1, 3, 64, 32))


# ------------------------------------------------------------------------------------------------ checkpoints

def test_official_checkpoints_load_strictly(tmp_path):
    """The official training checkpoint ({'model', 'model_ema', 'args', ...}) through timm's loader and through the
    filter (the release's download path), both taking the EMA weights as timm takes pretrained weights, and either
    when alone."""
    torch.manual_seed(0)
    source = randomised(timm.create_model('sima_nano_12_p8', **TINY)).eval()
    ema = randomised(timm.create_model('sima_nano_12_p8', **TINY), seed=1).eval()
    order = [k for k, _ in official_keys(16, 2, patch=8, classes=7)]
    official = {k: source.state_dict()[k] for k in order}
    path = tmp_path / 'checkpoint.pth'
    torch.save({'model': official, 'optimizer': {}, 'epoch': 399, 'model_ema': ema.state_dict(),
                'args': argparse.Namespace(model='sima_nano_12_p8', drop_path=0.05)}, path)
    loaded = timm.create_model('sima_nano_12_p8', pretrained=True, **TINY,
                               pretrained_cfg_overlay=dict(file=str(path), num_classes=7)).eval()
    x = torch.randn(2, 3, 32, 32)
    model = timm.create_model('sima_nano_12_p8', **TINY).eval()
    model.load_state_dict(checkpoint_filter_fn({'model': official, 'model_ema': ema.state_dict()}, model))
    with torch.no_grad():
        assert torch.equal(loaded(x), ema(x))
        assert torch.equal(model(x), ema(x))
        for alone in ('model', 'model_ema'):
            model.load_state_dict(checkpoint_filter_fn({alone: official}, model))
            assert torch.equal(model(x), source(x))
    with pytest.raises(ValueError, match=r'missing: blocks\.0\.gamma3'):
        checkpoint_filter_fn({k: v for k, v in official.items() if k != 'blocks.0.gamma3'}, model)


def test_pretrained_cfgs():
    for name in NAMES:
        cfg = timm.models.get_pretrained_cfg(name).to_dict()
        assert not cfg.get('url') and cfg['origin_url'] == 'https://github.com/UCDvision/sima'
        assert cfg['input_size'] == (3, 224, 224) and cfg['crop_pct'] == 0.875 and cfg['interpolation'] == 'bicubic'
        assert cfg['first_conv'] == 'patch_embed.proj.0.0' and cfg['classifier'] == 'head'
        assert not cfg['fixed_input_size']
    assert not timm.list_models('sima_*_p*', pretrained=True)
    assert sorted(timm.list_models('sima_*_p*')) == sorted(NAMES)


# ------------------------------------------------------------------------------------------------ timm API

def test_features_head_and_classifier_reset():
    torch.manual_seed(0)
    model = randomised(timm.create_model('sima_nano_12_p16', **TINY)).eval()
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 1 + 6, 16) and model.num_prefix_tokens == 1
        assert torch.equal(model.forward_head(tokens, pre_logits=True), tokens[:, 0])
        assert torch.allclose(model(x), model.head(tokens[:, 0]))
        model.reset_classifier(3, 'avg')
        assert torch.allclose(model.forward_head(tokens, pre_logits=True), tokens[:, 1:].mean(1))
        model.reset_classifier(0)
        assert model(x).shape == (2, 16) and model.num_features == model.head_hidden_size == 16
    with pytest.raises(ValueError, match='global_pool'):
        model.reset_classifier(3, 'map')


def test_weight_decay_groups_are_the_official_ones():
    model = timm.create_model('sima_nano_12_p16', **TINY)
    assert model.no_weight_decay() == {'cls_token'}
    no_decay, decay = param_groups_weight_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay())
    assert (no_decay['weight_decay'], decay['weight_decay']) == (0., 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay['params']}
    assert 'pos_embeder.token_projection.weight' in decayed and 'blocks.0.local_mp.conv1.weight' in decayed
    assert all(model.get_parameter(n).ndim > 1 for n in decayed) and 'cls_token' not in decayed
    matcher = model.group_matcher()
    assert set(matcher) == {'stem', 'blocks', 'cls_attn_blocks'}


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = timm.create_model('sima_nano_12_p16', **TINY).eval()  # BatchNorm statistics fixed
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, model.parameters()))


def test_intermediates_features_only_and_pruning():
    torch.manual_seed(0)
    kwargs = dict(TINY, depth=4)
    model = randomised(timm.create_model('sima_tiny_12_p8', **kwargs)).eval()
    x = torch.randn(2, 3, 40, 24)
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x, indices=[1, 3])
        assert torch.allclose(final, model.forward_features(x), atol=1e-6)
        assert [t.shape for t in intermediates] == [(2, 16, 5, 3)] * 2
        nlc = model.forward_intermediates(x, indices=2, output_fmt='NLC', norm=True, intermediates_only=True)
        assert [t.shape for t in nlc] == [(2, 15, 16)] * 2
        assert torch.allclose(nlc[1], model.norm(intermediates[1].flatten(2).mT), atol=1e-6)
        early, _ = model.forward_intermediates(x, indices=[1], stop_early=True)
        assert early.shape == final.shape and not torch.allclose(early, final)
    features = timm.create_model('sima_tiny_12_p8', features_only=True, out_indices=(1, 3), **kwargs)
    assert features.feature_info.channels() == [16, 16] and features.feature_info.reduction() == [8, 8]
    assert [f.shape for f in features(x)] == [(2, 16, 5, 3)] * 2
    pruned = randomised(timm.create_model('sima_tiny_12_p8', **kwargs)).eval()
    assert pruned.prune_intermediate_layers([0, 1]) == [0, 1]
    assert len(pruned.blocks) == 2 and len(pruned.cls_attn_blocks) == 0 and pruned.num_classes == 0
    assert len(pruned.feature_info) == 2
    # the class token goes with the class attention, as in timm's XCiT: the features are the normed patch tokens
    with torch.no_grad():
        assert pruned.cls_token is None and pruned.num_prefix_tokens == 0
        patches = pruned.forward_intermediates(x, indices=[1], output_fmt='NLC', intermediates_only=True)[0]
        assert torch.equal(pruned(x), pruned.norm(patches))
        assert torch.equal(torch.jit.script(pruned)(x), pruned(x))


def test_set_input_size_changes_only_the_nominal_size():
    torch.manual_seed(0)
    model = randomised(timm.create_model('sima_nano_12_p16', **TINY, attn_type='flatten')).eval()
    x = torch.randn(1, 3, 48, 64)
    with torch.no_grad():
        expected = model(x)
        model.set_input_size((48, 64))
        assert model.img_size == (48, 64) and model.grid_size == (3, 4)
        assert all(b.attn.grid_size == (3, 4) for b in model.blocks)
        assert torch.allclose(model(x), expected, atol=1e-6)


def test_torchscript_of_the_whole_model_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 24)
    for name, attn in (('sima_nano_12_p8', 'sima'), ('sima_tiny_12_p8', 'softmax')):
        model = randomised(timm.create_model(name, **TINY, attn_type=attn)).eval()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # torch.jit.script's deprecation notice
            scripted = torch.jit.script(model)
        with torch.no_grad():
            torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-6)


def test_fx_trace_with_timm_leaves_matches_eager_at_any_size():
    torch.manual_seed(0)
    model = randomised(timm.create_model('sima_tiny_12_p8', **TINY)).eval()
    traced = torch.fx.GraphModule(model, TimmTracer().trace(model))
    for size in ((32, 32), (40, 24)):
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ DeiT-S -> SimA

DEIT_TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)


def test_deit_small_to_sima_has_layer_scale_keys():
    model = meta_model('sima_deit_small_ls')
    plain = meta_model('sima_deit_small')
    keys, plain_keys = list(model.state_dict()), list(plain.state_dict())
    assert count(model) == count(plain) + 12 * 2 * 384
    assert [k for k in keys if '.gamma' not in k] == plain_keys
    assert keys[keys.index('blocks.3.norm1.weight') - 2:keys.index('blocks.3.norm1.weight')] == [
        'blocks.3.gamma1', 'blocks.3.gamma2']
    assert all(isinstance(b.attn.mixer, SimAMixer) for b in model.blocks)
    assert not any('gamma' in k for k in meta_model('softmax_deit_small').state_dict())
    cfg = timm.models.get_pretrained_cfg('sima_deit_small_ls').to_dict()
    assert not cfg.get('url') and cfg['origin_url'] == 'https://github.com/UCDvision/sima'


def test_deit_layer_scale_multiplies_the_branches():
    torch.manual_seed(0)
    model = timm.create_model('sima_deit_small_ls', **DEIT_TINY).double().eval()
    assert all(torch.all(b.gamma1 == 1) and torch.all(b.gamma2 == 1) for b in model.blocks)
    plain = timm.create_model('sima_deit_small', **DEIT_TINY).double().eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if '.gamma' not in k})
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        assert (model(x) - plain(x)).abs().max() < 1e-12  # γ = 1: the same as without LayerScale
        for block in model.blocks:
            block.gamma1.zero_()
            block.gamma2.zero_()
        # γ = 0: every block is the identity
        tokens = torch.cat([model.cls_token.expand(2, -1, -1), model.patch_embed(x)], 1) + model.pos_embed
        assert (model(x) - model.head(model.norm(tokens)[:, 0])).abs().max() < 1e-12
    with pytest.raises(ValueError, match='init_values'):
        timm.create_model('softmax_deit_small', init_values=-1.)
