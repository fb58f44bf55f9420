"""Recording attention weights: the recorded rows reproduce every attention's global term in every grouping,
rows sum as the math says, recording changes nothing, and the statistics' injectivity probe."""
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F

import models  # noqa: F401  (registers the families)
from models.analysis import attention_layers, matrices, record_attention
from models.analysis.record import cell_centres
from models.analysis.stats import AttentionStatistics, collision_share, row_statistics
from models.attention import MixerContractError, build_attention, get_mixer_class, list_attentions
from models.attention.additive import AdditiveMixer
from models.attention.layout import merge_heads, split_heads
from models.attention.sima import l1_normalize_tokens

from reference import max_abs_err, naive_softmax

GRID = (4, 4)
# (grouping, keywords, prefix tokens): every grouping with the features that change its token order
GROUPINGS = {
    'global': (dict(), 1),
    'reduction': (dict(sr_ratio=2), 0),
    # PVT v2-Linear's keys pooled to a fixed map: coarser than the grid (uneven bins) and finer (repeated tokens)
    'pooled 3x3': (dict(pool_size=3), 0),
    'pooled 5x5': (dict(pool_size=5), 0),
    'window': (dict(window_size=2, shift_size=1), 0),
    'stripes': (dict(split_size=2), 0),
}
CASES = [(name, grouping) for name in list_attentions() for grouping in GROUPINGS]


def build(name, grouping, seed=0):
    kwargs, prefix = GROUPINGS[grouping]
    reduction = grouping == 'reduction' or grouping.startswith('pooled')
    if reduction and not get_mixer_class(name).reduces_keys:
        kwargs = dict(sr_ratio=1)
    torch.manual_seed(seed)
    attn = build_attention(name, 16, 4, GRID, grouping='reduction' if reduction else grouping,
                           **kwargs).double().eval()
    with torch.no_grad():  # non-zero parameters everywhere (MultiMax's σ, FLatten's encoding, biases)
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    x = torch.randn(2, prefix + GRID[0] * GRID[1], 16, dtype=torch.float64)
    return attn, x


def additive_output(attn, layer, x):
    """The additive attention's output rebuilt from the recorded pooling distributions (per group and head)."""
    if hasattr(attn, 'q'):
        q, (k, v) = attn.q(x), attn.kv(x).chunk(2, dim=-1)
    else:
        q, k, v = attn.qkv(x).chunk(3, dim=-1)
    branches = attn.attns if hasattr(attn, 'attns') else [attn]
    outs = []
    for i, branch in enumerate(branches):
        mixer = branch.mixer
        c, h = mixer.dim, mixer.num_heads
        part = slice(i * c, (i + 1) * c)
        qh, kh, vh = (split_heads(t[..., part], h) for t in (q, k, v))  # (B, h, N, d)
        pools = layer.weights[:, i * h:(i + 1) * h]  # (B, h, 2G, N)
        G = pools.shape[2] // 2
        mixed = torch.zeros_like(vh)
        for g in range(G):
            alpha, beta = pools[:, :, g], pools[:, :, G + g]
            members = alpha[0, 0] > 0
            global_query = (alpha.unsqueeze(-1) * qh).sum(dim=2, keepdim=True)
            global_key = (beta.unsqueeze(-1) * kh * global_query).sum(dim=2, keepdim=True)
            mixed[:, :, members] = (global_key * vh)[:, :, members]
        out = mixer.transform(merge_heads(mixed)) + q[..., part]
        outs.append(out)
    out = torch.cat(outs, dim=-1)
    return out if layer.local is None else out + layer.local


def recorded_output(attn, layer, x):
    """The layer's output rebuilt from its recorded rows (or pools), values and local term."""
    if layer.is_pooling:
        mixed = additive_output(attn, layer, x)
    else:
        mixed = merge_heads(layer.weights @ layer.values)
        if layer.local is not None:
            mixed = mixed + layer.local
    return attn.proj(mixed)


