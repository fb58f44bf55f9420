"""Token groupings (Swin windows, PVT reduction, CSwin stripes) against plain float64 formulas written here."""
import math

import pytest
import torch
import torch.nn.functional as F

from models.analysis import record_attention
from models.attention import build_attention
from models.attention.layout import image_to_tokens, relative_position_index, tokens_to_image
from reference import SPEC_RANGES, SPEC_TS, dense, max_abs_err, naive_l1, naive_sigma, naive_softmax


def head_weights(attn, q, k, bias=None, mask=None, sigma_after_mask=False):
    """(B, n, d) queries and (B, m, d) keys of one head -> (B, n, m) attention weights."""
    if attn.attention_name == 'sima':
        return naive_l1(q) @ naive_l1(k).transpose(-2, -1)
    s = torch.einsum('bnc,bmc->bnm', q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    multimax = attn.attention_name == 'multimax'
    if multimax and not sigma_after_mask:
        s = naive_sigma(s, attn.mixer.ranges, attn.mixer.ts)
    if mask is not None:
        s = s + mask
    if multimax and sigma_after_mask:
        s = naive_sigma(s, attn.mixer.ranges, attn.mixer.ts)
    return naive_softmax(s)


def build64(name, dim, num_heads, grid, **kwargs):
    torch.manual_seed(0)
    attn = build_attention(name, dim, num_heads, grid, **kwargs).double()
    with torch.no_grad():
        for i, module in enumerate(m for m in attn.modules() if hasattr(m, 'ranges')):
            module.ranges.copy_(torch.tensor(SPEC_RANGES) * (1 + i))
            module.ts.copy_(torch.tensor(SPEC_TS) / (1 + i))
        if hasattr(attn, 'relative_position_bias_table'):
            attn.relative_position_bias_table.normal_()
    return attn


# ---------------------------------------------------------------- Swin windows

def naive_swin(attn, x, grid, window, shift, sigma_after_mask=False):
    """Roll, cut windows with loops, attend with the bias gathered by (dy, dx) and the region mask, roll back. The
    mask is Swin's −100 between regions, and MultiMax's −inf after σ (σ's squares may outweigh −100)."""
    (H, W), (wh, ww) = grid, window
    apart = -math.inf if attn.attention_name == 'multimax' and not sigma_after_mask else -100.
    B, N, C = x.shape
    d = C // attn.num_heads
    qkv = dense(x, attn.qkv).view(B, H, W, 3 * C)
    table = attn.relative_position_bias_table

    def source(y, x_):
        # the rolled map holds at (y, x) the token from (y + shift, x + shift)
        return (y + shift) % H, (x_ + shift) % W

    def region(y, x_):
        return (0 if y < H - wh else 1 if y < H - shift else 2), (0 if x_ < W - ww else 1 if x_ < W - shift else 2)

    out = torch.zeros(B, H, W, C, dtype=x.dtype)
    for wy in range(H // wh):
        for wx in range(W // ww):
            cells = [(wy * wh + a, wx * ww + b) for a in range(wh) for b in range(ww)]
            n = len(cells)
            tokens = torch.stack([qkv[:, sy, sx] for sy, sx in (source(*c) for c in cells)], dim=1)
            mask = None
            if shift:
                mask = torch.tensor([[0. if region(*ci) == region(*cj) else apart for cj in cells] for ci in cells],
                                    dtype=x.dtype)
            for j in range(attn.num_heads):
                bias = torch.stack([table[(yi - yj + wh - 1) * (2 * ww - 1) + (xi - xj + ww - 1), j]
                                    for yi, xi in cells for yj, xj in cells]).view(n, n)
                q, k, v = (tokens[..., i * C + j * d:i * C + (j + 1) * d] for i in range(3))
                res = head_weights(attn, q, k, bias, mask, sigma_after_mask) @ v
                for t, cell in enumerate(cells):
                    sy, sx = source(*cell)
                    out[:, sy, sx, j * d:(j + 1) * d] = res[:, t]
    return dense(out.view(B, N, C), attn.proj)


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('name', ['softmax', 'multimax'])
def test_shifted_windows_match_naive(name, shift):
    attn = build64(name, 16, 2, (6, 9), grouping='window', window_size=3, shift_size=shift, rel_pos_bias=True)
    x = 2 * torch.randn(2, 54, 16, dtype=torch.float64)
    assert max_abs_err(attn(x, (6, 9)), naive_swin(attn, x, (6, 9), (3, 3), shift)) < 1e-10


def test_multimax_in_windows_modulates_before_the_mask():
    attn = build64('multimax', 16, 2, (6, 9), grouping='window', window_size=3, shift_size=1, rel_pos_bias=True)
    x = 2 * torch.randn(2, 54, 16, dtype=torch.float64)
    out = attn(x, (6, 9))
    assert max_abs_err(out, naive_swin(attn, x, (6, 9), (3, 3), 1)) < 1e-10
    assert max_abs_err(out, naive_swin(attn, x, (6, 9), (3, 3), 1, sigma_after_mask=True)) > 1e-2


def test_multimax_masks_other_regions_of_a_shifted_window_whatever_sigma():
    """σ's squares outweigh Swin's −100 between regions: a query's output must still not move when a token of
    another region of its window changes, in the forward pass and in the recorded weights."""
    attn = build64('multimax', 16, 2, (6, 6), grouping='window', window_size=3, shift_size=1, rel_pos_bias=True)
    with torch.no_grad():
        attn.mixer.ranges.zero_()
        attn.mixer.ts.copy_(torch.tensor([0., 0., 0., 2.]))
    x = 4 * torch.randn(1, 36, 16, dtype=torch.float64)
    out = attn(x, (6, 6))
    assert max_abs_err(out, naive_swin(attn, x, (6, 6), (3, 3), 1)) < 1e-10
    # the last window of the rolled map holds tokens (0, 0), (0, 4), (4, 0) and (4, 4) of the grid, four regions
    moved = x.clone()
    moved[0, 4 * 6 + 4] += 10
    changed = (attn(moved, (6, 6)) - out).abs().amax(-1)[0]
    assert changed[0] == 0 and changed[4] == 0 and changed[4 * 6] == 0 and changed[4 * 6 + 4] > 0
    with record_attention(attn) as records:
        attn(x, (6, 6))
    weights = records[0].weights  # (B, h, 36, 36) over the grid's tokens
    corners = [0, 4, 4 * 6, 4 * 6 + 4]
    apart = weights[0][:, corners][:, :, corners] * (1 - torch.eye(4, dtype=torch.float64))
    assert torch.isfinite(weights).all() and torch.equal(apart, torch.zeros_like(apart))


@pytest.mark.parametrize('window', [(2, 2), (3, 2), (2, 3), (3, 3)])
def test_relative_position_index_is_the_offset_formula(window):
    wh, ww = window
    cells = [(a, b) for a in range(wh) for b in range(ww)]
    expected = torch.tensor([[(yi - yj + wh - 1) * (2 * ww - 1) + (xi - xj + ww - 1) for yj, xj in cells]
                             for yi, xi in cells])
    assert torch.equal(relative_position_index(window), expected)
    if wh == ww:
        attn = build_attention('softmax', 8, 2, (2 * wh, 2 * ww), grouping='window', window_size=wh, rel_pos_bias=True)
        assert torch.equal(attn.relative_position_index, expected)
        assert attn.relative_position_bias_table.shape == ((2 * wh - 1) * (2 * ww - 1), 2)


@pytest.mark.parametrize('batch', [1, 3])
def test_token_images_are_channels_last_views_that_convolutions_keep(batch):
    """tokens_to_image is pixel (y, x) channel c = token y·W + x, channel c, as a view; a depthwise convolution
    takes it without a copy to NCHW and returns channels-last, which image_to_tokens turns back into contiguous
    tokens, a batch of one included."""
    tokens = torch.randn(batch, 3 * 5, 4)
    image = tokens_to_image(tokens, (3, 5))
    assert image.shape == (batch, 4, 3, 5) and image.data_ptr() == tokens.data_ptr()
    assert torch.equal(image[:, 2, 1, 3], tokens[:, 1 * 5 + 3, 2])
    assert image.is_contiguous(memory_format=torch.channels_last)
    out = F.conv2d(image, torch.randn(4, 1, 3, 3), padding=1, groups=4)
    assert out.is_contiguous(memory_format=torch.channels_last) and image_to_tokens(out).is_contiguous()
    assert torch.equal(image_to_tokens(image), tokens)


@pytest.mark.parametrize('name', ['softmax', 'multimax'])
def test_window_is_clamped_to_the_grid(name):
    square = build64(name, 16, 2, (4, 4), grouping='window', window_size=7, shift_size=3, rel_pos_bias=True)
    assert square.window is None and square.shift_size == 0
    assert square.relative_position_bias_table.shape == (49, 2)
    x = 2 * torch.randn(2, 16, 16, dtype=torch.float64)
    assert max_abs_err(square(x, (4, 4)), naive_swin(square, x, (4, 4), (4, 4), 0)) < 1e-10

    wide = build64(name, 16, 2, (4, 8), grouping='window', window_size=7, shift_size=3, rel_pos_bias=True)
    assert wide.window == (4, 4) and wide.shift_size == 0
    x = 2 * torch.randn(2, 32, 16, dtype=torch.float64)
    assert max_abs_err(wide(x, (4, 8)), naive_swin(wide, x, (4, 8), (4, 4), 0)) < 1e-10

    # 4x4 windows would not tile a 4x6 grid: one window over it, as timm's, not two over a padded 4x8 grid
    uneven = build64(name, 16, 2, (4, 6), grouping='window', window_size=7, shift_size=3, rel_pos_bias=True)
    assert uneven.window is None and uneven.shift_size == 0
    assert uneven.relative_position_bias_table.shape == (7 * 11, 2)
    x = 2 * torch.randn(2, 24, 16, dtype=torch.float64)
    assert max_abs_err(uneven(x, (4, 6)), naive_swin(uneven, x, (4, 6), (4, 6), 0)) < 1e-10


@pytest.mark.parametrize('name', ['sima', 'additive'])
def test_linear_attentions_mix_each_shifted_window_alone(name):
    attn = build64(name, 16, 2, (4, 6), grouping='window', window_size=2, shift_size=1)
    single = build64(name, 16, 2, (2, 2))
    single.load_state_dict(attn.state_dict())
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    rolled = x.view(2, 4, 6, 16)[:, [1, 2, 3, 0]][:, :, [1, 2, 3, 4, 5, 0]]
    out = torch.zeros_like(rolled)
    for wy in range(2):
        for wx in range(3):
            part = (slice(None), slice(2 * wy, 2 * wy + 2), slice(2 * wx, 2 * wx + 2))
            out[part] = single(rolled[part].reshape(2, 4, 16), (2, 2)).view(2, 2, 2, 16)
    expected = out[:, [3, 0, 1, 2]][:, :, [5, 0, 1, 2, 3, 4]].reshape(2, 24, 16)
    assert max_abs_err(attn(x, (4, 6)), expected) < 1e-12


# ---------------------------------------------------------------- PVT spatial reduction

def attend_reduced(attn, q, reduced, activation=lambda t: t):
    """LayerNorm `norm` of the reduced map (B, M, C), `activation`, then attention of `q` on its keys, and `proj`."""
    C = q.shape[-1]
    d = C // attn.num_heads
    mean = reduced.mean(-1, keepdim=True)
    var = ((reduced - mean) ** 2).mean(-1, keepdim=True)
    reduced = activation((reduced - mean) / torch.sqrt(var + 1e-5) * attn.norm.weight + attn.norm.bias)
    kv = dense(reduced, attn.kv)
    k, v = kv[..., :C], kv[..., C:]
    out = torch.zeros_like(q)
    for j in range(attn.num_heads):
        part = slice(j * d, (j + 1) * d)
        out[..., part] = head_weights(attn, q[..., part], k[..., part]) @ v[..., part]
    return dense(out, attn.proj)


def naive_reduced(attn, x, grid):
    """Stride-r convolution written as a sum over kernel taps, LayerNorm, then attention on the reduced keys."""
    (H, W), r = grid, attn.sr_ratio
    B, N, C = x.shape
    image = x.view(B, H, W, C)
    reduced = attn.sr.bias.expand(B, H // r, W // r, C)
    for a in range(r):
        for b in range(r):
            reduced = reduced + torch.einsum('bijc,oc->bijo', image[:, a::r, b::r], attn.sr.weight[:, :, a, b])
    return attend_reduced(attn, dense(x, attn.q), reduced.reshape(B, -1, C))


def naive_pooled(attn, x, grid):
    """PVT v2's linear spatial reduction written out: the mean of each (H/p)×(W/p) cell of the map, a 1×1
    convolution, LayerNorm and exact GELU, then attention on the p×p reduced keys."""
    (H, W), p = grid, attn.pool_size
    B, N, C = x.shape
    cells = x.view(B, p, H // p, p, W // p, C).mean(dim=(2, 4)).reshape(B, p * p, C)
    reduced = torch.einsum('bnc,oc->bno', cells, attn.sr.weight[:, :, 0, 0]) + attn.sr.bias
    return attend_reduced(attn, dense(x, attn.q), reduced,
                          activation=lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2))))


@pytest.mark.parametrize('reduction, grid, naive', [
    (dict(sr_ratio=2), (4, 6), naive_reduced),
    (dict(pool_size=3), (6, 9), naive_pooled),
], ids=['strided', 'pooled'])
@pytest.mark.parametrize('name', ['softmax', 'multimax', 'sima'])
def test_spatial_reduction_matches_naive(name, reduction, grid, naive):
    attn = build64(name, 16, 2, grid, grouping='reduction', **reduction)
    with torch.no_grad():
        attn.norm.weight.normal_()
        attn.norm.bias.normal_()
    x = 2 * torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    assert max_abs_err(attn(x, grid), naive(attn, x, grid)) < 1e-10


# ---------------------------------------------------------------- CSwin stripes

def naive_cswin(attn, x, grid, split):
    """Two branches over vertical and horizontal stripes (or one global branch), each with LePE: a 3x3
    depthwise convolution of V inside the stripe, zero outside it."""
    H, W = grid
    B, N, C = x.shape
    qkv = dense(x, attn.qkv).view(B, H, W, 3 * C)
    if split >= max(H, W):
        branches = [(0, C, attn.attns[0], [[(y, x_) for y in range(H) for x_ in range(W)]])]
    else:
        vertical = [[(y, s * split + b) for y in range(H) for b in range(split)] for s in range(W // split)]
        horizontal = [[(s * split + a, x_) for a in range(split) for x_ in range(W)] for s in range(H // split)]
        branches = [(0, C // 2, attn.attns[0], vertical), (C // 2, C, attn.attns[1], horizontal)]
    out = torch.zeros(B, H, W, C, dtype=x.dtype)
    for start, stop, branch, stripes in branches:
        d = (stop - start) // branch.num_heads
        kernel, kernel_bias = branch.get_v.weight, branch.get_v.bias
        for cells in stripes:
            tokens = torch.stack([qkv[:, y, x_] for y, x_ in cells], dim=1)
            q, k, v = (tokens[..., i * C + start:i * C + stop] for i in range(3))
            res = torch.zeros_like(q)
            for j in range(branch.num_heads):
                part = slice(j * d, (j + 1) * d)
                res[..., part] = head_weights(branch, q[..., part], k[..., part]) @ v[..., part]
            where = {cell: t for t, cell in enumerate(cells)}
            for t, (y, x_) in enumerate(cells):
                lepe = kernel_bias.expand(B, -1)
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        if (y + dy, x_ + dx) in where:
                            lepe = lepe + kernel[:, 0, dy + 1, dx + 1] * v[:, where[(y + dy, x_ + dx)]]
                out[:, y, x_, start:stop] = res[:, t] + lepe
    return dense(out.view(B, N, C), attn.proj)


@pytest.mark.parametrize('name', ['softmax', 'multimax'])
def test_cross_shaped_stripes_match_naive(name):
    attn = build64(name, 16, 4, (4, 6), grouping='stripes', split_size=2)
    assert len(attn.attns) == 2
    x = 2 * torch.randn(2, 24, 16, dtype=torch.float64)
    assert max_abs_err(attn(x, (4, 6)), naive_cswin(attn, x, (4, 6), 2)) < 1e-10


@pytest.mark.parametrize('name', ['softmax', 'multimax'])
def test_cross_shaped_single_global_branch_when_stripes_cover_the_grid(name):
    attn = build64(name, 16, 4, (4, 4), grouping='stripes', split_size=4)
    assert len(attn.attns) == 1 and attn.attns[0].num_heads == 4
    x = 2 * torch.randn(2, 16, 16, dtype=torch.float64)
    assert max_abs_err(attn(x, (4, 4)), naive_cswin(attn, x, (4, 4), 4)) < 1e-10


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize('name', ['softmax', 'multimax'])
def test_bad_input_errors_name_the_bad_value(name):
    with pytest.raises(ValueError, match='dim 10 must be a multiple of num_heads 3'):
        build_attention(name, 10, 3, (4, 4))
    with pytest.raises(ValueError, match='window 0x0 must have positive sides'):
        build_attention(name, 16, 2, (4, 6), grouping='window', window_size=0)
    with pytest.raises(ValueError, match="grouping 'global' takes no keyword 'sr_ratio'; expected one of"):
        build_attention(name, 16, 2, (4, 4), sr_ratio=2)
    with pytest.raises(ValueError, match="unknown grouping 'bad'; expected one of global, reduction, window, stripes"):
        build_attention(name, 16, 2, (4, 4), grouping='bad')
    windowed = build_attention(name, 16, 2, (4, 4), grouping='window', window_size=2)
    with pytest.raises(ValueError, match='prefix tokens, got 1 before the 4x4 grid'):
        windowed(torch.randn(1, 17, 16), (4, 4))
    # a grid of one side, or of sides that are not positive integers, failed inside torch or ran on no grid
    for grid in [(4,), 4, (4, 0), (4.0, 4)]:
        with pytest.raises(ValueError) as error:
            build_attention(name, 16, 2, grid)
        assert str(error.value) == f"grid_size {grid!r} must be an (H, W) pair of positive integers"
    with pytest.raises(ValueError, match='^grid -2x-2 must have positive sides$'):
        build_attention(name, 16, 2, (2, 2))(torch.randn(1, 4, 16), (-2, -2))


@pytest.mark.parametrize('name, kwargs, message', [
    # a truthy string made MultiMax causal; softmax failed at its first forward
    ('multimax', dict(attn_kwargs=dict(causal='False')), "multimax attention option causal is 'False'; expected true "
                                                         "or false"),
    ('softmax', dict(attn_kwargs=dict(causal=1)), "softmax attention option causal is 1; expected true or false"),
    # a misspelt option of no attention was dropped in silence
    ('softmax', dict(attn_kwargs=dict(casual=True)), "attn_kwargs 'casual' is not an option of any attention; did you "
                                                     "mean 'causal'? expected one of: causal, focusing_factor, "
                                                     "kernel_size"),
    ('flatten', dict(attn_kwargs=dict(kernel_size=3.0)), "flatten attention option kernel_size is 3.0; expected an "
                                                         "integer"),
    ('flatten', dict(attn_kwargs=dict(focusing_factor=None)), "flatten attention option focusing_factor is None; "
                                                              "expected a number"),
    ('flatten', dict(attn_kwargs=dict(focusing_factor=0)), "flatten attention: focusing_factor 0 must be a finite "
                                                           "number > 0"),
    # NaN gave NaN outputs, inf one-hot features
    ('flatten', dict(attn_kwargs=dict(focusing_factor=math.nan)), "flatten attention: focusing_factor nan must be a "
                                                                  "finite number > 0"),
    ('flatten', dict(attn_kwargs=dict(focusing_factor=math.inf)), "flatten attention: focusing_factor inf must be a "
                                                                  "finite number > 0"),
    # a reduction larger than the grid failed in the first forward, inside the convolution
    ('sima', dict(grouping='reduction', sr_ratio=5), "sr_ratio 5 is larger than the 4x4 grid it reduces; expected at "
                                                     "most 4"),
    ('softmax', dict(grouping='reduction', sr_ratio=2.0), "sr_ratio 2.0 must be a positive integer"),
    ('softmax', dict(grouping='reduction', pool_size=0), "pool_size 0 must be a positive integer"),
    ('softmax', dict(grouping='reduction', pool_size=2, sr_ratio=2),
     "pool_size 2 and sr_ratio 2 both reduce the keys; expected one of them (sr_ratio=1 with pool_size)"),
    ('additive', dict(grouping='reduction', pool_size=2), "additive attention takes no reduced keys: pool_size 2 needs "
                                                          "an attention whose mixer sets reduces_keys = True "
                                                          "(pool_size=None expected)"),
    ('softmax', dict(grouping='window', window_size='7'), "window_size '7' must be an integer or an (h, w) pair of "
                                                          "integers"),
    ('softmax', dict(grouping='window', window_size=2, shift_size=1.0), "shift_size 1.0 must be an integer"),
    ('softmax', dict(grouping='stripes', split_size=2.0), "split_size 2.0 must be a positive stripe width"),
])
def test_options_and_grouping_keywords_of_another_type_are_named(name, kwargs, message):
    """Each was accepted and then failed inside torch (or silently did something else)."""
    with pytest.raises(ValueError) as error:
        build_attention(name, 16, 2, (4, 4), **kwargs)
    assert str(error.value) == message


@pytest.mark.parametrize('dim, num_heads, message', [
    (16, 2.0, "num_heads 2.0 must be a positive int"),  # built, then failed in the first forward's view()
    (16, True, "num_heads True must be a positive int"),  # built as one head
    (16, 0, "num_heads 0 must be a positive int"),
    (16.0, 2, "dim 16.0 must be a positive int"),
])
def test_widths_and_heads_of_another_type_are_named(dim, num_heads, message):
    for name in ('softmax', 'inline'):
        with pytest.raises(ValueError) as error:
            build_attention(name, dim, num_heads, (4, 4))
        assert str(error.value) == f"{name} attention: {message}"


def test_options_of_the_annotated_types_pass():
    attn = build_attention('flatten', 16, 2, (4, 4), grouping='window', window_size=[2, 2], shift_size=1,
                           attn_kwargs=dict(focusing_factor=2, kernel_size=3, causal=False))
    assert (attn.window, attn.mixer.focusing_factor, attn.mixer.kernel_size) == ((2, 2), 2, 3)


def test_reduction_needs_an_attention_that_supports_it():
    with pytest.raises(ValueError, match='sr_ratio 2 needs'):
        build_attention('additive', 16, 2, (4, 4), grouping='reduction', sr_ratio=2)
