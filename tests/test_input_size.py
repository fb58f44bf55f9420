"""Any input size: `dynamic_img_size`, `set_input_size`, and timm's spatial `forward_features` conventions."""
import copy

import pytest
import torch
import torch.nn.functional as F

import timm
from models.attention import build_attention
from models.checkpoint import filter_checkpoint, load_state_dict_checked

# Tiny models whose window and stripe layouts are the same whether built at 32 or at 40 (Swin: softmax windows of
# 2 in the first stages, global linear attentions after; CSwin: stripes, then the global last stage), so that a
# model built at 40 is the reference for a 32 model run at 40. At 40 Swin pads a 5x5 grid to 2x2 windows and an
# odd grid before a patch merging, CSwin pads a 5x5 grid to stripes of 2.
FAMILIES = {
    'deit': ('{}_deit_tiny', dict(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=5),
             (40, 48, 56)),
    'pvt': ('{}_pvt_tiny', dict(img_size=64, embed_dims=[8, 16, 16, 16], num_heads=[1, 2, 2, 2],
                                mlp_ratios=[2, 2, 2, 2], depths=[1, 1, 1, 1], num_classes=5), (96, 128, 160)),
    'pvt_v2': ('{}_pvt_v2_b0', dict(img_size=64, embed_dims=[8, 16, 16, 16], num_heads=[1, 2, 2, 2],
                                   mlp_ratios=[2, 2, 2, 2], depths=[1, 1, 1, 1], num_classes=5), (72, 96, 100)),
    'swin': ('{}_swin_tiny', dict(img_size=32, embed_dim=8, depths=[2, 2, 1, 1], num_heads=[1, 2, 2, 2],
                                  window_size=2, num_classes=5), (40, 48, 64)),
    'cswin': ('{}_cswin_tiny', dict(img_size=32, embed_dim=8, depth=[1, 2, 1, 1], num_heads=[2, 2, 2, 2],
                                    split_size=[1, 2, 1, 1], num_classes=5), (40, 48, 64)),
}
ATTENTIONS = {
    'deit': ['softmax', 'flatten', 'inline'],
    'pvt': ['softmax', 'flatten', 'inline'],
    'pvt_v2': ['softmax', 'flatten', 'inline'],
    'swin': [['softmax', 'softmax', 'flatten', 'inline'], ['multimax', 'softmax', 'inline', 'flatten']],
    'cswin': [['softmax', 'softmax', 'flatten', 'inline'], ['multimax', 'flatten', 'softmax', 'inline']],
}
CASES = [(family, attn) for family, attns in ATTENTIONS.items() for attn in attns]


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter 0.2·N(0,1), LayerNorm weights about 1: position tables and encodings far from zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1 + noise if p.ndim == 1 and 'norm' in name and name.endswith('weight') else noise)
    return model


def build(family: str, attn, img_size=None, **kwargs) -> torch.nn.Module:
    name, args, _ = FAMILIES[family]
    args = dict(args, **kwargs)
    if img_size is not None:
        args['img_size'] = img_size
    if not isinstance(attn, str):
        args['attn_type'] = attn
        attn = 'softmax'
    return timm.create_model(name.format(attn), **args).double().eval()


