"""timm's model contracts for tracing and export, on tiny configurations of the zoo.

- FX: every registered model (two of SimA-XCiT's fourteen) traces with timm's tracer settings (its leaf modules
  and wrapped functions, as timm's feature extraction uses them) and the traced module gives the eager outputs;
- TorchScript: every attention scripts in every grouping, and every family with every attention scripts whole,
  as timm's own model tests script it, and so does its FX graph; all give the eager outputs;
- torch.export with a dynamic batch, for every family with every attention: one exported program runs at two
  batch sizes and gives the eager outputs; MultiMax's row-block path exports too;
- ONNX (torch.onnx dynamo export) of the same programs, run in onnxruntime within 1e-4 of eager;
- the tracing exporters, `torch.jit.trace` and the TorchScript-based ONNX exporter, with a dynamic batch too.
"""
import io
import re
import warnings
from typing import Any, Dict, List

import numpy as np
import onnxruntime
import pytest
import torch

import timm
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.data import resolve_model_data_config
from timm.models import get_model_input_config, save_for_hf
from timm.models._features import FeatureGetterNet, FeatureHookNet
from timm.models._manipulate import reinit_non_persistent_buffers

import models  # noqa: F401  (registers the families)
from models.attention import build_attention, forms_score_matrix, get_mixer_class, list_attentions
from models.attention import multimax
from models.onednn import convert_to_onednn

# 'pvt_v2' before 'pvt': a model's family is the first whose name part it holds
FAMILIES = ('deit', 'pvt_v2', 'pvt', 'swin', 'cswin')
# SimA's XCiT-style family registers only the official names, for SimA; two stand for its fourteen: patch 16 with
# the class token normed alone in the class attention, patch 8 with every token normed.
SIMA_XCIT = ('sima_nano_12_p16', 'sima_tiny_12_p8')

# Tiny sizes that every registered model of a family accepts. Swin's official linear-attention models derive a
# softmax window of at least 7 from `window_size`, so its grids are multiples of 7 (56, 28, 14, 7).
TINY: Dict[str, Dict[str, Any]] = {
    'deit': dict(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2),
    'pvt_v2': dict(img_size=32, embed_dims=(8, 8, 16, 16), num_heads=(1, 1, 2, 2), depths=(1, 1, 1, 1)),
    'pvt': dict(img_size=32, patch_size=2, embed_dims=(8, 8, 16, 16), num_heads=(1, 1, 2, 2), depths=(1, 1, 1, 1)),
    'swin': dict(img_size=112, patch_size=2, embed_dim=8, depths=(2, 2, 2, 2), num_heads=(1, 1, 2, 2),
                 window_size=7),
    'cswin': dict(img_size=32, embed_dim=8, depth=(1, 1, 1, 1), num_heads=(2, 2, 2, 2)),
    'sima_xcit': dict(img_size=32, embed_dim=16, depth=2, num_heads=2),
}


def family_of(name: str) -> str:
    if re.fullmatch(r'sima_[a-z]+_\d+_p\d+', name):
        return 'sima_xcit'
    return next(family for family in FAMILIES if f'_{family}_' in f'{name}_')


ALL_MODELS = sorted({name for attn in list_attentions() for name in timm.list_models(f'{attn}_*')
                     if family_of(name) != 'sima_xcit'} | set(SIMA_XCIT))


def family_model(family: str) -> str:
    """The smallest softmax model of `family` (SimA-XCiT: its smallest model)."""
    if family == 'sima_xcit':
        return SIMA_XCIT[0]
    return f'softmax_{family}_b0' if family == 'pvt_v2' else f'softmax_{family}_tiny'


def tiny_model(name: str, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **{**TINY[family_of(name)], **kwargs})
    return model.eval()


def images(model: torch.nn.Module, batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, *model.img_size)


def test_every_model_is_covered():
    pairs = {(name.split('_')[0], family_of(name)) for name in ALL_MODELS}
    assert pairs == {(attn, family) for attn in list_attentions() for family in FAMILIES} | {('sima', 'sima_xcit')}


class TimmTracer(torch.fx.Tracer):
    """FX tracing with the settings of timm's feature extraction: its leaf modules and wrapped functions."""

    def __init__(self):
        super().__init__(autowrap_functions=tuple(get_notrace_functions()), param_shapes_constant=True)

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return isinstance(module, tuple(get_notrace_modules())) or super().is_leaf_module(module, qualified_name)


