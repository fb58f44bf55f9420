"""The seams between attentions, groupings and families: one registry, method options through `attn_kwargs`,
unchanged state dicts, pretrained cfgs that belong to their architecture, and softmax weights as a start."""
import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Optional

import pytest
import safetensors.torch
import timm
import timm.models._hub
import torch
from torch import nn
from timm.models._registry import _model_pretrained_cfgs

import models  # noqa: F401  (registers the families)
from models.analysis import attention_layers
from models.attention import GROUPINGS, build_attention, forms_score_matrix, list_attentions
from models.checkpoint import CheckpointError, hub_weights_file, load_checkpoint_file, load_pretrained_into

FINGERPRINTS = json.loads((Path(__file__).parent / 'data' / 'state_dict_fingerprints.json').read_text())
FAMILIES = ('deit', 'pvt', 'swin', 'cswin')
TINY = {
    'deit': dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5),
    'pvt': dict(img_size=64, embed_dims=[16, 32, 32, 32], num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2],
                depths=[1, 1, 1, 1], num_classes=5),
    'swin': dict(img_size=32, embed_dim=16, depths=[2, 1, 1, 1], num_heads=[1, 2, 2, 2], window_size=4,
                 num_classes=5),
    'cswin': dict(img_size=64, embed_dim=16, depth=[1, 1, 1, 1], num_heads=[2, 2, 2, 2], split_size=[2, 2, 2, 2],
                  num_classes=5),
}


def fingerprint(name: str) -> dict:
    with torch.device('meta'):
        model = timm.create_model(name)
    state = model.state_dict()
    text = '\n'.join(f"{k} {tuple(v.shape)}" for k, v in state.items())
    return dict(keys=len(state), params=sum(p.numel() for p in model.parameters()),
                sha256=hashlib.sha256(text.encode()).hexdigest())


@pytest.mark.parametrize('name', sorted(FINGERPRINTS))
def test_state_dict_keys_order_and_shapes_are_those_of_the_first_release(name):
    """Names, order and shapes of every state-dict entry and the parameter count, as recorded before the
    attentions were split into groupings and mixers."""
    assert fingerprint(name) == FINGERPRINTS[name]


def test_every_attention_is_registered_on_every_family_size():
    sizes = [name[len('softmax_'):] for name in timm.list_models('softmax_*')]
    assert len(sizes) == 26
    for attention in list_attentions():
        missing = [size for size in sizes if not timm.is_model(f'{attention}_{size}')]
        assert not missing, f"{attention}: {missing}"


@pytest.mark.parametrize('family', FAMILIES)
def test_method_options_reach_the_mixer_through_attn_kwargs_and_official_keywords(family):
    by_dict = timm.create_model(f'flatten_{family}_tiny', attn_kwargs=dict(focusing_factor=2, kernel_size=3),
                                **TINY[family])
    by_keyword = timm.create_model(f'softmax_{family}_tiny', attn_type='flatten', focusing_factor=2, kernel_size=3,
                                   **TINY[family])
    for model in (by_dict, by_keyword):
        mixers = [m for m in model.modules() if type(m).__name__ == 'FocusedLinearMixer']
        assert mixers and all(m.focusing_factor == 2 and m.dwc.kernel_size == (3, 3) for m in mixers)
        assert model(torch.randn(1, 3, TINY[family]['img_size'], TINY[family]['img_size'])).shape == (1, 5)


@pytest.mark.parametrize('family', FAMILIES)
def test_an_option_no_attention_of_the_model_takes_is_one_line(family):
    with pytest.raises(ValueError, match=r"attn_kwargs 'focusing_factor' is not an option of the model's attention "
                                         r"\(softmax\); expected one of: causal$"):
        timm.create_model(f'softmax_{family}_tiny', attn_kwargs=dict(focusing_factor=2), **TINY[family])
    with pytest.raises(ValueError, match="'kernel_size' is given both as a keyword and in attn_kwargs"):
        timm.create_model(f'flatten_{family}_tiny', kernel_size=3, attn_kwargs=dict(kernel_size=5), **TINY[family])