def images(size: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize('family, attn', CASES)
def test_dynamic_model_equals_the_fixed_one_and_a_model_built_at_the_new_size(family, attn):
    fixed = randomize(build(family, attn))
    dynamic = build(family, attn, dynamic_img_size=True)
    dynamic.load_state_dict(fixed.state_dict())
    size = FAMILIES[family][1]['img_size']
    new_size, *other_sizes = FAMILIES[family][2]
    with torch.no_grad():
        assert torch.equal(dynamic(images(size)), fixed(images(size)))
        for other in other_sizes:
            out = dynamic(images(other))
            assert out.shape == (2, 5) and torch.isfinite(out).all()

        x = images(new_size)
        expected = dynamic(x)
        resized = copy.deepcopy(fixed)
        resized.set_input_size(new_size)
        assert resized.img_size == (new_size, new_size)
        torch.testing.assert_close(resized(x), expected, rtol=0, atol=1e-12)
        built = build(family, attn, img_size=new_size)
        load_state_dict_checked(built, resized.state_dict())
        torch.testing.assert_close(built(x), expected, rtol=0, atol=1e-12)
        if family != 'pvt':  # PVT resizes bilinearly at run time, its checkpoints bicubically, as the official code
            adapted = build(family, attn, img_size=new_size)
            adapted.load_state_dict(filter_checkpoint(fixed.state_dict(), adapted))
            torch.testing.assert_close(adapted(x), expected, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match=f"input image size {size}x{size} does not match the model's img_size "
                                             f"{new_size}x{new_size}"):
            resized(images(size))


@pytest.mark.parametrize('family', list(FAMILIES))
def test_set_input_size_keeps_frozen_parameters_frozen_and_the_dtype(family):
    model = build(family, ['flatten'] * 4 if family in ('swin', 'cswin') else 'flatten')
    model.requires_grad_(False)
    model.set_input_size(FAMILIES[family][2][0])
    assert not [n for n, p in model.named_parameters() if p.requires_grad]
    assert {p.dtype for p in model.parameters()} == {torch.float64}


@pytest.mark.parametrize('family', ['deit', 'swin'])
def test_set_input_size_without_a_size_keeps_the_current_one_as_timms_does(family):
    model = randomize(build(family, 'softmax'))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_input_size()
    size = FAMILIES[family][1]['img_size']
    assert model.img_size == (size, size)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_window_attention_pads_to_whole_windows_and_masks_the_padded_grid():
    """On a 5x5 grid, shifted 3x3 windows equal the same attention on the zero-padded 6x6 map, cropped."""
    torch.manual_seed(0)
    padded = randomize(build_attention('softmax', 8, 2, (6, 6), grouping='window', window_size=3, shift_size=1))
    small = build_attention('softmax', 8, 2, (5, 5), grouping='window', window_size=3, shift_size=1)
    small.load_state_dict(padded.state_dict())
    x = torch.randn(2, 25, 8, dtype=torch.float64)
    padded, small = padded.double(), small.double()
    x_padded = F.pad(x.view(2, 5, 5, 8), (0, 0, 0, 1, 0, 1)).view(2, 36, 8)
    with torch.no_grad():
        expected = padded(x_padded, (6, 6)).view(2, 6, 6, 8)[:, :5, :5].reshape(2, 25, 8)
        torch.testing.assert_close(small(x, (5, 5)), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(padded(x, (5, 5)), expected, rtol=0, atol=1e-12)


def test_global_window_resamples_its_bias_table_bicubically():
    torch.manual_seed(0)
    window = randomize(build_attention('softmax', 8, 2, (4, 4), grouping='window', window_size=4)).double()
    assert window.window is None
    table = window.relative_position_bias_table.T.reshape(1, 2, 7, 7).float()
    resampled = F.interpolate(table, size=(11, 11), mode='bicubic', align_corners=False).reshape(2, -1).T
    sized = build_attention('softmax', 8, 2, (6, 6), grouping='window', window_size=6).double()
    sized.load_state_dict(dict(window.state_dict(), relative_position_bias_table=resampled.double()))
    x = torch.randn(2, 36, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(window(x, (6, 6)), sized(x, (6, 6)), rtol=0, atol=1e-12)


@pytest.mark.parametrize('name, feature_size', [
    ('inline_deit_tiny', None), ('flatten_pvt_tiny', 'NCHW'), ('inline_swin_tiny', 'NHWC'),
    ('flatten_cswin_tiny', 'NHWC')])
def test_released_architecture_built_at_224_runs_at_288_and_384(name, feature_size):
    torch.manual_seed(0)
    model = timm.create_model(name, dynamic_img_size=True).eval()
    for size in (288, 384):
        with torch.no_grad():
            features = model.forward_features(torch.randn(1, 3, size, size))
            logits = model.forward_head(features)
        assert logits.shape == (1, 1000) and torch.isfinite(logits).all()
        if feature_size == 'NHWC':
            assert features.shape == (1, size // 32, size // 32, model.num_features)
        elif feature_size == 'NCHW':
            assert features.shape == (1, model.num_features, size // 32, size // 32)
        else:
            assert features.shape == (1, 1 + (size // 16) ** 2, model.num_features)


# Released architectures (their own stripe, window and embedding layouts) made narrow and shallow. Swin's linear
# attentions in every stage: a softmax stage's 7x7 window is global on the last 7x7 grid, which the dynamic model
# keeps at 288, while a model built at 288 tiles the 9x9 grid with 7x7 windows, as Swin does.
RELEASED_NARROW = {
    'flatten_deit_tiny': dict(embed_dim=16, depth=1, num_heads=2),
    'inline_swin_tiny': dict(embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2], attn_type='IIII'),
    'flatten_swin_tiny': dict(embed_dim=8, depths=[2, 1, 1, 1], num_heads=[1, 2, 2, 2], attn_type='LLLL'),
    'inline_cswin_tiny': dict(embed_dim=8, depth=[1, 1, 1, 1], num_heads=[2, 2, 2, 2]),
    'flatten_cswin_tiny': dict(embed_dim=8, depth=[1, 1, 1, 1], num_heads=[2, 2, 2, 2]),
}


@pytest.mark.parametrize('name', RELEASED_NARROW)
def test_released_weights_load_at_another_img_size_as_the_dynamic_model_runs_them(name):
    """Fine-tuning at 288 from weights trained at 224: global stages stay global (CSwin's linear stages too), so
    the weights load and the model computes what the 224 model does at 288 with `dynamic_img_size`."""
    narrow = RELEASED_NARROW[name]
    weights = randomize(timm.create_model(name, **narrow)).double().state_dict()
    finetune = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(state_dict=weights),
                                 img_size=288, **narrow).double().eval()
    dynamic = timm.create_model(name, dynamic_img_size=True, **narrow).double().eval()
    dynamic.load_state_dict(weights)
    x = images(288, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(finetune(x), dynamic(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize('name', ['inline_deit_tiny', 'flatten_swin_tiny'])
def test_load_state_dict_of_another_image_size_names_the_loaders_that_resize(tmp_path, name):
    """`load_state_dict`, timm's `load_checkpoint` and create_model's `checkpoint_path` copy tensors as torch does,
    as they do for timm's own models: a checkpoint of another size fails there with torch's size mismatches, which
    said nothing of the loaders that resize it (the README said every path did)."""
    narrow = (dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2) if name == 'inline_deit_tiny'
              else dict(RELEASED_NARROW[name], img_size=64))
    weights = randomize(timm.create_model(name, **narrow)).state_dict()
    torch.save(weights, tmp_path / 'small.pth')
    resized = {'inline_deit_tiny': 'pos_embed',
               'flatten_swin_tiny': 'layers.0.blocks.0.attn.positional_encoding, '
                                    'layers.0.blocks.1.attn.positional_encoding, '
                                    'layers.1.blocks.0.attn.positional_encoding, ...'}[name]
    hint = (f"\t{resized} of another image or window size: load_state_dict copies tensors as they are; "
            f"timm.create_model(..., pretrained=True, pretrained_cfg_overlay=dict(file=...)) and "
            f"models.checkpoint.load_pretrained_into resize them to the model's grid, as set_input_size does")
    with pytest.raises(RuntimeError) as error:
        timm.create_model(name, checkpoint_path=str(tmp_path / 'small.pth'), **dict(narrow, img_size=96))
    lines = str(error.value).splitlines()
    assert lines[-1] == hint and lines[1].startswith('\tsize mismatch for ')
    wrapped = torch.nn.Sequential(timm.create_model(name, **dict(narrow, img_size=96)))  # keys under '0.'
    with pytest.raises(RuntimeError) as error:
        wrapped.load_state_dict({f'0.{key}': value for key, value in weights.items()})
    assert str(error.value).splitlines()[-1] == hint.replace('\t', '\t0.').replace(', layers', ', 0.layers')
    # resized where the README says, to the output of the model built at that size (test above)
    timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / 'small.pth')),
                      **dict(narrow, img_size=96))
    other_classes = timm.create_model(name, **dict(narrow, num_classes=7))
    with pytest.raises(RuntimeError) as error:  # a classifier of another width: nothing to say of the image size
        other_classes.load_state_dict(weights)
    assert 'image or window size' not in str(error.value) and 'size mismatch for head.weight' in str(error.value)
    flattened = {key: value.flatten() if key.endswith(('pos_embed', 'positional_encoding')) else value
                 for key, value in weights.items()}
    with pytest.raises(RuntimeError) as error:  # no grid to resize (the hint's probe raised an IndexError instead)
        other_classes.load_state_dict(flattened)
    assert 'image or window size' not in str(error.value) and 'size mismatch for ' in str(error.value)


# Every family's stem and head, as small as they build.
STEMS = {
    'inline_deit_tiny': dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2),
    'multimax_deit_tiny': dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2),
    'flatten_pvt_tiny': dict(img_size=64, embed_dims=[8, 16, 16, 16], num_heads=[1, 2, 2, 2],
                             mlp_ratios=[2, 2, 2, 2], depths=[1, 1, 1, 1]),
    'inline_pvt_v2_b0': dict(img_size=64, embed_dims=[8, 16, 16, 16], num_heads=[1, 2, 2, 2],
                             mlp_ratios=[2, 2, 2, 2], depths=[1, 1, 1, 1]),
    'inline_swin_tiny': dict(img_size=32, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2], window_size=2),
    'flatten_cswin_tiny': dict(img_size=32, embed_dim=8, depth=[1, 1, 1, 1], num_heads=[2, 2, 2, 2],
                               split_size=[1, 2, 1, 1]),
    'sima_nano_12_p16': dict(img_size=32, embed_dim=16, depth=1, num_heads=2),
}


@pytest.mark.parametrize('name', STEMS)
def test_rgb_weights_load_into_a_one_channel_model_as_timm_adapts_them(name):
    """timm's loader sums the cfg's `first_conv` over its input channels after the family's checkpoint filter,
    which must let that weight through: a grey image then gives the RGB model's output on its three copies."""
    rgb = randomize(timm.create_model(name, **STEMS[name])).eval()
    weights = rgb.state_dict()
    stem = rgb.pretrained_cfg['first_conv'] + '.weight'
    grey = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(state_dict=weights), in_chans=1,
                             **STEMS[name]).eval()
    loaded = grey.state_dict()
    assert torch.equal(loaded[stem], weights[stem].sum(dim=1, keepdim=True))
    assert [k for k in weights if not torch.equal(loaded[k], weights[k])] == [stem]
    x = images(STEMS[name]['img_size'], batch=2).float()[:, :1]
    with torch.no_grad():
        torch.testing.assert_close(grey(x), rgb(x.expand(-1, 3, -1, -1)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', STEMS)
def test_released_weights_load_into_a_model_without_classifier(name):
    """`num_classes=0`, timm's way to a feature extractor, leaves the checkpoint's classifier out: the model
    gives the pooled features of the model the weights came from, and with `global_pool=''` its whole map."""
    source = randomize(timm.create_model(name, **STEMS[name])).eval()
    overlay = dict(state_dict=source.state_dict())
    pooled = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0,
                               **STEMS[name]).eval()
    whole = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0,
                              global_pool='', **STEMS[name]).eval()
    x = images(STEMS[name]['img_size']).float()
    with torch.no_grad():
        features = source.forward_features(x)
        assert torch.equal(pooled(x), source.forward_head(features, pre_logits=True))
        assert torch.equal(whole(x), features)