def test_a_weight_function_registered_against_what_it_returns_is_named(monkeypatch):
    """A pooling function registered without pools=True (a subclass of additive attention with a forward of its
    own) failed with an AttributeError on None, and a token-rows function registered with it alike."""
    monkeypatch.setattr(matrices, '_MATRICES', dict(matrices._MATRICES))

    class OwnForward(AdditiveMixer):
        def forward(self, q, k, v, ctx):
            return super().forward(q, k, v, ctx)

    attn, x = build('additive', 'global')
    attn.mixer.__class__ = OwnForward
    matrices.attention_matrix(OwnForward)(matrices.additive_weights)
    with record_attention(attn) as rec:
        attn(x, GRID)
    with pytest.raises(ValueError, match=r"^the attention matrix function of OwnForward is registered without "
                                         r"pools=True, but returns pools; expected attention_matrix\(\.\.\., "
                                         r"pools=True\) for a function that returns pools"):
        rec[0]
    attn, x = build('softmax', 'global')
    matrices.attention_matrix(type(attn.mixer), pools=True)(matrices.softmax_weights)
    with record_attention(attn) as rec:
        attn(x, GRID)
    with pytest.raises(ValueError, match=r"^the attention matrix function of SoftmaxMixer is registered with "
                                         r"pools=True, but returns no pools"):
        rec[0]


@pytest.mark.parametrize('name, part, layout', [('softmax', 'weights', r"\(B', heads, rows, keys\)"),
                                                ('additive', 'pools', r"\(B', heads, 2, tokens\)"),
                                                ('inline', 'local', r"\(B', n, C\)")])
@pytest.mark.parametrize('grouping', ['global', 'window'])
def test_a_weight_function_returning_another_shape_is_named(monkeypatch, grouping, name, part, layout):
    """Weights averaged over the heads by mistake failed in a view inside the recorder ("shape '[1, 1, 4, 17, -1]' is
    invalid for input of size 289"), with a traceback in both analysis scripts."""
    monkeypatch.setattr(matrices, '_MATRICES', dict(matrices._MATRICES))
    attn, x = build(name, grouping)
    registered = matrices._registration(type(attn.mixer))

    def averaged(mixer, q, k, v, ctx, rows):
        result = registered.function(mixer, q, k, v, ctx, rows)
        return result._replace(**{part: getattr(result, part).mean(1)})

    matrices.attention_matrix(type(attn.mixer), pools=registered.pools)(averaged)
    with record_attention(attn) as rec:
        attn(x, GRID)
    with pytest.raises(MixerContractError, match=rf"^the attention matrix function of {type(attn.mixer).__name__} "
                                                 rf"returned {part} of shape \([\d, ]+\); expected {layout} = "
                                                 r"\([\d, ]+\)$"):
        rec[0]


@pytest.mark.parametrize('name,grouping', CASES)
def test_recorded_matrix_reproduces_the_global_term(name, grouping):
    attn, x = build(name, grouping)
    with record_attention(attn) as rec:
        out = attn(x, GRID)
    layer = rec[0]
    assert layer.weights.dtype == torch.float64
    assert max_abs_err(recorded_output(attn, layer, x), out) < 1e-10
    pool_size = GROUPINGS[grouping][0].get('pool_size') if get_mixer_class(name).reduces_keys else None
    if pool_size is not None:  # a row runs over the pooled keys (it ran over the grid's 16 positions)
        assert layer.key_grid == (pool_size, pool_size)
        assert layer.is_pooling or layer.weights.shape[-1] == pool_size ** 2