@pytest.mark.parametrize('name, kwargs, message', [
    ('inline_deit_tiny', dict(embed_dim=-8), "embed_dim -8 is out of range; expected an integer > 0"),
    ('inline_deit_tiny', dict(num_heads=0), "num_heads 0 is out of range; expected an integer > 0"),
    ('inline_deit_tiny', dict(depth=-1), "depth -1 is out of range; expected an integer >= 0"),
    ('inline_deit_tiny', dict(mlp_ratio=-1.0), "mlp_ratio -1.0 is out of range; expected a number > 0"),
    ('inline_deit_tiny', dict(patch_size=0), "patch_size 0 is out of range; expected an integer > 0"),
    ('inline_deit_tiny', dict(drop_path_rate=1.5), "drop_path_rate 1.5 is out of range; expected a number in [0, 1]"),
    ('inline_pvt_tiny', dict(embed_dims=[64, -1, 320, 512]),
     "embed_dims [64, -1, 320, 512] is out of range; expected an integer > 0 each"),
    ('inline_swin_tiny', dict(depths=[2, 2, -6, 2]), "depths [2, 2, -6, 2] is out of range; expected an integer >= 0 "
                                                     "each"),
    ('inline_cswin_tiny', dict(embed_dim=0.5), "embed_dim 0.5 is out of range; expected an integer > 0"),
    # one value where the constructors take one, a list where they take one per stage, an (H, W) pair for img_size
    ('inline_deit_tiny', dict(img_size=(224,)),
     "img_size (224,) is not an (H, W) pair; expected an integer > 0 or a pair of them"),
    ('inline_deit_tiny', dict(patch_size=(16, 16)), "patch_size (16, 16) is not one value; expected an integer > 0"),
    ('inline_swin_tiny', dict(window_size=(7, 7)), "window_size (7, 7) is not one value; expected an integer > 0"),
    ('inline_swin_tiny', dict(embed_dim=[96, 192, 384, 768]),
     "embed_dim [96, 192, 384, 768] is not one value; expected an integer > 0"),
    ('inline_swin_tiny', dict(num_heads=3), "num_heads 3 is not a list; expected an integer > 0 per stage, as a list"),
    ('inline_pvt_tiny', dict(mlp_ratios=8), "mlp_ratios 8 is not a list; expected a number > 0 per stage, as a list"),
    ('softmax_pvt_v2_b0', dict(depths=2), "depths 2 is not a list; expected an integer >= 0 per stage, as a list"),
    ('softmax_pvt_v2_b0', dict(drop_rate=2.0), "drop_rate 2.0 is out of range; expected a number in [0, 1]"),
    ('inline_swin_tiny', dict(proj_drop_rate=1.5), "proj_drop_rate 1.5 is out of range; expected a number in [0, 1]"),
    ('sima_nano_12_p16', dict(pos_drop_rate='0.1'),
     "pos_drop_rate '0.1' is out of range; expected a number in [0, 1]"),
    ('inline_cswin_tiny', dict(depth=2), "depth 2 is not a list; expected an integer >= 0 per stage, as a list"),
    # depths are read for the blocks' attentions before the constructor runs: the same messages from there
    ('inline_deit_tiny', dict(depth=2.5), "depth 2.5 is out of range; expected an integer >= 0"),
    ('sima_small_12_p16', dict(depth=2.0), "depth 2.0 is out of range; expected an integer >= 0"),
    ('softmax_swin_tiny', dict(depths=(2, 2, 2.0, 2)),
     "depths (2, 2, 2.0, 2) is out of range; expected an integer >= 0 each"),
    ('softmax_swin_tiny', dict(depths=2), "depths 2 is not a list; expected an integer >= 0 per stage, as a list"),
    # a string that reads as a bool (--opts MODEL.KWARGS.qkv_bias maybe) was taken as True
    ('inline_deit_tiny', dict(qkv_bias='maybe'), "qkv_bias 'maybe' is not a bool; expected True or False"),
    ('softmax_swin_tiny', dict(dynamic_img_size='yes'), "dynamic_img_size 'yes' is not a bool; expected True or False"),
    ('softmax_pvt_v2_b0', dict(linear=1), "linear 1 is not a bool; expected True or False"),
    ('inline_pvt_tiny', dict(class_token='False'), "class_token 'False' is not a bool; expected True or False"),
    ('softmax_cswin_tiny', dict(qkv_bias='true'), "qkv_bias 'true' is not a bool; expected True or False"),
    ('multimax_deit_small', dict(multimax_logits='1'), "multimax_logits '1' is not a bool; expected True or False"),
    ('sima_small_12_p16', dict(tokens_norm='no'), "tokens_norm 'no' is not a bool; expected True or False"),
    ('inline_cswin_tiny', dict(depth=(1, 1, 1.5, 1)), "depth (1, 1, 1.5, 1) is out of range; expected an integer >= 0 "
                                                       "each"),
    ('inline_cswin_tiny', dict(split_size=7), "split_size 7 must give 4 positive stripe widths, e.g. '56-28-14-7'"),
    ('softmax_deit_tiny', dict(attn_type=3),
     "bad attn_type 3 (neither a name, a list nor a pattern); expected an attention name (softmax, multimax, inline, "
     "flatten, sima, additive, linear), a list of 1 name, or a pattern of 1 letter from I (inline), L (flatten), "
     "S (softmax), M (mixed) with the number of linear blocks of the M stage appended, e.g. 'IIMS2'"),
    ('flatten_deit_tiny', dict(attn_kwargs='focusing_factor=3'),
     "attn_kwargs 'focusing_factor=3' is not a dict; expected a dict of method options, e.g. dict(focusing_factor=3)"),
    # an M stage of 6 blocks took 'IIMS99' as all InLine: a typo for 'IIMS2' trained another model
    ('inline_swin_tiny', dict(attn_type='IIMS7'),
     "bad attn_type 'IIMS7' (7 linear blocks in an M stage of 6 blocks); expected an attention name (softmax, "
     "multimax, inline, flatten, sima, additive, linear), a list of 4 names, or a pattern of 4 letters from I "
     "(inline), L (flatten), S (softmax), M (mixed) with the number of linear blocks of the M stage appended, "
     "e.g. 'IIMS2'"),
])
def test_an_argument_out_of_range_is_named_before_any_layer_is_built(name, kwargs, message):
    """A ValueError naming the argument and what it takes, never Python's own error from deep in the constructor
    ("object of type 'int' has no len()", "tuple index out of range")."""
    with pytest.raises(ValueError) as error:
        timm.create_model(name, **kwargs)
    assert str(error.value) == message