HIERARCHICAL = ['softmax_swin_tiny', 'flatten_swin_base_384', 'inline_cswin_tiny', 'inline_pvt_tiny',
                'flatten_pvt_small']


@pytest.mark.parametrize('name', HIERARCHICAL)
def test_hierarchical_models_keep_timm_default_cfg_contract(name):
    """timm's checks of standard models (as for its Swin and PVT v2), at the cfg's input size on the meta device."""
    model = timm.create_model(name, device='meta').eval()
    cfg = model.pretrained_cfg
    pool_size = cfg['pool_size']
    spatial, channel = {'NHWC': ((1, 2), 3), 'NCHW': ((2, 3), 1)}[model.output_fmt]
    x = torch.empty(2, *cfg['input_size'], device='meta')
    features = model.forward_features(x)
    assert [features.shape[i] for i in spatial] == list(pool_size) and features.shape[channel] == model.num_features
    pre_logits = model.forward_head(features, pre_logits=True)
    assert pre_logits.shape == (2, model.head_hidden_size)
    assert model.feature_info[-1]['num_chs'] == model.num_features
    assert model.feature_info[-1]['reduction'] * pool_size[0] == cfg['input_size'][1]
    model.reset_classifier(0)
    assert model(x).shape == pre_logits.shape
    model.reset_classifier(0, '')
    assert model(x).shape == features.shape
    bare = timm.create_model(name, device='meta', num_classes=0, global_pool='')
    assert bare(x).shape == features.shape