def _dropout_rates(model: torch.nn.Module) -> Dict[str, float]:
    return {name: module.p for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout)}


@pytest.mark.parametrize('ours, timm_name, rates', [
    ('softmax_deit_tiny', 'deit_tiny_patch16_224', dict(pos_drop_rate=0.2, proj_drop_rate=0.1)),
    ('softmax_swin_tiny', 'swin_tiny_patch4_window7_224', dict(proj_drop_rate=0.1)),
    ('softmax_pvt_v2_b0', 'pvt_v2_b0', dict(proj_drop_rate=0.1)),
    ('sima_nano_12_p16', 'xcit_nano_12_p16_224', dict(pos_drop_rate=0.2, proj_drop_rate=0.1)),
])
def test_timm_s_dropout_keywords_set_the_dropouts_timm_s_models_set(ours, timm_name, rates):
    """`proj_drop_rate` and `pos_drop_rate` were refused by a TypeError: a timm training script that sets them failed
    on every zoo model. Every dropout the zoo's model shares by name with timm's gets timm's rate."""
    zoo_rates = _dropout_rates(timm.create_model(ours, pretrained=False, **rates))
    timm_rates = _dropout_rates(timm.create_model(timm_name, pretrained=False, **rates))
    shared = set(zoo_rates) & set(timm_rates)
    assert len(shared) == (16 if 'pvt' in ours else 37 if 'deit' in ours else 36 if 'swin' in ours else 45)
    assert {name: zoo_rates[name] for name in shared} == {name: timm_rates[name] for name in shared}
    assert set(zoo_rates) - shared <= {'pos_drop'}  # Swin's dropout after the stem, which timm's Swin has not


@pytest.mark.parametrize('name', ['softmax_pvt_tiny', 'softmax_cswin_tiny', 'softmax_deit_tiny', 'softmax_swin_tiny'])
def test_drop_rate_is_the_official_dropout_everywhere_unless_timm_s_keywords_split_it(name):
    """The official models apply `drop_rate` after the position embedding, the attention projection and in the MLPs
    (CSwin in its MLPs only); timm's keywords take the first and the others apart."""
    official = _dropout_rates(timm.create_model(name, pretrained=False, drop_rate=0.3))
    assert set(official.values()) == ({0., 0.3} if 'cswin' in name else {0.3})
    # CSwin has no position embedding, hence no pos_drop_rate (as timm's models without one)
    pos = {} if 'cswin' in name else dict(pos_drop_rate=0.2)
    split = _dropout_rates(timm.create_model(name, pretrained=False, drop_rate=0.3, proj_drop_rate=0.1, **pos))
    for module, rate in official.items():
        expected = 0.2 if module.endswith('pos_drop') else 0.1 if rate else 0.
        assert split[module] == expected, module
    assert any(module.endswith('pos_drop') for module in split) == bool(pos)


@pytest.mark.parametrize('name', ALL_MODELS)
def test_fx_trace_matches_eager(name):
    model = tiny_model(name)
    traced = torch.fx.GraphModule(model, TimmTracer().trace(model))
    x = images(model, 2)
    with torch.no_grad():
        expected = model(x)
        out = traced(x)
    assert out.shape == (2, 5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# Every grouping with the tokens its family gives it: a class token (global), reduced keys, shifted windows on a
# grid of four windows and one window covering the grid (a position bias without mask), two stripe branches and
# one global branch.
GROUPINGS = {
    'global': (dict(grid_size=(4, 4)), 1),
    'reduction': (dict(grid_size=(4, 4), grouping='reduction', sr_ratio=2), 0),
    'window': (dict(grid_size=(8, 8), grouping='window', window_size=4, shift_size=2), 0),
    'one_window': (dict(grid_size=(4, 4), grouping='window', window_size=4), 0),
    'stripes': (dict(grid_size=(8, 8), grouping='stripes', split_size=2), 0),
    'one_stripe': (dict(grid_size=(4, 4), grouping='stripes', split_size=4), 0),
}


@pytest.mark.parametrize('grouping', list(GROUPINGS))
@pytest.mark.parametrize('attention', list_attentions())
def test_torchscript_attention_matches_eager(grouping, attention):
    kwargs, num_prefix = GROUPINGS[grouping]
    if grouping == 'reduction' and not get_mixer_class(attention).reduces_keys:
        kwargs = dict(kwargs, sr_ratio=1)  # PVT gives attentions that take no reduced keys the whole map
    torch.manual_seed(0)
    attn = build_attention(attention, 8, 2, **kwargs).eval()
    grid = kwargs['grid_size']
    x = torch.randn(2, num_prefix + grid[0] * grid[1], 8)
    with warnings.catch_warnings():  # TorchScript ignores an attribute type it warns about, and types it by value
        warnings.filterwarnings('error', message='The TorchScript type system')
        scripted = torch.jit.script(attn)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x, grid), attn(x, grid), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('name', [family_model(family) for family in (*FAMILIES, 'sima_xcit')] + ['flatten_swin_tiny'])