@pytest.mark.parametrize('name, keyword, message', [
    ('softmax_cswin_tiny', 'depths', "CSWinTransformer.__init__() got an unexpected keyword argument 'depths'; "
                                     "softmax_cswin_tiny takes 'depth' (now (1, 2, 21, 1))"),
    ('softmax_swin_tiny', 'depth', "SwinTransformer.__init__() got an unexpected keyword argument 'depth'; "
                                   "softmax_swin_tiny takes 'depths' (now (2, 2, 6, 2))"),
    ('softmax_deit_tiny', 'depths', "DeiT.__init__() got an unexpected keyword argument 'depths'; softmax_deit_tiny "
                                    "takes 'depth' (now 12)"),
])
def test_the_other_family_s_depth_keyword_is_named_as_unexpected(name, keyword, message):
    """CSwin's depths=(1, 1, 1, 1) was checked as CSwin's own one-value `depth`: 'is not one value', and the advice
    taken, depths=1, then failed as an unexpected keyword."""
    with pytest.raises(TypeError) as error:
        timm.create_model(name, **{keyword: (1, 1, 1, 1)})
    assert str(error.value) == message


@pytest.mark.parametrize('family', [*FAMILIES, 'sima_xcit'])
def test_feature_indices_and_classes_out_of_range_are_value_errors_naming_the_value(family):
    """timm's index helper asserted, naming -9 as the converted -5; reset_classifier(-1) made an Identity head
    with num_classes -1, and 2.5 or '5' failed inside torch."""
    name = 'sima_nano_12_p16' if family == 'sima_xcit' else f'softmax_{family}_tiny'
    kwargs = TINY.get(family, {})
    model = timm.create_model(name, **kwargs)
    levels = model.num_stages
    x = torch.randn(1, 3, *model.img_size)
    with pytest.raises(ValueError) as error:
        model.forward_intermediates(x, indices=[-levels - 5])
    assert str(error.value) == (f"feature index {-levels - 5} is out of range; expected an int from {-levels} to "
                                f"{levels - 1}, of the model's {levels} feature levels")
    with pytest.raises(ValueError, match=rf"^feature indices {levels + 1} \(the last {levels + 1}\) is out of range; "
                                         rf"expected 1 to {levels}, the model's feature levels$"):
        timm.create_model(name, features_only=True, out_indices=levels + 1, **kwargs)
    with pytest.raises(ValueError, match=r"^feature indices '1' is neither a count nor a list of indices"):
        model.forward_intermediates(x, indices='1')
    for bad in (-1, 2.5, '5'):
        with pytest.raises(ValueError) as error:
            model.reset_classifier(bad)
        assert str(error.value) == f"num_classes {bad!r} is out of range; expected an integer >= 0"
    assert model.num_classes == kwargs.get('num_classes', 1000)


def test_images_with_the_wrong_channel_count_are_named_with_a_hint_for_channels_last():
    """A (B, H, W, C) batch was read as 32 channels of 32x3 images: 'build the model with img_size=(32, 3)'."""
    model = timm.create_model('softmax_deit_tiny', **TINY['deit'])
    with pytest.raises(ValueError) as error:
        model(torch.randn(2, 32, 32, 3))
    assert str(error.value) == ("input of shape [2, 32, 32, 3] has dimension 1 (channels) 32, but the model takes 3 "
                                "channels; expected images (B, 3, H, W); channels-last images (B, H, W, C) go in as "
                                "x.permute(0, 3, 1, 2)")
    grey = timm.create_model('softmax_swin_tiny', in_chans=1, **TINY['swin'])
    with pytest.raises(ValueError, match=r"^input of shape \[1, 3, 32, 32\] has dimension 1 \(channels\) 3, but the "
                                         r"model takes 1 channels; expected images \(B, 1, H, W\)$"):
        grey(torch.randn(1, 3, 32, 32))
    scripted = torch.jit.script(model)
    with pytest.raises(torch.jit.Error, match='has dimension 1 \\(channels\\) 32'):
        scripted(torch.randn(2, 32, 32, 3))


def test_mixed_attentions_share_one_attn_kwargs():
    model = timm.create_model('inline_swin_tiny', attn_type='LLSS', mixed_linear='flatten',
                              attn_kwargs=dict(focusing_factor=2), **TINY['swin'])
    names = [block.attn.attention_name for stage in model.layers for block in stage.blocks]
    assert names == ['flatten', 'flatten', 'flatten', 'softmax', 'softmax']
    assert [block.attn.mixer.focusing_factor for block in model.layers[0].blocks] == [2, 2]


def test_flags_say_what_they_mean():
    for name in list_attentions():
        mixer = build_attention(name, 16, 2, (4, 4)).mixer
        assert mixer.forms_scores == forms_score_matrix(name)
        assert mixer.accepts_score_bias == (name in ('softmax', 'multimax'))
        assert mixer.needs_tokens == (name == 'inline')
    assert list(GROUPINGS) == ['global', 'reduction', 'window', 'stripes']


@pytest.mark.parametrize('name, tiny', [
    ('flatten_pvt_tiny', TINY['pvt']),
    ('softmax_pvt_v2_b0', dict(TINY['pvt'], mlp_ratios=[8, 8, 4, 4])),
])
def test_an_unpooled_map_takes_no_classifier(name, tiny):
    """timm's heads refuse pooling '' before a classifier; so does a (B, C, H, W) map here, on one line, when both
    are asked for. A classifier alone on an unpooled model pools again (timm's own model tests reset the classifier
    of a `global_pool=''` model to 0, then 2 classes, and expect a classifier)."""
    message = (r"^global_pool '' keeps the \(B, C, H, W\) map, which a classifier of num_classes 5 cannot take; "
               r"expected num_classes=0 with it, or global_pool 'avg'$")
    with pytest.raises(ValueError, match=message):
        timm.create_model(name, **dict(tiny, num_classes=5, global_pool=''))
    model = timm.create_model(name, **dict(tiny, num_classes=0, global_pool='')).eval()
    x = torch.randn(2, 3, *model.img_size)
    assert model(x).ndim == 4
    with pytest.raises(ValueError, match=message):
        model.reset_classifier(5, '')
    assert model.global_pool == '' and model.num_classes == 0
    model.reset_classifier(0)
    model.reset_classifier(5)
    assert model.global_pool == 'avg' and model.num_classes == 5 and model(x).shape == (2, 5)
    model.reset_classifier(0, '')
    assert model.global_pool == '' and model(x).ndim == 4


