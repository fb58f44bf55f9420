"""Linear attention (φ = elu + 1) against a plain float64 formula with an explicit N×N matrix, in every grouping."""
import pytest
import timm
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.utils.flop_counter import FlopCounterMode

import models  # noqa: F401  (registers the families)
from models.attention import build_attention, forms_score_matrix, list_attentions
from models.attention.linear import elu_feature_map, linear_attention

DIM, HEADS = 16, 2


def naive_weights(q, k):
    """(n, d) queries, (m, d) keys of one head -> (n, m) rows φ(qᵢ)·φ(kⱼ) / (Σⱼ φ(qᵢ)·φ(kⱼ) + 1e-6)."""
    phi_q = torch.where(q > 0, q + 1, torch.exp(q))
    phi_k = torch.where(k > 0, k + 1, torch.exp(k))
    scores = torch.stack([torch.stack([(phi_q[i] * phi_k[j]).sum() for j in range(len(k))]) for i in range(len(q))])
    return scores / (scores.sum(dim=1, keepdim=True) + 1e-6)


def naive_heads(q, k, v, heads):
    """(n, C) queries, (m, C) keys and values -> (n, C), head by head with the explicit matrix."""
    d = q.shape[-1] // heads
    return torch.cat([naive_weights(q[:, j * d:(j + 1) * d], k[:, j * d:(j + 1) * d]) @ v[:, j * d:(j + 1) * d]
                      for j in range(heads)], dim=-1)


def dense(x, layer):
    return x @ layer.weight.T + layer.bias


def build64(**kwargs):
    torch.manual_seed(0)
    return build_attention('linear', DIM, HEADS, (4, 6), **kwargs).double()


def test_function_matches_the_formula_with_fewer_keys_than_queries():
    torch.manual_seed(1)
    q = 3 * torch.randn(2, HEADS, 7, 8, dtype=torch.float64)
    k, v = (3 * torch.randn(2, 2, HEADS, 5, 8, dtype=torch.float64)).unbind(0)
    out = linear_attention(q, k, v)
    for b in range(2):
        for j in range(HEADS):
            torch.testing.assert_close(out[b, j], naive_weights(q[b, j], k[b, j]) @ v[b, j], rtol=0, atol=1e-12)


def test_rows_of_the_implicit_matrix_sum_to_one_and_the_feature_map_is_positive():
    x = torch.linspace(-30, 30, 101, dtype=torch.float64)
    assert (elu_feature_map(x) > 0).all()
    torch.testing.assert_close(elu_feature_map(x), torch.where(x > 0, x + 1, torch.exp(x)), rtol=0, atol=1e-15)
    at = torch.tensor([-30., -1., -1e-300, 0., 1e-300, 1., 30.], dtype=torch.float64, requires_grad=True)
    slope, = torch.autograd.grad(elu_feature_map(at).sum(), at)
    elu_slope, = torch.autograd.grad(F.elu(at).sum(), at)
    assert torch.equal(slope, elu_slope) and slope[3] == 1
    q, k = torch.randn(2, 9, 4, dtype=torch.float64).unbind(0)
    ones = torch.ones(9, 1, dtype=torch.float64)
    torch.testing.assert_close(linear_attention(q[None, None], k[None, None], ones[None, None])[0, 0],
                               naive_weights(q, k).sum(1, keepdim=True), rtol=0, atol=1e-12)


def test_global_grouping_with_a_class_token():
    attn = build64()
    x = 2 * torch.randn(2, 1 + 24, DIM, dtype=torch.float64)
    q, k, v = dense(x, attn.qkv).chunk(3, dim=-1)
    expected = dense(torch.stack([naive_heads(q[b], k[b], v[b], HEADS) for b in range(2)]), attn.proj)
    torch.testing.assert_close(attn(x, (4, 6)), expected, rtol=0, atol=1e-10)