def test_a_model_built_on_the_meta_device_runs_after_assign_or_to_empty_and_timm_s_buffer_reinit(name):
    """A build that allocates nothing, then `load_state_dict(assign=True)` or `to_empty()` and a load, then timm's
    `reinit_non_persistent_buffers` (which recomputes Swin's relative position indices and shifted-window masks,
    left on the meta device or empty): the outputs of the model built as usual."""
    reference = tiny_model(name)
    x = images(reference, 2)
    with torch.no_grad():
        expected = reference(x)
    assigned = tiny_model(name, device='meta')
    assigned.load_state_dict(reference.state_dict(), assign=True)
    emptied = tiny_model(name, device='meta').to_empty(device='cpu')
    for model in (assigned, emptied):
        reinitialised = reinit_non_persistent_buffers(model)
        assert bool(reinitialised) == ('_swin_' in name)
        if model is emptied:
            model.load_state_dict(reference.state_dict())
        assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        with torch.no_grad():
            assert torch.equal(model.eval()(x), expected)


def export_cases() -> List[Any]:
    """Models that together hold every attention in every family: one per attention for DeiT (one attention per
    model), two per hierarchical family (one attention per stage), SimA-XCiT with its own."""
    names = list_attentions()
    cases = [pytest.param('deit', name, id=f'deit-{name}') for name in names]
    stages = [names[:4], (names[4:] + names)[:4]]
    for family in FAMILIES[1:]:
        cases += [pytest.param(family, attn_type, id=f'{family}-{"-".join(attn_type)}') for attn_type in stages]
    return cases + [pytest.param('sima_xcit', 'sima', id='sima_xcit-sima')]