POOLED = [
    ('flatten_deit_tiny', TINY['deit']),
    ('inline_pvt_tiny', TINY['pvt']),
    ('softmax_pvt_v2_b0', dict(TINY['pvt'], mlp_ratios=[8, 8, 4, 4])),
    ('inline_swin_tiny', TINY['swin']),
    ('flatten_cswin_tiny', TINY['cswin']),
    ('sima_nano_12_p16', dict(img_size=32, embed_dim=16, depth=1, num_heads=2, num_classes=5)),
]


@pytest.mark.parametrize('name, tiny', POOLED)
def test_timm_poolings_of_the_grid_tokens(name, tiny):
    """`global_pool` 'max' and 'avgmax' as timm's models take them (the maximum, or the average of the maximum and
    the mean, of the last stage's grid tokens, prefix tokens left out), from the constructor and from
    `reset_classifier`; a pooling timm's heads have but these models lack is named on one line."""
    model = timm.create_model(name, **tiny).eval()
    x = torch.randn(2, 3, *model.img_size)
    with torch.no_grad():
        features = model.forward_features(x)
    if model.features_fmt == 'NLC':
        tokens = features[:, model.num_prefix_tokens:]
    else:
        tokens = features.flatten(1, 2) if model.features_fmt == 'NHWC' else features.flatten(2).transpose(1, 2)
    expected = dict(max=tokens.amax(1), avgmax=0.5 * (tokens.amax(1) + tokens.mean(1)))
    weights, head = model.state_dict(), model.get_classifier()
    for pool, pooled in expected.items():
        built = timm.create_model(name, **dict(tiny, global_pool=pool)).eval()
        built.load_state_dict(weights)
        with torch.no_grad():
            torch.testing.assert_close(built.forward_head(features, pre_logits=True), pooled)
            torch.testing.assert_close(built(x), head(pooled))
        model.reset_classifier(3, pool)
        assert model.global_pool == pool and model(x).shape == (2, 3)
        with torch.no_grad():
            torch.testing.assert_close(model.forward_head(features, pre_logits=True), pooled)
    with pytest.raises(ValueError, match=r"^global_pool 'catavgmax' is not supported; expected one of .*'avgmax'"):
        model.reset_classifier(3, 'catavgmax')


@pytest.mark.parametrize('name', ['softmax_deit_small', 'softmax_swin_tiny', 'inline_pvt_tiny'])
def test_another_attention_does_not_inherit_the_weights_url(name):
    with torch.device('meta'):
        native = timm.create_model(name)
        other = timm.create_model(name, attn_type='sima')
    assert native.pretrained_cfg['url'].startswith('https://')
    assert other.pretrained_cfg['url'] == '' and other.pretrained_cfg['input_size'] == native.pretrained_cfg[
        'input_size']
    with pytest.raises(ValueError, match=rf"{name}'s pretrained weights belong to attn_type .* not 'sima'; build it "
                                         rf"with pretrained=False and start from them with "
                                         rf"models.checkpoint.load_pretrained_into\(model, '{name}'\), or load the "
                                         rf"tensors they share with pretrained_strict=False"):
        timm.create_model(name, attn_type='sima', pretrained=True)


def test_an_equivalent_attn_type_keeps_the_pretrained_cfg():
    with torch.device('meta'):
        model = timm.create_model('inline_swin_tiny', attn_type=['inline', 'inline', 'inline', 'softmax'])
    assert model.pretrained_cfg['url'] == timm.models.get_pretrained_cfg('inline_swin_tiny').url


@pytest.mark.parametrize('name, pattern, stages', [
    ('inline_swin_tiny', 'IIIS', dict(depths=[2, 2], num_heads=[2, 4])),
    ('flatten_swin_tiny', 'LLSS', dict(depths=[2, 2], num_heads=[2, 4])),
])
def test_a_paper_model_with_other_stages_takes_the_attn_type_given_for_them(name, pattern, stages):
    """The variant's per-stage pattern was applied to the user's stages to compare it with theirs, and failed on
    an attn_type the user never gave: "bad attn_type 'IIIS'" for attn_type='inline' with two stages."""
    with torch.device('meta'):
        model = timm.create_model(name, attn_type='inline', **stages)
        mixed = timm.create_model(name, attn_type='IS', **stages)
    assert {a.mixer.attention_name for a in attention_layers(model).values()} == {'inline'}
    assert [a.mixer.attention_name for a in attention_layers(mixed).values()] == ['inline'] * stages['depths'][0] + [
        'softmax'] * stages['depths'][1]
    assert model.pretrained_cfg['url'] == '' and mixed.pretrained_cfg['url'] == ''
    with pytest.raises(ValueError, match=rf"^{name}'s attn_type '{pattern}' names the attention of each of its own "
                                         rf"stages, not of depths \[.*\]; expected an attn_type for those stages too$"):
        timm.create_model(name, device='meta', **stages)