@pytest.mark.parametrize('name,grouping', CASES)
def test_rows_sum_as_the_math_says(name, grouping):
    attn, x = build(name, grouping)
    with record_attention(attn) as rec:
        attn(x, GRID)
    weights = rec[0].weights
    sums = weights.sum(dim=-1)
    if name in ('softmax', 'multimax', 'inline', 'additive'):  # probabilities, InLine's rows by construction
        assert max_abs_err(sums, torch.ones_like(sums)) < 1e-12
    elif name == 'linear':  # the kernel over its sum plus 1e-6
        assert ((sums <= 1) & (sums > 1 - 1e-5)).all()
    elif name == 'flatten':  # the kernel over its sum plus N·1e-6, which dominates for queries of tiny features
        assert (sums <= 1).all()
    if name in ('softmax', 'multimax', 'linear', 'flatten', 'additive'):
        assert (weights >= 0).all()
    if grouping in ('window', 'stripes') and name != 'additive':  # zero outside the query's group
        assert ((weights == 0).sum(dim=-1) >= GRID[0] * GRID[1] // 2).all()


def test_softmax_rows_equal_the_float64_formula_in_shifted_windows():
    attn, x = build('softmax', 'window')
    with record_attention(attn) as rec:
        attn(x, GRID)
    layer = rec[0]
    q, k, _ = (split_heads(t, 4) for t in attn.qkv(x).chunk(3, dim=-1))
    # token (r, c) of the 4x4 grid is in the same shifted window as (r', c') when their rolled positions
    # ((r - 1) % 4, (c - 1) % 4) share a 2x2 window and no roll boundary separates them (the mask's regions)
    rolled = [((t // 4 - 1) % 4, (t % 4 - 1) % 4) for t in range(16)]
    region = [((r >= 2) + (r >= 3), (c >= 2) + (c >= 3)) for r, c in rolled]
    same = torch.tensor([[rolled[i][0] // 2 == rolled[j][0] // 2 and rolled[i][1] // 2 == rolled[j][1] // 2
                          and region[i] == region[j] for j in range(16)] for i in range(16)])
    bias = attn.relative_position_bias()  # (h, 4, 4) over the positions of one window
    within = [rolled[t][0] % 2 * 2 + rolled[t][1] % 2 for t in range(16)]
    scores = q @ k.transpose(-2, -1) / 2 + bias[:, within][:, :, within]
    expected = naive_softmax(scores.masked_fill(~same, float('-inf')))
    assert max_abs_err(layer.weights, expected) < 1e-12


@pytest.mark.parametrize('name,grouping', [('softmax', 'window'), ('inline', 'global'), ('flatten', 'stripes'),
                                           ('sima', 'reduction')])
def test_requested_queries_are_rows_of_the_full_matrix(name, grouping):
    attn, x = build(name, grouping)
    with record_attention(attn) as full:
        attn(x, GRID)
    prefix = GROUPINGS[grouping][1]
    with record_attention(attn, queries=[prefix + 5, (0.9, 0.1), prefix]) as some:
        attn(x, GRID)
    expected_tokens = [prefix + 5, prefix + 12, prefix]
    layer = some[0]
    assert layer.queries.tolist() == expected_tokens
    assert max_abs_err(layer.weights, full[0].weights[:, :, expected_tokens]) < 1e-12
    # token indices as np.argsort and torch give them failed to unpack as points when a layer was read
    typed_queries = [np.int64(prefix + 5), torch.tensor(prefix + 12), (np.float32(0.9), torch.tensor(0.1))]
    with record_attention(attn, queries=typed_queries) as typed:
        attn(x, GRID)
    assert typed[0].queries.tolist() == [prefix + 5, prefix + 12, prefix + 12]
    assert max_abs_err(layer.local, full[0].local) < 1e-12 if layer.local is not None else full[0].local is None


FAMILY_MODELS = {
    'deit': dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10),
    'pvt': dict(img_size=64, embed_dims=[16, 32, 64, 128], num_heads=[1, 2, 4, 8], mlp_ratios=[2, 2, 2, 2],
                depths=[1, 1, 1, 1], num_classes=10),
    'swin': dict(img_size=32, embed_dim=16, depths=[2, 1, 2, 1], num_heads=[1, 2, 2, 4], num_classes=10,
                 window_size=2),
    'cswin': dict(img_size=32, embed_dim=16, depth=[1, 1, 2, 1], num_heads=[2, 2, 4, 4], split_size=[1, 2, 1, 1],
                  num_classes=10),
}


@pytest.mark.parametrize('family', FAMILY_MODELS)
@pytest.mark.parametrize('name', list_attentions())
def test_recording_changes_nothing(family, name):
    torch.manual_seed(0)
    model = timm.create_model(f'{name}_{family}_tiny', **FAMILY_MODELS[family]).eval()
    x = torch.randn(2, 3, FAMILY_MODELS[family]['img_size'], FAMILY_MODELS[family]['img_size'])
    state = {key: value.clone() for key, value in model.state_dict().items()}
    attributes = {name: dict(vars(module)) for name, module in model.named_modules()}
    with torch.no_grad():
        plain = model(x)
        with record_attention(model) as rec:
            recorded = model(x)
        assert len(rec) == len(attention_layers(model))
        for layer in rec:
            assert torch.isfinite(rec[layer].weights).all()
    assert torch.equal(plain, recorded)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in state.items())
    for module_name, module in model.named_modules():
        assert vars(module).keys() == attributes[module_name].keys()
        assert not module._forward_pre_hooks and not module._forward_hooks


@pytest.mark.parametrize('family', FAMILY_MODELS)
def test_grad_cam_maps_every_family_to_the_image(family):
    """The last attention layer's tokens reshape to its grid in every family (a wrong grid raises)."""
    from models.analysis.plots import grad_cam

    torch.manual_seed(0)
    size = FAMILY_MODELS[family]['img_size']
    model = timm.create_model(f'softmax_{family}_tiny', **FAMILY_MODELS[family]).eval()
    cams = grad_cam(model, torch.randn(2, 3, size, size), targets=[1, 2])
    assert cams.shape == (2, size, size)
    assert np.isfinite(cams).all() and cams.min() >= 0 and cams.max() <= 1  # scaled per image to [0, 1]


def test_bad_layers_and_queries_are_named():
    attn, x = build('softmax', 'global')
    with pytest.raises(ValueError, match="unknown layer 'blocks.9.attn'"):
        with record_attention(attn, layers=['blocks.9.attn']):
            pass
    # refused on entering, before the model runs (points outside the image were refused when a layer was read)
    for queries, message in (([(1.2, 0.5)], "query point (1.2, 0.5) is outside the image; expected fractions in "
                                            "[0, 1)"),
                             (['3,3'], "query '3,3' is neither a token index nor a (y, x) point; expected an integer "
                                       "or a pair of fractions in [0, 1)"),
                             ([True], "query True is neither a token index nor a (y, x) point")):
        with pytest.raises(ValueError) as error:
            with record_attention(attn, queries=queries):
                raise AssertionError('entered')
        assert str(error.value).startswith(message)
    with pytest.raises(ValueError, match=r"^unknown layer -2; expected an index from -1 to 0 or one of $"):
        with record_attention(attn, layers=[-2]):
            pass
    # recorded nothing, and reading it said 'layer -1 was not recorded; expected an index from 0 to -1'
    with pytest.raises(ValueError, match=r"^layers \[\] selects no layer; expected None for all 1 or indices / names "
                                         r"of some, e.g. \[-1\] for the last$"):
        with record_attention(attn, layers=[]):
            raise AssertionError('entered')
    with record_attention(attn) as rec:  # an index past the recorded layers was list's own error
        attn(x, GRID)
    with pytest.raises(IndexError, match=r"^layer 1 was not recorded; expected an index from -1 to 0 of the 1 "
                                         r"recorded: $"):
        rec[1]
    assert rec[-1].weights.shape == rec[0].weights.shape


def test_causal_layers_are_refused_in_one_line():
    causal = build_attention('softmax', 16, 2, (4, 4), True, attn_kwargs=dict(causal=True))
    with pytest.raises(ValueError, match=r"^layer '' is causal; recording forms the non-causal matrices only"):
        with record_attention(causal):
            pass


@pytest.mark.parametrize('name,grouping', CASES)
def test_a_grid_other_than_the_built_one_is_recorded_as_the_layer_runs_it(name, grouping):
    """Built for 4x4, run on 6x6 (a model with `dynamic_img_size`): the stripes follow the grid, and so does
    FLatten's resampled positional encoding; the rows rebuild the layer's output there too."""
    attn, _ = build(name, grouping)
    prefix = GROUPINGS[grouping][1]
    x = torch.randn(2, prefix + 36, 16, dtype=torch.float64)
    with record_attention(attn) as rec:
        out = attn(x, (6, 6))
    assert max_abs_err(recorded_output(attn, rec[0], x), out) < 1e-10


# windows and stripes of 3 on the 4x4 grid, zero-padded to 6 tokens a side (a shift of 2 keeps padding and grid in
# one region of the shift mask, where a shift of 1 would mask the padding away)
PADDED = {'window': dict(window_size=3, shift_size=2), 'stripes': dict(split_size=3)}


def build_padded(name, grouping, zero_bias):
    torch.manual_seed(0)
    attn = build_attention(name, 16, 4, GRID, grouping=grouping, **PADDED[grouping]).double().eval()
    with torch.no_grad():
        for param_name, p in attn.named_parameters():
            p.add_(torch.randn_like(p) * 0.2)
            if zero_bias and param_name.endswith('bias') and param_name.startswith(('qkv', 'q.', 'kv')):
                p.zero_()
    return attn, torch.randn(2, GRID[0] * GRID[1], 16, dtype=torch.float64)


@pytest.mark.parametrize('name', list_attentions())
@pytest.mark.parametrize('grouping', PADDED)
def test_padded_grids_are_recorded_on_their_tokens(name, grouping):
    # without a qkv bias the padding carries zero values, so the rows over the grid's own tokens still give the
    # layer's output, however much weight the padding took
    attn, x = build_padded(name, grouping, zero_bias=True)
    with record_attention(attn) as rec:
        out = attn(x, GRID)
    layer = rec[0]
    assert layer.weights.shape[-1] == GRID[0] * GRID[1]
    assert max_abs_err(recorded_output(attn, layer, x), out) < 1e-10
    if name == 'softmax':  # the padding takes part of a row's mass where a window reaches past the grid
        sums = layer.weights.sum(dim=-1)
        assert (sums < 1 - 1e-3).any() and (sums <= 1 + 1e-12).all()


@pytest.mark.parametrize('name', list_attentions())
def test_padded_windows_record_the_rows_of_the_explicitly_padded_grid(name):
    # the window layer pads its input with zeros before the projections, as a zero-padded 6x6 input is: the rows
    # of the 4x4 grid's tokens are those of the padded grid, on the grid's tokens
    attn, x = build_padded(name, 'window', zero_bias=False)
    with record_attention(attn, queries=[0, 5, 15]) as rec:
        attn(x, GRID)
    inside = (torch.arange(6)[:, None] * 6 + torch.arange(4)[None, :])[:4].reshape(-1)  # 4x4 in the 6x6 order
    padded = F.pad(x.view(2, 4, 4, 16), (0, 0, 0, 2, 0, 2)).view(2, 36, 16)
    with record_attention(attn, queries=None if name == 'additive' else inside[[0, 5, 15]].tolist()) as whole:
        attn(padded, (6, 6))
    expected = whole[0].weights[..., inside]  # every shifted window holds some of the grid: additive's pools agree
    assert rec[0].weights.shape == expected.shape
    assert max_abs_err(rec[0].weights, expected) < 1e-12
    if rec[0].local is not None:
        assert max_abs_err(rec[0].local, whole[0].local[:, inside]) < 1e-12


def test_sima_key_norms_under_reduced_keys_are_over_the_reduced_keys():
    """SimA's ‖k̂‖ belongs to the keys: under PVT's spatial reduction the 4 keys of the 2x2 map, not the 16 query
    positions (it was the 4 heads' values of those keys, read across the heads, copied to every head)."""
    attn, x = build('sima', 'reduction')
    captured = []
    attn.mixer.register_forward_pre_hook(lambda module, args: captured.append(args[:2]))
    with record_attention(attn) as rec:
        attn(x, GRID)
    layer, (q, k) = rec[0], captured[0]
    assert layer.key_grid == (2, 2) and k.shape[1] == 4
    for key, tokens in (('q_norm', q), ('k_norm', k)):
        expected = l1_normalize_tokens(split_heads(tokens, 4)).norm(dim=-1)
        assert layer.extras[key].shape == expected.shape and max_abs_err(layer.extras[key], expected) < 1e-12


@pytest.mark.parametrize('name', list_attentions())
def test_stripes_on_a_non_square_grid_rebuild_the_output(name):
    """CSwin's branches on a 4x8 grid: 4 vertical stripes of width 2 and 2 horizontal ones. Additive attention's
    pools of the two branches have different group counts (recording failed on them): each head gets the rows of
    the most groups, empty past its own, and the statistics count only the pools."""
    torch.manual_seed(0)
    grid = (4, 8)
    attn = build_attention(name, 16, 4, grid, grouping='stripes', split_size=2).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    with record_attention(attn) as rec:
        out = attn(x, grid)
    layer = rec[0]
    assert max_abs_err(recorded_output(attn, layer, x), out) < 1e-10
    if name == 'additive':
        assert layer.weights.shape == (2, 4, 8, 32)
        present = layer.weights.abs().sum(dim=-1) > 0  # (B, heads, rows)
        assert present[:, :2].all() and present[:, 2:, [0, 1, 4, 5]].all() and not present[:, 2:, [2, 3, 6, 7]].any()
        entropy = row_statistics(layer, (32, 64))['entropy']
        pools = layer.weights[:, 2:, [0, 1, 4, 5]].double()
        expected = -(pools * pools.clamp_min(1e-300).log()).sum(-1)
        assert entropy[2:].tolist() == pytest.approx(expected.mean(dim=(0, 2)).tolist())


def test_a_query_point_on_a_cell_edge_is_in_that_cell():
    """15/22 times 22 is 14.999999999999998 in floating point: the point on the edge of cell 15 is in cell 15."""
    torch.manual_seed(0)
    attn = build_attention('softmax', 16, 4, (22, 22)).double().eval()
    with record_attention(attn, queries=[(15 / 22, 15 / 22), (0.0, 21 / 22)]) as rec:
        attn(torch.randn(1, 22 * 22, 16, dtype=torch.float64), (22, 22))
    assert rec[0].queries.tolist() == [15 * 22 + 15, 21]


def test_injectivity_probe_finds_linear_attention_collisions_only():
    """Queries q and q' = φ⁻¹(2·φ(q)) differ but have proportional features φ: linear attention gives them the
    same row. Softmax and InLine, fed the same inputs, give every different query its own row."""
    torch.manual_seed(0)
    n, d = 16, 8
    q = torch.randn(1, 1, n, d, dtype=torch.float64)
    phi = F.elu(q[:, :, :n // 2]) + 1
    doubled = 2 * phi
    q[:, :, n // 2:] = torch.where(doubled > 1, doubled - 1, torch.log(doubled))  # elu⁻¹(2φ − 1)
    k = torch.randn(1, 1, n, d, dtype=torch.float64)
    linear = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-2, -1)
    linear = linear / linear.sum(dim=-1, keepdim=True)
    softmax = naive_softmax(q @ k.transpose(-2, -1) / d ** 0.5)
    inline = (q @ (k - k.mean(dim=-2, keepdim=True)).transpose(-2, -1)) * (d ** -0.5 / n) + 1 / n
    assert collision_share(linear, q).item() == pytest.approx(8 / (n * (n - 1) / 2))
    assert collision_share(softmax, q).item() == 0
    assert collision_share(inline, q).item() == 0


def test_reduced_keys_sit_where_the_stride_puts_them_when_it_does_not_tile_the_grid():
    """A 5×5 grid under stride 2 has 2×2 keys over its first 4×4 cells (PVT v2 at 80 has 2×2 keys over the first
    16 of 20 cells): the statistics spread the key cells over the whole image, and the figures drew them there."""
    torch.manual_seed(0)
    attn = build_attention('softmax', 8, 2, (5, 5), grouping='reduction', sr_ratio=2).double()
    with record_attention(attn, queries=[0]) as rec:
        attn(torch.randn(1, 25, 8, dtype=torch.float64), (5, 5))
    layer = rec[0]
    assert layer.key_grid == (2, 2) and layer.key_extent == (0.8, 0.8)
    layer.weights = torch.zeros_like(layer.weights)
    layer.weights[..., 3] = 1  # key cell (1, 1): pixels 16 to 32 of 40, its centre at (24, 24)
    # query token 0 is cell (0, 0) of 8-pixel cells, its centre at (4, 4)
    assert row_statistics(layer, (40, 40))['distance_px'].tolist() == pytest.approx([20 * 2 ** 0.5] * 2)


# (model, keywords, image side): stage grids that tile the image, and grids padded or rounded up to more than it
STRIDED_MODELS = {
    'deit': ('softmax_deit_tiny', FAMILY_MODELS['deit'], 32),
    'pvt': ('softmax_pvt_tiny', FAMILY_MODELS['pvt'], 64),
    'swin 40': ('softmax_swin_tiny', dict(img_size=40, embed_dim=16, depths=[2, 1, 1, 1], num_heads=[1, 2, 2, 2],
                                          window_size=4, num_classes=5), 40),
    'cswin 40': ('softmax_cswin_tiny', dict(FAMILY_MODELS['cswin'], img_size=40), 40),
    'pvt_v2 40': ('softmax_pvt_v2_b0', dict(img_size=40, num_classes=0), 40),
    'pvt_v2 41': ('softmax_pvt_v2_b0', dict(img_size=41, num_classes=0), 41),
}


@pytest.mark.parametrize('model_name, kwargs, side', STRIDED_MODELS.values(), ids=list(STRIDED_MODELS))
def test_a_query_pixel_is_the_token_of_the_cell_that_holds_it_in_every_stage(model_name, kwargs, side):
    """A stage's cells are its stride wide from the top left corner; a grid padded below and right before a patch
    merging (Swin, 5 -> 3 -> 2 at 40) or rounded up by a stride-2 convolution (CSwin, PVT v2) reaches past the
    image. Pixel 30 of 40 is in cell 1 of 16-pixel cells and cell 0 of 32-pixel ones; it was taken as a fraction
    of the grid, cell 2 of 3 and cell 1 of 2."""
    torch.manual_seed(0)
    model = timm.create_model(model_name, **kwargs).eval()
    with torch.no_grad(), record_attention(model, queries=[((p + 0.5) / side, (p + 0.5) / side)
                                                           for p in range(side)]) as rec:
        model(torch.randn(1, 3, side, side))
    layers = [rec[name] for name in rec]
    # DeiT's patches; the others' 4-pixel cells of stage 0, doubled by every stage
    strides = [kwargs.get('patch_size') or 4 * 2 ** int(layer.name.split('.')[1]) for layer in layers]
    for layer, stride in zip(layers, strides):
        w = layer.grid[1]
        assert layer.queries.tolist() == [layer.num_prefix_tokens + p // stride * (w + 1) for p in range(side)], \
            layer.name
    assert [layer.extent for layer in layers] == [(layer.grid[0] * stride / side, layer.grid[1] * stride / side)
                                                  for layer, stride in zip(layers, strides)]
    if model_name == 'softmax_swin_tiny':
        assert [divmod(int(layer.queries[30]), layer.grid[1]) for layer in layers][-2:] == [(1, 1), (0, 0)]
        assert [layer.extent for layer in layers][-2:] == [(1.2, 1.2), (1.6, 1.6)]


def test_statistics_place_a_padded_grid_s_cells_by_their_stride():
    """Swin at 40, stage 2: the 3×3 grid padded from 5×5 has 16-pixel cells over 48 pixels. Query cell (1, 1) is
    centred at (24, 24); key cell (2, 2) holds pixels 32 to 39 of the image, centred at (36, 36). The cells were
    spread evenly over the 40 pixels, at 20 and 33.3."""
    torch.manual_seed(0)
    model_name, kwargs, side = STRIDED_MODELS['swin 40']
    model = timm.create_model(model_name, **kwargs).eval()
    with torch.no_grad(), record_attention(model, layers=['layers.2.blocks.0.attn'], queries=[4]) as rec:
        model(torch.randn(1, 3, side, side))
    layer = rec[0]
    assert layer.grid == layer.key_grid == (3, 3) and layer.extent == layer.key_extent == (1.2, 1.2)
    layer.weights = torch.zeros_like(layer.weights)
    layer.weights[..., 8] = 1
    assert row_statistics(layer, (side, side))['distance_px'].tolist() == pytest.approx([12 * 2 ** 0.5] * 2)
    assert cell_centres((3, 2), (1.2, 1.6), (side, side)).tolist() == [
        [8, 16], [8, 36], [24, 16], [24, 36], [36, 16], [36, 36]]


def test_rank_of_linear_attention_is_bounded_by_the_head_width():
    """φ(Q)φ(K)ᵀ has rank at most d = 4 over the 17 tokens; softmax rows are independent."""
    ranks = {}
    for name in ('linear', 'softmax'):
        attn, x = build(name, 'global')
        with record_attention(attn) as rec:
            attn(x, GRID)
        ranks[name] = row_statistics(rec[0], (32, 32))['rank']
    assert ranks['linear'].tolist() == [4.0] * 4
    assert ranks['softmax'].tolist() == [17.0] * 4


def test_statistics_of_known_rows():
    """A uniform row and a one-hot row: entropy log M and 0, Gini 0 and 1 − 1/M, top-5 mass 5/M and 1."""
    attn, x = build('softmax', 'global')
    with record_attention(attn, queries=[0, 1]) as rec:
        attn(x, GRID)
    layer = rec[0]
    M = layer.weights.shape[-1]
    layer.weights = torch.zeros_like(layer.weights)
    layer.weights[:, :, 0] = 1 / M
    layer.weights[:, :, 1, 3] = 1
    stats = row_statistics(layer, (32, 32))
    assert stats['entropy'][0].item() == pytest.approx(torch.log(torch.tensor(float(M))).item() / 2)
    assert stats['gini'][0].item() == pytest.approx((1 - 1 / M) / 2)
    assert stats['top5_mass'][0].item() == pytest.approx((5 / M + 1) / 2)
    # query token 1 sits at the centre of cell (0, 0) of the 4x4 grid over 32 pixels, key token 3 at cell (0, 2)
    assert stats['distance_px'][0].item() == pytest.approx(16.0)
    assert stats['rank'][0].item() == 2
    summary = AttentionStatistics((32, 32))
    summary.add(layer)
    assert len(summary.rows('m')) == 4 and summary.rows('m')[0]['layer'] == ''