def export_dynamic_batch(model: torch.nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    batch = torch.export.Dim('batch', min=1, max=1024)
    return torch.export.export(model, (x,), dynamic_shapes=({0: batch},))


# Smaller still for export, which takes seconds per block: one DeiT block; Swin's generic models on a 16x16
# grid of 4x4 windows, shifted in the first two stages; one SimA-XCiT block and one class-attention block.
EXPORT_SIZES = {
    'deit': dict(depth=1),
    'swin': dict(img_size=32, window_size=4, depths=(2, 2, 1, 1)),
    'sima_xcit': dict(depth=1, cls_attn_layers=1),
}


def export_sizes(family: str, attn_type: Any) -> Dict[str, Any]:
    """EXPORT_SIZES of `family`, where a Swin stage whose attention forms no scores, which attends to its whole grid
    with no window to shift, has one block."""
    sizes = dict(EXPORT_SIZES.get(family, {}))
    if family == 'swin':
        sizes['depths'] = tuple(depth if forms_score_matrix(name) else 1
                                for depth, name in zip(sizes['depths'], attn_type))
    return sizes


@pytest.mark.parametrize('family, attn_type', export_cases())
def test_export_dynamic_batch_and_onnx_match_eager(family, attn_type, tmp_path):
    model = tiny_model(family_model(family), attn_type=attn_type, **export_sizes(family, attn_type))
    program = export_dynamic_batch(model, images(model, 2))
    exported = program.module()
    batches = [images(model, 1), images(model, 3)]
    with torch.no_grad():
        expected = [model(x) for x in batches]
        for x, y in zip(batches, expected):
            torch.testing.assert_close(exported(x), y, rtol=1e-5, atol=1e-6)

    path = tmp_path / 'model.onnx'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        # optimize=False: the graph as exported, which onnxruntime optimises itself; a third less conversion time
        torch.onnx.export(program, (images(model, 2),), str(path), dynamo=True, verbose=False, optimize=False)
    session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    (input_name,) = [i.name for i in session.get_inputs()]
    for x, y in zip(batches, expected):
        (out,) = session.run(None, {input_name: x.numpy()})
        np.testing.assert_allclose(out, y.numpy(), rtol=0, atol=1e-4)


CAUSAL_EXPORT = pytest.param('deit', 'additive', id='deit-additive-causal')


@pytest.mark.parametrize('family, attn_type', export_cases() + [CAUSAL_EXPORT])
def test_jit_trace_and_the_torchscript_onnx_exporter_keep_a_dynamic_batch(family, attn_type):
    """The tracing exporters as users still call them: `torch.jit.trace` and `torch.onnx.export(dynamo=False)`
    with a dynamic batch axis, run at another batch than the traced one. They failed on the CPU kernels (a Python
    operator, a custom op), fixed InLine's grouped convolution to the traced batch, had no `cummax` (causal
    additive), and the ONNX one dropped MultiMax's shifted-window mask (an in-place add through a view)."""
    causal = dict(attn_kwargs=dict(causal=True), global_pool='avg') if attn_type == 'additive' else {}
    model = tiny_model(family_model(family), attn_type=attn_type, **export_sizes(family, attn_type), **causal)
    traced_at, x = images(model, 2), images(model, 3)
    with torch.no_grad():
        expected = model(x)
        traced = torch.jit.trace(model, (traced_at,))
        torch.testing.assert_close(traced(x), expected, rtol=1e-5, atol=1e-6)
    exported = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # the exporter's deprecation notice
        torch.onnx.export(model, (traced_at,), exported, dynamo=False, input_names=['images'],
                          dynamic_axes={'images': {0: 'batch'}})
    session = onnxruntime.InferenceSession(exported.getvalue(), providers=['CPUExecutionProvider'])
    (out,) = session.run(None, {'images': x.numpy()})
    np.testing.assert_allclose(out, expected.numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize('grad_enabled', [False, True], ids=['no_grad', 'grad'])
def test_multimax_row_blocks_export_with_dynamic_batch(monkeypatch, grad_enabled):
    # blocks of half the query rows: the row-block path that large inputs take, here on a tiny model (with
    # gradients enabled, the autograd function around it)
    model = tiny_model('multimax_deit_tiny', depth=1)
    n, heads = model.patch_embed.num_patches + model.num_prefix_tokens, model.blocks[0].attn.num_heads
    rows = (n + 1) // 2
    monkeypatch.setattr(multimax, '_ROW_BLOCK_BYTES', rows * heads * n * 4)
    monkeypatch.setattr(multimax, '_PLAIN_TRAINING_BYTES', 0)
    rows_taken = []
    row_blocks = multimax._row_blocks_forward
    monkeypatch.setattr(multimax, '_row_blocks_forward',
                        lambda *args, **kwargs: rows_taken.append(args[8]) or row_blocks(*args, **kwargs))
    with torch.set_grad_enabled(grad_enabled):
        program = export_dynamic_batch(model, images(model, 2))
    assert rows_taken and set(rows_taken) == {rows}
    exported = program.module()
    with torch.no_grad():
        for batch_size in (1, 3):
            x = images(model, batch_size)
            torch.testing.assert_close(exported(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('family', FAMILIES + ('sima_xcit',))
def test_distributed_checkpoint_state_dicts_keep_the_official_keys_and_round_trip(family):
    """torch.distributed.checkpoint (FSDP2's checkpoints) follows every state-dict key through attributes: keys the
    state-dict hooks keep official (a mixer's `attn.ranges` for `attn.mixer.ranges`, PVT's `block1` for
    `stages.0.blocks`, CSwin's block-level `qkv`) failed with AttributeError for every model but softmax DeiT."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    attentions = ('softmax',) if family == 'sima_xcit' else ('softmax', 'multimax', 'inline', 'flatten', 'additive')
    for attn_type in attentions:
        kwargs = {} if family == 'sima_xcit' else dict(attn_type=attn_type)
        model = tiny_model(family_model(family), **kwargs)
        expected = model.state_dict()
        for options in (None, StateDictOptions(full_state_dict=True, cpu_offload=True)):
            saved = get_model_state_dict(model, options=options)
            assert list(saved) == list(expected), attn_type
            assert all(torch.equal(saved[key], value) for key, value in expected.items()), attn_type
        torch.manual_seed(1)
        other = timm.create_model(family_model(family), num_classes=5, **TINY[family], **kwargs).eval()
        set_model_state_dict(other, get_model_state_dict(model))
        x = images(model, 2)
        with torch.no_grad():
            torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize('family', FAMILIES)
def test_functional_call_and_get_parameter_take_the_official_state_dict_keys(family):
    """torch.func.functional_call(model, state_dict) swaps tensors in by their keys: a mixer's official key
    (`attn.ranges` for `attn.mixer.ranges`) was set as an attribute the mixer never read, so MultiMax and FLatten
    models computed with their own parameters in silence, and InLine's, additive's, PVT's and CSwin's keys failed."""
    for attn_type in list_attentions():
        model = tiny_model(family_model(family), attn_type=attn_type)
        torch.manual_seed(1)
        other = timm.create_model(family_model(family), num_classes=5, attn_type=attn_type, **TINY[family]).eval()
        before = {key: value.clone() for key, value in model.state_dict().items()}
        x = images(model, 2)
        with torch.no_grad():
            torch.testing.assert_close(torch.func.functional_call(model, other.state_dict(), (x,)), other(x),
                                       rtol=0, atol=0, msg=attn_type)
        after = model.state_dict()
        assert all(torch.equal(after[key], value) for key, value in before.items()), attn_type
        assert all(type(p) is torch.nn.Parameter for p in model.parameters()), attn_type
        parameters = {id(p) for p in model.parameters()}
        for key, value in after.items():  # each key names, through attributes, the tensor it holds
            owner, _, name = key.rpartition('.')
            found = getattr(model.get_submodule(owner), name)
            assert torch.equal(found, value), key
            assert id(found) not in parameters or model.get_parameter(key) is found, key


@pytest.mark.parametrize('family, attn_type', export_cases())
def test_torchscript_of_the_whole_model_matches_eager(family, attn_type):
    # timm's TorchScript contract: the model itself scripts, stage loops and all; a second input size checks
    # that no grid was frozen into the scripted model under dynamic_img_size
    model = tiny_model(family_model(family), attn_type=attn_type, dynamic_img_size=True,
                       **export_sizes(family, attn_type))
    with timm.layers.set_scriptable(True), warnings.catch_warnings():
        warnings.filterwarnings('error', message='The TorchScript type system')
        scripted = torch.jit.script(model)
    size = model.img_size
    larger = torch.randn(1, 3, size[0] * 2, size[1] * 2)
    with torch.no_grad():
        for x in (images(model, 2), larger):
            torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('family, attn_type', export_cases())
def test_torchscript_of_the_fx_graph_matches_eager(family, attn_type):
    # timm's FX + TorchScript contract: the traced graph of the model scripts, with its attentions as submodules
    model = tiny_model(family_model(family), attn_type=attn_type, **export_sizes(family, attn_type))
    scripted = torch.jit.script(torch.fx.GraphModule(model, TimmTracer().trace(model)))
    x = images(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('feature_cls', ['hook', 'fx', 'list', 'dict', FeatureHookNet])
@pytest.mark.parametrize('family', [*FAMILIES, 'sima_xcit'])
def test_features_only_refuses_extractors_other_than_the_getter(family, feature_cls):
    """The stages run inside the model's own loop, so hooks and graph nodes at `feature_info`'s modules saw no
    stage maps (Swin and PVT: an empty list; PVT v2 and CSwin: tokens); they are refused in one line, and the
    getter, named or as a class, gives the maps of `forward_intermediates`."""
    name = family_model(family)
    with pytest.raises(ValueError, match=rf"^feature_cls {re.escape(repr(feature_cls))} is not supported by {name}: "
                                         r".*; expected 'getter' \(the default\)"):
        timm.create_model(name, features_only=True, feature_cls=feature_cls, out_indices=(0, 1), **TINY[family])
    torch.manual_seed(0)
    model = timm.create_model(name, **TINY[family]).eval()
    x = torch.randn(2, 3, *model.img_size)
    expected = model.forward_intermediates(x, indices=(0, 1), intermediates_only=True)
    for getter in ('Getter', FeatureGetterNet):
        features = timm.create_model(name, features_only=True, feature_cls=getter, out_indices=(0, 1),
                                     **TINY[family]).eval()
        assert not features.model.load_state_dict(model.state_dict(), strict=False).missing_keys
        assert all(torch.equal(a, b) for a, b in zip(features(x), expected, strict=True))


@pytest.mark.parametrize('family', [*FAMILIES, 'sima_xcit'])
def test_a_model_that_takes_one_input_size_says_so_and_an_export_reloads_at_it(family, tmp_path):
    """timm's model traits record whether the input size is fixed; DeiT, Swin and SimA-XCiT without
    `dynamic_img_size` recorded it as free (their patch embedding does not check the size, the model does), so
    `save_for_hf` of a model built at another size exported timm's 224 and the reloaded model refused its own
    data config."""
    size = (TINY[family]['img_size'], TINY[family]['img_size'] * 2)  # not timm's default 224 either
    model = tiny_model(family_model(family), img_size=size, dynamic_img_size=False)
    assert get_model_input_config(model)['fixed_input_size'] is True
    save_for_hf(model, tmp_path)
    reloaded = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    x = torch.randn(1, *resolve_model_data_config(reloaded)['input_size'])
    assert x.shape[-2:] == size
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), model(x), rtol=0, atol=0)
    dynamic = tiny_model(family_model(family), dynamic_img_size=True)
    assert get_model_input_config(dynamic)['fixed_input_size'] is False
    # built by its class, without timm's builder, a model says the same
    for dynamic_img_size in (False, True):
        built = type(model)(**{**TINY[family], 'dynamic_img_size': dynamic_img_size})
        assert get_model_input_config(built)['fixed_input_size'] is not dynamic_img_size


@pytest.mark.parametrize('family', [*FAMILIES, 'sima_xcit'])
def test_intermediates_come_in_depth_order_and_pruning_keeps_the_model_runnable(family):
    """As timm's models: `forward_intermediates` returns the taken outputs in depth order whatever the order of
    `indices`, and `prune_intermediate_layers(prune_head=False)` that cuts the last stages of a pyramid drops the
    head too, which is sized for the last stage's width (it was kept, and the next forward failed)."""
    model = tiny_model(family_model(family))
    x = images(model, 2)
    num_outputs = len(model.forward_intermediates(x, intermediates_only=True))
    with torch.no_grad():
        in_order = model.forward_intermediates(x, indices=[0, num_outputs - 1], intermediates_only=True)
        shuffled = model.forward_intermediates(x, indices=[num_outputs - 1, 0, 0], intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(shuffled, in_order, strict=True))
        model.prune_intermediate_layers([1], prune_head=False)
        out = model(x)
        if family in ('deit', 'sima_xcit'):  # every block as wide as the head
            assert model.num_classes == 5 and out.shape == (2, 5)
        else:
            assert model.num_classes == 0
            torch.testing.assert_close(out, model.forward_features(x), rtol=0, atol=0)


@pytest.mark.parametrize('attn_type', list_attentions())
@pytest.mark.parametrize('family', FAMILIES)
def test_an_empty_batch_gives_empty_logits(family, attn_type):
    """A batch of no images, as timm's ViT takes it: (0, classes) logits in inference, and a backward pass in
    training (InLine's per-sample convolution had zero groups, MultiMax's row blocks a division by zero, Swin's
    patch merging a size to infer from no elements); the causal forms of the global grouping likewise."""
    model = tiny_model(family_model(family), attn_type=attn_type)
    with torch.no_grad():
        assert model(images(model, 0)).shape == (0, 5)
    model.train()
    model(images(model, 0)).sum().backward()
    # through oneDNN too, whose product over no rows fails: the weight gradients of an empty batch are zeros
    convert_to_onednn(model)
    model.zero_grad()
    model(images(model, 0)).sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    if attn_type in ('softmax', 'multimax', 'additive', 'linear'):  # the attentions with a causal form
        attn = build_attention(attn_type, 8, 2, (3, 4), attn_kwargs=dict(causal=True))
        assert attn(torch.randn(0, 12, 8), (3, 4)).shape == (0, 12, 8)