@pytest.mark.parametrize('given_as', ['file', 'state_dict'])
def test_own_weights_of_another_attention_load_through_the_overlay(tmp_path, given_as):
    torch.manual_seed(0)
    source = timm.create_model('softmax_deit_tiny', attn_type='sima', **TINY['deit'])
    torch.save(source.state_dict(), tmp_path / 'sima.pth')
    overlay = dict(file=str(tmp_path / 'sima.pth')) if given_as == 'file' else dict(state_dict=source.state_dict())
    model = timm.create_model('softmax_deit_tiny', attn_type='sima', pretrained=True, pretrained_cfg_overlay=overlay,
                              **TINY['deit'])
    # timm gives a classifier of another class count than the pretrained cfg's a fresh init
    expected = source.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items() if not k.startswith('head.'))


@pytest.mark.parametrize('family', ['deit', 'pvt', 'swin'])
@pytest.mark.parametrize('release', [False, True])
def test_pretrained_strict_false_loads_the_tensors_softmax_weights_share_with_another_attention(
        tmp_path, monkeypatch, caplog, family, release):
    """timm's `pretrained_strict=False`: softmax weights (one's own file, or the variant's release) start InLine
    with the tensors `load_pretrained_into` loads, the others keep their initialisation, and timm logs them; a model
    of another attention does not keep the release as its weights source. Strict, the weights are refused."""
    name = f'softmax_{family}_tiny'
    torch.manual_seed(0)
    softmax = timm.create_model(name, **TINY[family]).state_dict()
    torch.save(softmax, tmp_path / 'softmax.pth')
    if release:  # the registered cfg's weights, as a release given by file
        cfg = dataclasses.replace(_model_pretrained_cfgs[name], url='', file=str(tmp_path / 'softmax.pth'))
        monkeypatch.setitem(_model_pretrained_cfgs, name, cfg)
        monkeypatch.setitem(_model_pretrained_cfgs, f'{name}.{cfg.tag}', cfg)
    overlay = {} if release else dict(pretrained_cfg_overlay=dict(file=str(tmp_path / 'softmax.pth')))
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger='timm.models._builder'):
        model = timm.create_model(name, attn_type='inline', pretrained=True, pretrained_strict=False, **overlay,
                                  **TINY[family])
    torch.manual_seed(1)
    fresh = timm.create_model(name, attn_type='inline', **TINY[family])
    report = load_pretrained_into(fresh, str(tmp_path / 'softmax.pth'))
    assert any('residual' in k for k in report.new)
    expected = fresh.state_dict()
    # timm gives a classifier of another class count than the pretrained cfg's a fresh init
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items() if not k.startswith('head.'))
    assert any(record.message.startswith('Missing keys (') for record in caplog.records)
    assert model.pretrained_cfg['file'] == (None if release else str(tmp_path / 'softmax.pth'))
    if not release:  # strict, a release of another attention is refused before it is read (above)
        # a RuntimeError, as torch's strict load raises, for code written against timm; a ValueError, as bad input
        with pytest.raises(RuntimeError, match=r"^checkpoint does not match \w+: missing: ") as error:
            timm.create_model(name, attn_type='inline', pretrained=True, **overlay, **TINY[family])
        assert isinstance(error.value, CheckpointError) and isinstance(error.value, ValueError)