def test_class_token_models_keep_tokens_like_timm_deit():
    for name in ('softmax_pvt_tiny', 'softmax_deit_tiny'):
        model = timm.create_model(name, device='meta')
        assert model.pretrained_cfg['pool_size'] is None and not hasattr(model, 'output_fmt')
        features = model.forward_features(torch.empty(1, 3, 224, 224, device='meta'))
        assert features.shape == (1, 1 + (7 if 'pvt' in name else 14) ** 2, model.num_features)


def test_sizes_that_cannot_work_are_one_line_errors():
    swin = build('swin', 'softmax', dynamic_img_size=True)
    with pytest.raises(ValueError, match='^input image size 42x36 must have sides that are positive multiples of 4$'):
        swin(torch.randn(1, 3, 42, 36, dtype=torch.float64))
    pvt = build('pvt', 'inline')
    with pytest.raises(ValueError, match='^img_size 80x80 must have sides that are positive multiples of 32$'):
        pvt.set_input_size(80)
    assert pvt.img_size == (64, 64)


@pytest.mark.parametrize('name, kwargs, small, least', [
    ('softmax_pvt_v2_b0', {}, 28, 29),                       # stage 0's 8-wide key reduction, a ceil(side / 4) grid
    ('softmax_pvt_tiny', dict(sr_ratios=[16, 4, 2, 1]), 32, 64),  # a 16-wide one on a side / 4 grid, multiples of 32
])
def test_a_size_too_small_for_the_key_reduction_is_one_line(name, kwargs, small, least):
    """PVT's stages take keys from a strided convolution as wide as the stage's reduction: a smaller grid failed
    in that convolution ("Kernel size can't be greater than actual input size"), at the first forward; now the
    build, `set_input_size` and a dynamic model's input say so. Attentions without reduced keys take any size."""
    message = f"{small}x{small} must have sides of at least {least}, the smallest the model's stages take$"
    with pytest.raises(ValueError, match=f'^img_size {message}'):
        timm.create_model(name, img_size=small, **kwargs)
    model = timm.create_model(name, img_size=least, dynamic_img_size=True, num_classes=3, **kwargs).eval()
    assert model(torch.randn(1, 3, least, least)).shape == (1, 3)
    with pytest.raises(ValueError, match=f'^img_size {message}'):
        model.set_input_size(small)
    with pytest.raises(ValueError, match=f'^input image size {message}'):
        model(torch.randn(1, 3, small, small))
    linear = timm.create_model(name, attn_type='linear', img_size=small, num_classes=3, **kwargs).eval()
    assert linear(torch.randn(1, 3, small, small)).shape == (1, 3)