def test_spatial_reduction_grouping():
    attn = build64(grouping='reduction', sr_ratio=2)
    x = 2 * torch.randn(2, 24, DIM, dtype=torch.float64)
    image = x.transpose(1, 2).reshape(2, DIM, 4, 6)
    reduced = F.conv2d(image, attn.sr.weight, attn.sr.bias, stride=2).flatten(2).transpose(1, 2)
    reduced = F.layer_norm(reduced, (DIM,), attn.norm.weight, attn.norm.bias)
    q = dense(x, attn.q)
    k, v = dense(reduced, attn.kv).chunk(2, dim=-1)
    expected = dense(torch.stack([naive_heads(q[b], k[b], v[b], HEADS) for b in range(2)]), attn.proj)
    torch.testing.assert_close(attn(x, (4, 6)), expected, rtol=0, atol=1e-10)


def cells_of_windows(grid, window, shift):
    """Token indices of each (shifted) window: the window at (wy, wx) of the map rolled by -shift."""
    (H, W), (wh, ww) = grid, window
    return [[((wy * wh + a + shift) % H) * W + (wx * ww + b + shift) % W for a in range(wh) for b in range(ww)]
            for wy in range(H // wh) for wx in range(W // ww)]


def test_shifted_window_grouping_gets_no_bias_or_mask():
    attn = build64(grouping='window', window_size=(2, 3), shift_size=1)
    assert not hasattr(attn, 'relative_position_bias_table') and attn.attn_mask is None
    x = 2 * torch.randn(2, 24, DIM, dtype=torch.float64)
    q, k, v = dense(x, attn.qkv).chunk(3, dim=-1)
    out = torch.zeros_like(x)
    for cells in cells_of_windows((4, 6), (2, 3), 1):
        for b in range(2):
            out[b, cells] = naive_heads(q[b, cells], k[b, cells], v[b, cells], HEADS)
    torch.testing.assert_close(attn(x, (4, 6)), dense(out, attn.proj), rtol=0, atol=1e-10)


def test_cross_shaped_stripes_with_lepe():
    attn = build64(grouping='stripes', split_size=2)
    x = 2 * torch.randn(2, 24, DIM, dtype=torch.float64)
    q, k, v = dense(x, attn.qkv).chunk(3, dim=-1)
    c = DIM // 2
    out = torch.zeros_like(x)
    for i, (branch, window) in enumerate(zip(attn.attns, [(4, 2), (2, 6)])):
        part = slice(i * c, (i + 1) * c)
        for cells in cells_of_windows((4, 6), window, 0):
            for b in range(2):
                qs, ks, vs = q[b, cells, part], k[b, cells, part], v[b, cells, part]
                image = vs.T.reshape(1, c, *window)
                lepe = F.conv2d(image, branch.get_v.weight, branch.get_v.bias, padding=1, groups=c)
                out[b, cells, part] = naive_heads(qs, ks, vs, HEADS // 2) + lepe.reshape(c, -1).T
    torch.testing.assert_close(attn(x, (4, 6)), dense(out, attn.proj), rtol=0, atol=1e-10)


def test_gradcheck_of_function_and_module():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert gradcheck(linear_attention, (q, k, v))
    attn = build_attention('linear', 8, 2, (2, 2)).double()
    x = torch.randn(1, 1 + 4, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: attn(t, (2, 2)), (x,))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_float16_sums_over_many_large_tokens_stay_finite(dtype):
    torch.manual_seed(3)
    attn = build_attention('linear', 32, 2, (32, 32))
    x = (20 * torch.randn(1, 1024, 32)).requires_grad_(True)
    with torch.autocast('cpu', dtype=dtype):
        out = attn(x, (32, 32))
    assert out.dtype == dtype and torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()


def test_cost_is_linear_in_tokens():
    def flops(side):
        with torch.device('meta'):
            attn = build_attention('linear', 64, 4, (side, side))
            x = torch.empty(1, side * side, 64)
        with FlopCounterMode(display=False) as counter:
            attn(x, (side, side))
        return counter.get_total_flops()
    assert 4 / 1.1 <= flops(64) / flops(32) <= 4 * 1.1
    assert not forms_score_matrix('linear')


def test_registered_in_every_family_and_size():
    assert 'linear' in list_attentions()
    names = timm.list_models('linear_*')
    assert len(names) == len(timm.list_models('softmax_*')) == 26
    model = timm.create_model('linear_swin_tiny', img_size=32, embed_dim=16, depths=[2, 1, 1, 1],
                              num_heads=[1, 2, 2, 2], num_classes=3)
    assert all(block.attn.window is None for block in model.layers[0].blocks)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