class _Wrapper(nn.Module):
    """A model held as `module`, as DistributedDataParallel holds it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize('wrapped', [False, True], ids=['model', 'wrapped'])
@pytest.mark.parametrize('family', ['deit', 'pvt', 'swin', 'cswin', 'pvt_v2'])
def test_load_state_dict_reports_keys_under_the_names_of_the_state_dicts(family, wrapped):
    """Torch meets tensors at their module paths (`stages.0.blocks.0.attn.mixer.residual…`); the model reports, and
    strict refuses, missing keys under the keys its `state_dict` gives (`block1.0.attn.residual…`) and unexpected
    keys under those of the state dict it was given: softmax weights into InLine, InLine weights into softmax; the
    same for the model held by a wrapper (`module.block1.0.attn.residual…`), as under DistributedDataParallel."""
    name = {'pvt_v2': 'softmax_pvt_v2_b0'}.get(family, f'softmax_{family}_tiny')
    tiny = TINY.get(family, dict(img_size=64, embed_dims=[16, 32, 32, 32], num_heads=[1, 2, 2, 2],
                                 mlp_ratios=[2, 2, 2, 2], depths=[1, 1, 1, 1]))
    wrap = _Wrapper if wrapped else (lambda model: model)
    softmax = wrap(timm.create_model(name, **tiny))
    inline = wrap(timm.create_model(name, attn_type='inline', **tiny))
    for model, other in ((inline, softmax), (softmax, inline)):
        own = model.state_dict()
        given = {k: v for k, v in other.state_dict().items() if k not in own or v.shape == own[k].shape}
        result = model.load_state_dict(given, strict=False)
        assert result.missing_keys == [k for k in own if k not in given]
        assert result.unexpected_keys == [k for k in given if k not in own]
        new_keys = result.missing_keys if model is inline else result.unexpected_keys
        assert any('.residual.' in k for k in new_keys)
    unexpected = result.unexpected_keys[0]
    with pytest.raises(RuntimeError, match=re.escape(f'Unexpected key(s) in state_dict: "{unexpected}"')):
        softmax.load_state_dict(given)


@pytest.mark.parametrize('wrapped', [False, True], ids=['model', 'wrapped'])
@pytest.mark.parametrize('name, family, other_size', [('inline_pvt_tiny', 'pvt', dict(img_size=128)),
                                                      ('flatten_cswin_tiny', 'cswin', dict(img_size=128))])
def test_load_state_dict_names_tensors_of_another_size_by_their_keys(name, family, other_size, wrapped):
    """The weights of another input size: torch's "size mismatch for …" names each tensor by the key `state_dict`
    gives it (`pos_embed1`, `stage1.0.attns.0.positional_encoding`), not by its module path."""
    wrap = _Wrapper if wrapped else (lambda model: model)
    model = wrap(timm.create_model(name, **TINY[family]))
    other = wrap(timm.create_model(name, **dict(TINY[family], **other_size)))
    with pytest.raises(RuntimeError) as refused:
        model.load_state_dict(other.state_dict(), strict=False)
    named = re.findall(r'size mismatch for (\S+):', str(refused.value))
    own = model.state_dict()
    assert named and all(key in own and own[key].shape != other.state_dict()[key].shape for key in named), named
    assert 'module.' * wrapped + ('pos_embed1' if family == 'pvt' else 'stage1.0.attns.0.positional_encoding') in named


def test_pretrained_strict_false_still_refuses_tensors_of_another_shape(tmp_path):
    """Softmax CSwin's LePE convolutions have another shape than InLine CSwin's: refused, as timm's loader refuses
    them (`load_pretrained_into` drops them and says so)."""
    torch.save(timm.create_model('softmax_cswin_tiny', **TINY['cswin']).state_dict(), tmp_path / 'softmax.pth')
    with pytest.raises(CheckpointError, match=r"^checkpoint does not match CSWinTransformer: mis-shaped: "
                                              r"stage1\.0\.attns\.0\.get_v\.weight \(8, 1, 3, 3\) vs \(16, 1, 3, 3\)"):
        timm.create_model('softmax_cswin_tiny', attn_type='inline', pretrained=True, pretrained_strict=False,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / 'softmax.pth')), **TINY['cswin'])


HUB_NAMES = {'deit': 'softmax_deit_tiny', 'pvt': 'inline_pvt_tiny', 'swin': 'flatten_swin_tiny',
             'cswin': 'multimax_cswin_tiny'}


def saved_for_the_hub(family: str, attn_type: Optional[str], folder: Path, **save) -> torch.nn.Module:
    """A tiny model of `family` built with `attn_type` (None: the variant's own), written by timm's `save_for_hf`
    into `folder` (`save`: its keywords)."""
    torch.manual_seed(0)
    kwargs = {} if attn_type is None else dict(attn_type=attn_type)
    model = timm.create_model(HUB_NAMES[family], **kwargs, **TINY[family]).eval()
    timm.models.save_for_hf(model, str(folder), **save)
    return model


def assert_same_model(loaded: torch.nn.Module, saved: torch.nn.Module, family: str) -> None:
    assert loaded.state_dict().keys() == saved.state_dict().keys()
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in loaded.state_dict().items())
    x = torch.randn(2, 3, TINY[family]['img_size'], TINY[family]['img_size'])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), saved(x))


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('attn_type', [None, 'sima'])
def test_a_model_saved_for_the_hub_loads_back_from_its_folder(tmp_path, family, attn_type):
    """timm's `save_for_hf`, then `create_model('local-dir:<folder>', pretrained=True)`: the model arguments in
    config.json rebuild the model, another attention than the variant's included, and its own weights load."""
    saved = saved_for_the_hub(family, attn_type, tmp_path)
    loaded = timm.create_model(f'local-dir:{tmp_path}', pretrained=True)
    assert_same_model(loaded, saved, family)


@pytest.mark.parametrize('family, size, overrides', [
    ('swin', 96, {}), ('swin', 48, {}),
    ('cswin', 128, dict(split_size=[2, 8, 2, 2])), ('cswin', 32, dict(split_size=[2, 8, 2, 2])),
])
def test_a_model_resized_by_set_input_size_comes_back_from_its_folder_with_the_same_groups(tmp_path, family, size,
                                                                                            overrides):
    """`set_input_size` keeps each stage's windows or stripes. Swin at 64: the last stage, global on its 2×2 grid,
    stays global at 96 (3×3, its bias table resampled), and stage 2, in 2×2 windows, keeps them at 48. CSwin at 64:
    stage 1, one global branch on its 8×8 grid under 8-wide stripes, stays global at 128 (16×16), and stage 2, in
    2-wide stripes on 4×4, keeps them at 32 (2×2). A model built at the new size alone would decide its groups
    there, so the config records the size they were decided at."""
    torch.manual_seed(0)
    model = timm.create_model(f'softmax_{family}_tiny', **{**TINY[family], **overrides}).eval()
    model.set_input_size(size)
    timm.models.save_for_hf(model, str(tmp_path))
    loaded = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert repr(loaded) == repr(model)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    built_there = timm.create_model(f'softmax_{family}_tiny', **{**TINY[family], **overrides, 'img_size': size})
    assert repr(built_there) != repr(model)  # the size alone decides otherwise


def test_a_model_of_another_attention_loads_from_the_hub(tmp_path, monkeypatch):
    """`create_model('hf-hub:<repo>', pretrained=True)` of a model saved with another attention than its
    variant's: the hub's files (served here from a folder) rebuild it and load its weights."""
    saved = saved_for_the_hub('swin', 'inline', tmp_path, safe_serialization=True)
    fetched = []

    def hub_download(repo_id, filename, **kwargs):
        fetched.append((repo_id, filename))
        return str(tmp_path / filename)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', hub_download)
    loaded = timm.create_model('hf-hub:lab/inline-swin-tiny-test', pretrained=True)
    assert_same_model(loaded, saved, 'swin')
    assert ('lab/inline-swin-tiny-test', 'model.safetensors') in fetched


@pytest.mark.parametrize('attention, new', [
    ('multimax', {'ranges', 'ts'}),
    ('inline', {'residual.0.weight', 'residual.0.bias', 'residual.2.weight', 'residual.2.bias'}),
    ('sima', set()),
])
def test_softmax_weights_start_another_attention_and_the_new_keys_are_reported(tmp_path, attention, new):
    torch.manual_seed(0)
    softmax = timm.create_model('softmax_deit_tiny', **TINY['deit'])
    torch.save({'model': softmax.state_dict()}, tmp_path / 'softmax.pth')
    model = timm.create_model('softmax_deit_tiny', attn_type=attention, **TINY['deit'])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = load_pretrained_into(model, str(tmp_path / 'softmax.pth'))
    expected_new = sorted(f'blocks.{i}.attn.{key}' for i in range(2) for key in new)
    assert sorted(report.new) == expected_new and report.dropped == []
    state = model.state_dict()
    assert all(torch.equal(state[k], softmax.state_dict()[k]) for k in report.loaded)
    assert all(torch.equal(state[k], before[k]) for k in report.new)
    assert str(report).startswith(f"loaded {len(report.loaded)} tensors; new (initialised, not loaded): "
                                  f"{', '.join(report.new[:8]) or 'none'}")


def test_a_start_at_another_resolution_adapts_the_grid_sized_tensors(tmp_path):
    torch.manual_seed(0)
    softmax = timm.create_model('softmax_deit_tiny', **TINY['deit'])
    torch.save(softmax.state_dict(), tmp_path / 'softmax.pth')
    model = timm.create_model('softmax_deit_tiny', attn_type='flatten', **dict(TINY['deit'], img_size=48))
    report = load_pretrained_into(model, str(tmp_path / 'softmax.pth'))
    assert 'pos_embed' in report.loaded and model.pos_embed.shape == (1, 1 + 36, 32)
    assert {k.rsplit('.', 1)[-1] for k in report.new} == {'scale', 'positional_encoding', 'weight', 'bias'}


TIMM_LAYOUTS = {  # timm's own model of a family whose weights timm keeps under other keys, and the same sizes
    'swin': ('swin_tiny_patch4_window7_224', TINY['swin']),
    'pvt_v2': ('pvt_v2_b0', dict(embed_dims=[16, 32, 32, 32], num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2],
                                 depths=[1, 1, 1, 1], num_classes=5)),
}


@pytest.mark.parametrize('family', TIMM_LAYOUTS)
def test_timm_layout_weights_start_another_attention_as_the_official_layout_does(tmp_path, family):
    timm_name, sizes = TIMM_LAYOUTS[family]
    torch.manual_seed(0)
    timm_weights = timm.create_model(timm_name, **sizes).state_dict()
    torch.save(timm_weights, tmp_path / 'timm.pth')
    name = f'softmax_{family}_b0' if family == 'pvt_v2' else f'softmax_{family}_tiny'
    official = timm.create_model(name, **sizes)  # the same weights under the official keys
    filter_fn = models.swin.checkpoint_filter_fn if family == 'swin' else models.pvt_v2.checkpoint_filter_fn
    official.load_state_dict(filter_fn(timm_weights, official))
    torch.save(official.state_dict(), tmp_path / 'official.pth')
    reports = []
    for source in ('timm.pth', 'official.pth'):
        model = timm.create_model(name, attn_type='inline', **sizes)
        reports.append(load_pretrained_into(model, str(tmp_path / source)))
        state = model.state_dict()
        assert all(torch.equal(state[k], official.state_dict()[k]) for k in reports[-1].loaded)
    assert reports[0] == reports[1] and any('.residual.' in k for k in reports[0].new)


def model_input_size(sizes: dict) -> tuple:
    size = sizes.get('img_size', 224)
    return (size, size) if isinstance(size, int) else tuple(size)


@pytest.mark.parametrize('family', TIMM_LAYOUTS)
def test_timm_layout_weights_load_through_every_timm_loader(tmp_path, family):
    """Only `pretrained_cfg_overlay` renamed them: create_model's `checkpoint_path`, timm's `load_checkpoint` (also
    of a timm train.py checkpoint) and `load_state_dict` failed with the missing and unexpected keys."""
    timm_name, sizes = TIMM_LAYOUTS[family]
    torch.manual_seed(0)
    reference = timm.create_model(timm_name, **sizes).eval()
    torch.save(reference.state_dict(), tmp_path / 'timm.pth')
    torch.save({'epoch': 3, 'state_dict': {k: v + 1 for k, v in reference.state_dict().items()},
                'state_dict_ema': reference.state_dict()}, tmp_path / 'train.pth.tar')
    name = f'softmax_{family}_b0' if family == 'pvt_v2' else f'softmax_{family}_tiny'
    zoo_sizes = {**sizes, 'img_size': 64} if family == 'pvt_v2' else sizes
    x = torch.randn(2, 3, *model_input_size(zoo_sizes))
    loaded = [timm.create_model(name, checkpoint_path=str(tmp_path / 'timm.pth'), **zoo_sizes),
              timm.create_model(name, checkpoint_path=str(tmp_path / 'train.pth.tar'), **zoo_sizes)]
    model = timm.create_model(name, **zoo_sizes)
    timm.models.load_checkpoint(model, str(tmp_path / 'timm.pth'))
    loaded.append(model)
    model = timm.create_model(name, **zoo_sizes)
    assert not model.load_state_dict(reference.state_dict()).missing_keys
    loaded.append(model)
    with torch.no_grad():
        expected = reference(x)
        for model in loaded:
            assert (model.eval()(x) - expected).abs().max() < 1e-5
    broken = {k: v for k, v in reference.state_dict().items() if not k.startswith('head.')}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head\.weight", "head\.bias"\. \s*$'):
        timm.create_model(name, **zoo_sizes).load_state_dict(broken)  # the model's own keys, and nothing else


def test_a_model_saved_for_the_hub_starts_another_attention_by_its_hub_name(tmp_path, monkeypatch):
    """`load_pretrained_into(model, 'local-dir:FOLDER')` and `'hf-hub:REPO'`: the weights timm's `save_for_hf` wrote,
    read by timm's own loaders, start an InLine DeiT as the same weights in a file do."""
    saved = saved_for_the_hub('deit', None, tmp_path / 'saved', safe_serialization=True)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download',
                        lambda repo_id, filename, **kwargs: str(tmp_path / 'saved' / filename))
    torch.save(saved.state_dict(), tmp_path / 'softmax.pth')
    reports, states = [], []
    for source in (f'local-dir:{tmp_path / "saved"}', 'hf-hub:lab/softmax-deit-test', str(tmp_path / 'softmax.pth')):
        torch.manual_seed(1)
        model = timm.create_model('softmax_deit_tiny', attn_type='inline', **TINY['deit'])
        reports.append(load_pretrained_into(model, source))
        states.append(model.state_dict())
    assert reports[0] == reports[1] == reports[2] and any('.residual.' in k for k in reports[0].new)
    assert all(torch.equal(state[k], saved.state_dict()[k]) for state in states for k in reports[0].loaded)
    (tmp_path / 'empty').mkdir()
    with pytest.raises(CheckpointError, match=r"^'local-dir:.*empty': the folder holds no weights; expected "
                                              r"model\.safetensors or pytorch_model\.bin \(the files "
                                              r"timm\.models\.save_for_hf writes\), or a \.safetensors / \.pth / "
                                              r"\.pth\.tar / \.bin file$"):
        load_pretrained_into(model, f'local-dir:{tmp_path / "empty"}')
    with pytest.raises(CheckpointError, match=r"^'local-dir:.*missing': '.*missing' is not a folder; expected one "
                                              r"written by timm\.models\.save_for_hf$"):
        load_pretrained_into(model, f'local-dir:{tmp_path / "missing"}')


@pytest.mark.parametrize('files', [
    ('pytorch_model.bin', 'model.safetensors', 'other.pth'),
    ('pytorch_model.bin', 'a.safetensors'),
    ('model.pth', 'weights.bin'),
    ('b.safetensors', 'a.safetensors', 'c.pth'),
    ('weights.bin', 'weights.pth.tar'),
])
def test_the_weights_of_a_hub_folder_are_the_file_timm_reads(tmp_path, caplog, files):
    """`hub_weights_file('local-dir:…')`, which eval.py, train.py and `load_pretrained_into` read, picks the file
    `timm.create_model('local-dir:…', pretrained=True)` reads, whatever else the folder holds: each file holds
    another tensor, compared with timm's own loader."""
    for index, filename in enumerate(files):
        weights = {'marker': torch.full((1,), float(index))}
        if filename.endswith('.safetensors'):
            safetensors.torch.save_file(weights, tmp_path / filename)
        else:
            torch.save(weights, tmp_path / filename)
    with caplog.at_level(logging.WARNING, logger='models.checkpoint'):
        ours = load_checkpoint_file(hub_weights_file(f'local-dir:{tmp_path}'))
    if files == ('b.safetensors', 'a.safetensors', 'c.pth'):  # two of one extension: named, with the one read
        assert caplog.messages == [f"'local-dir:{tmp_path}': the folder holds 2 .safetensors files "
                                   f"['a.safetensors', 'b.safetensors']; reading 'a.safetensors'"]
    assert torch.equal(ours['marker'], timm.models._hub.load_state_dict_from_path(tmp_path)['marker'])


def test_a_start_from_another_family_or_a_missing_source_is_one_line(tmp_path):
    pvt = timm.create_model('softmax_pvt_tiny', **dict(TINY['pvt'], embed_dims=[16, 32, 32, 48], num_classes=7))
    torch.save(pvt.state_dict(), tmp_path / 'pvt.pth')
    model = timm.create_model('softmax_deit_tiny', **TINY['deit'])
    with pytest.raises(CheckpointError, match=r"'.*pvt.pth' shares no tensor with DeiT"):
        load_pretrained_into(model, str(tmp_path / 'pvt.pth'))
    with pytest.raises(CheckpointError, match="pretrained source 'nope.pth' is neither a file nor a registered model"):
        load_pretrained_into(model, 'nope.pth')
    with pytest.raises(CheckpointError, match=re.escape(f"pretrained source {str(tmp_path)!r} is neither a file nor a "
                                                        f"registered model name; expected a checkpoint file, a "
                                                        f"registered model name, or 'local-dir:FOLDER' / "
                                                        f"'hf-hub:REPO'")):
        load_pretrained_into(model, str(tmp_path))
    with pytest.raises(CheckpointError,
                       match="model 'sima_deit_tiny' has no released weights; expected a checkpoint file"):
        load_pretrained_into(model, 'sima_deit_tiny')


@pytest.mark.parametrize('family', FAMILIES)
def test_timm_factory_keywords_device_dtype_and_in_chans(family):
    model = timm.create_model(f'inline_{family}_tiny', device='meta', dtype=torch.float64)
    tensors = [*model.parameters(), *model.buffers()]
    assert {t.device.type for t in tensors} == {'meta'}
    assert {p.dtype for p in model.parameters()} == {torch.float64} and model.in_chans == 3
    gray = timm.create_model(f'softmax_{family}_tiny', in_chans=1, **TINY[family])
    size = TINY[family]['img_size']
    assert gray.in_chans == 1 and gray(torch.randn(2, 1, size, size)).shape == (2, 5)
