"""InLine and FLatten attentions against plain O(N²) formulas, plus their numerics, cost and errors."""
from typing import Callable, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from models.attention import CrossShapedAttention, MixContext, build_attention, forms_score_matrix
from models.attention.flatten import focused_feature_map, focused_linear_attention
from models.attention.inline import inline_attention
from dispatch import DispatchRecorder
from golden import load_golden

DIM, HEADS, GRID = 16, 4, (4, 6)


# ----------------------------------------------------------------------------------------------------------------
# plain reference formulas: loops over heads, groups and convolution taps, explicit N×N weight matrices

def taps_conv(image: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Depthwise cross-correlation of image (C, H, W) with weight (C, k, k), zero padding k//2, tap by tap."""
    C, H, W = image.shape
    k = weight.shape[-1]
    p = k // 2
    padded = image.new_zeros(C, H + 2 * p, W + 2 * p)
    padded[:, p:p + H, p:p + W] = image
    out = sum(weight[:, u, w, None, None] * padded[:, u:u + H, w:w + W] for u in range(k) for w in range(k))
    return out if bias is None else out + bias[:, None, None]


def grouped_dense(weight: Tensor, groups: int) -> Tensor:
    """Weight (out, in/groups, 1) of a grouped 1×1 convolution as the dense block-diagonal (out, in) matrix."""
    out_ch, in_per_group, _ = weight.shape
    out_per_group = out_ch // groups
    dense = weight.new_zeros(out_ch, in_per_group * groups)
    for g in range(groups):
        dense[g * out_per_group:(g + 1) * out_per_group, g * in_per_group:(g + 1) * in_per_group] = \
            weight[g * out_per_group:(g + 1) * out_per_group, :, 0]
    return dense


def image_of(v: Tensor, grid: Tuple[int, int]) -> Tensor:
    """(h*w, C) row-major tokens -> (C, h, w)."""
    return v.T.reshape(v.shape[1], *grid)


def tokens_of(image: Tensor) -> Tensor:
    return image.reshape(image.shape[0], -1).T


def inline_weights(q: Tensor, k: Tensor) -> Tensor:
    """One head's (n, n) InLine attention matrix A_ij = (s/N)(q_i·k_j − q_i·k̄) + 1/N."""
    n, d = k.shape
    s = d ** -0.5
    return s / n * (q @ k.T - (q @ k.mean(0))[:, None]) + 1 / n


def reference_inline_group(attn, q, k, v, tokens, grid, num_prefix) -> Tensor:
    n, C = q.shape
    h = attn.num_heads
    d = C // h
    out = torch.zeros_like(v)
    for head in range(h):
        c = slice(head * d, (head + 1) * d)
        out[:, c] = inline_weights(q[:, c], k[:, c]) @ v[:, c]
    conv1, conv2 = attn.mixer.residual[0], attn.mixer.residual[2]
    hidden = F.gelu(grouped_dense(conv1.weight, h) @ tokens.mean(0) + conv1.bias)
    kernels = (grouped_dense(conv2.weight, h) @ hidden + conv2.bias).view(C, 3, 3)
    out[num_prefix:] += tokens_of(taps_conv(image_of(v[num_prefix:], grid), kernels))
    return out


def focus(x: Tensor, scale: Tensor, p: float) -> Tensor:
    t = (x.clamp(min=0) + 1e-6) / torch.log1p(torch.exp(scale))
    tp = t ** p
    return t.norm(dim=-1, keepdim=True) * tp / tp.norm(dim=-1, keepdim=True)


def flatten_weights(phi_q: Tensor, phi_k: Tensor) -> Tensor:
    """One head's (n, n) FLatten weights (φq_i·φk_j) / (Σ_j φq_i·φk_j + n·1e-6)."""
    scores = phi_q @ phi_k.T
    return scores / (scores.sum(1, keepdim=True) + phi_k.shape[0] * 1e-6)


def reference_flatten_group(attn, q, k, v, tokens, grid, num_prefix) -> Tensor:
    n, C = q.shape
    h = attn.num_heads
    d = C // h
    k = k.clone()
    k[num_prefix:] += attn.mixer.positional_encoding[0]
    scale = attn.mixer.scale[0, 0]
    phi_q, phi_k = focus(q, scale, attn.mixer.focusing_factor), focus(k, scale, attn.mixer.focusing_factor)
    out = torch.zeros_like(v)
    for head in range(h):
        c = slice(head * d, (head + 1) * d)
        out[:, c] = flatten_weights(phi_q[:, c], phi_k[:, c]) @ v[:, c]
        dwc = taps_conv(image_of(v[num_prefix:, c], grid), attn.mixer.dwc.weight[:, 0], attn.mixer.dwc.bias)
        out[num_prefix:, c] += tokens_of(dwc)
    return out


REFERENCE_GROUP = {'inline': reference_inline_group, 'flatten': reference_flatten_group}


def window_groups(grid, window, shift: int = 0) -> List[Tensor]:
    """Token indices of each window of the map rolled by -shift, row-major inside the window."""
    (H, W), (wh, ww) = grid, window
    groups = []
    for i in range(H // wh):
        for j in range(W // ww):
            rows = [(i * wh + a + shift) % H for a in range(wh)]
            cols = [(j * ww + b + shift) % W for b in range(ww)]
            groups.append(torch.tensor([r * W + c for r in rows for c in cols]))
    return groups


def reference_mix(attn, q, k, v, tokens, groups, group_grid, num_prefix, lepe=False) -> Tensor:
    mix_group = REFERENCE_GROUP[attn.attention_name]
    out = torch.zeros_like(v)
    for b in range(q.shape[0]):
        for idx in groups:
            part = mix_group(attn, q[b, idx], k[b, idx], v[b, idx], None if tokens is None else tokens[b, idx],
                             group_grid, num_prefix)
            if lepe:
                part[num_prefix:] += tokens_of(
                    taps_conv(image_of(v[b, idx][num_prefix:], group_grid), attn.get_v.weight[:, 0], attn.get_v.bias))
            out[b, idx] = part
    return out


def linear(x: Tensor, layer) -> Tensor:
    return x @ layer.weight.T + layer.bias


def reference_forward(module, x: Tensor, grid, *, num_prefix=0, window=None, shift=0, block_input=None) -> Tensor:
    """Full module output: qkv, grouping by explicit indices, the per-group formula (plus LePE), proj."""
    q, k, v = linear(x, module.qkv).chunk(3, dim=-1)
    tokens = x if block_input is None else block_input
    if not isinstance(module, CrossShapedAttention):
        if window is None:
            groups, group_grid = [torch.arange(x.shape[1])], grid
        else:
            groups, group_grid = window_groups(grid, window, shift), window
        out = reference_mix(module, q, k, v, tokens, groups, group_grid, num_prefix)
        return linear(out, module.proj)
    H, W = grid
    if len(module.attns) == 1:
        out = reference_mix(module.attns[0], q, k, v, tokens, [torch.arange(H * W)], grid, 0, lepe=True)
    else:
        c, split = DIM // 2, module.attns[0].window[1]
        parts = []
        for i, (attn, stripe) in enumerate(zip(module.attns, [(H, split), (split, W)])):
            sl = slice(i * c, (i + 1) * c)
            parts.append(reference_mix(attn, q[..., sl], k[..., sl], v[..., sl], tokens[..., sl],
                                       window_groups(grid, stripe), stripe, 0, lepe=True))
        out = torch.cat(parts, dim=-1)
    return linear(out, module.proj)


# ----------------------------------------------------------------------------------------------------------------
# full modules against the reference

def randomize(module, seed: int = 0, std: float = 0.3):
    """Every parameter non-zero random (the positional encoding, scale and residual weights included)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return module


CASES = {
    # name: (build kwargs, forward prefix tokens, reference kwargs)
    'global': (dict(), 0, dict()),
    'class_token': (dict(), 1, dict(num_prefix=1)),
    'shifted_windows': (dict(grouping='window', window_size=(2, 3), shift_size=1), 0, dict(window=(2, 3), shift=1)),
    'stripes': (dict(grouping='stripes', split_size=2), 0, dict()),
    'cswin_global': (dict(grouping='stripes', split_size=6), 0, dict()),
}


@pytest.mark.parametrize('case', list(CASES))
@pytest.mark.parametrize('name', ['inline', 'flatten'])
def test_module_matches_plain_formula(name, case):
    build_kwargs, num_prefix, ref_kwargs = CASES[case]
    module = randomize(build_attention(name, DIM, HEADS, GRID, **build_kwargs).double())
    torch.manual_seed(1)
    x = torch.randn(2, num_prefix + GRID[0] * GRID[1], DIM, dtype=torch.float64)
    with torch.no_grad():
        out = module(x, GRID)
        expected = reference_forward(module, x, GRID, **ref_kwargs)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize('split_size', [6, 2])
def test_inline_cswin_takes_the_mean_from_the_block_input(split_size):
    module = randomize(build_attention('inline', DIM, HEADS, GRID, grouping='stripes', split_size=split_size).double())
    torch.manual_seed(2)
    x = torch.randn(2, GRID[0] * GRID[1], DIM, dtype=torch.float64)
    block_input = 3 * torch.randn_like(x) + 1
    with torch.no_grad():
        out = module(x, GRID, block_input=block_input)
        expected = reference_forward(module, x, GRID, block_input=block_input)
        without = module(x, GRID)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    assert (out - without).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# implicit attention weights

def test_inline_weights_sum_to_one_and_are_injective():
    module = randomize(build_attention('inline', DIM, HEADS, GRID).double())
    torch.manual_seed(3)
    x = torch.randn(1, 1 + GRID[0] * GRID[1], DIM, dtype=torch.float64)
    q, k, _ = module.qkv(x).chunk(3, dim=-1)
    n, h, d = x.shape[1], HEADS, DIM // HEADS
    q, k = (t.view(1, n, h, d).transpose(1, 2) for t in (q, k))
    identity = torch.eye(n, dtype=torch.float64).expand(1, h, n, n)
    weights = inline_attention(q, k, identity, d ** -0.5)  # V = I turns the output into the weight matrix
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, h, n, dtype=torch.float64), rtol=0, atol=1e-12)
    for head in range(h):
        torch.testing.assert_close(weights[0, head], inline_weights(q[0, head], k[0, head]), rtol=0, atol=1e-12)
    assert (weights < 0).any()
    doubled = inline_attention(2 * q, k, identity, d ** -0.5)
    assert (doubled - weights).abs().max() > 1e-3  # a rescaled query gets other weights: the map is injective


def test_flatten_weights_are_non_negative_and_rows_miss_one_by_eps_only():
    module = randomize(build_attention('flatten', DIM, HEADS, GRID).double())
    torch.manual_seed(4)
    x = torch.randn(1, GRID[0] * GRID[1], DIM, dtype=torch.float64)
    q, k, _ = module.qkv(x).chunk(3, dim=-1)
    k = k + module.mixer.positional_encoding
    n, h = x.shape[1], HEADS
    phi_q, phi_k = (focused_feature_map(t, module.mixer.scale).view(1, n, h, -1).transpose(1, 2) for t in (q, k))
    identity = torch.eye(n, dtype=torch.float64).expand(1, h, n, n)
    weights = focused_linear_attention(phi_q, phi_k, identity)
    assert (weights >= 0).all()
    scores_sum = phi_q @ phi_k.sum(-2, keepdim=True).transpose(-2, -1)
    torch.testing.assert_close(weights.sum(-1, keepdim=True), scores_sum / (scores_sum + n * 1e-6),
                               rtol=0, atol=1e-12)
    assert (weights.sum(-1) < 1).all()
    without_eps = focused_linear_attention(phi_q, phi_k, identity, eps=0.)
    torch.testing.assert_close(without_eps.sum(-1), torch.ones(1, h, n, dtype=torch.float64), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# gradients and mixed precision

@pytest.mark.parametrize('name', ['inline', 'flatten'])
def test_gradcheck_input_and_parameters(name):
    grid = (2, 3)
    module = randomize(build_attention(name, 4, 2, grid).double(), seed=5, std=0.5)
    names = [n for n, _ in module.named_parameters()]
    torch.manual_seed(6)
    x = torch.randn(1, 1 + grid[0] * grid[1], 4, dtype=torch.float64, requires_grad=True)

    def run(x, *params):
        return torch.func.functional_call(module, dict(zip(names, params)), (x, grid))

    params = tuple(p.detach().clone().requires_grad_() for p in module.parameters())
    assert torch.autograd.gradcheck(run, (x, *params))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['inline', 'flatten'])
def test_autocast_forward_backward_finite_at_input_std_10(name, dtype):
    grid = (8, 8)
    module = randomize(build_attention(name, 32, 2, grid), seed=7, std=0.1)  # cubes reach ~1e6: past float16
    torch.manual_seed(7)
    x = (10 * torch.randn(2, 1 + grid[0] * grid[1], 32)).requires_grad_()
    reference = module(x, grid)
    with torch.autocast('cpu', dtype=dtype):
        out = module(x, grid)
    assert out.dtype == dtype
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())
    rel = (out.float() - reference).norm() / reference.norm()
    assert rel < 0.05


@pytest.mark.parametrize('p, x, scale', [
    (5., -0.5, 0.), (3., -0.5, 40.),  # every channel <= 0: (1e-6 / softplus(s))^p, whose squares underflow
    (6., 1e3, 0.), (12., 50., 0.),    # large features: powers whose squares overflow
])
def test_flatten_features_stay_finite_where_the_float64_formula_is(p, x, scale):
    """t^p / ‖t^p‖ taken in float32 as written gave inf or NaN (a norm that underflowed to 0) or zeros (one that
    overflowed) where the float64 formula is finite; the features equal it to float32 rounding."""
    torch.manual_seed(9)
    tokens = x * (1 + 0.1 * torch.rand(2, 5, 16))
    if x > 0:
        tokens[:, :, ::2] = -1.0  # half the channels cut by the ReLU
    scales = torch.full((16,), scale)
    features = focused_feature_map(tokens, scales, p)
    expected = focus(tokens.double(), scales.double(), p)
    assert torch.isfinite(expected).all() and torch.isfinite(features).all()
    torch.testing.assert_close(features.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_flatten_pure_functions_keep_half_inputs_finite():
    torch.manual_seed(8)
    q, k, v = (10 * torch.randn(3, 1, 256, 32)).half().unbind(0)
    scale = torch.zeros(32, dtype=torch.float16)
    phi_q, phi_k = (focused_feature_map(t, scale).view(1, 256, 2, 16).transpose(1, 2) for t in (q, k))
    out = focused_linear_attention(phi_q, phi_k, v.view(1, 256, 2, 16).transpose(1, 2))
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------------------------
# cost: linear in tokens, no N×N tensor

def count(fn: Callable[[], Tensor]) -> Tuple[int, int]:
    """(FLOPs, largest tensor) of fn()."""
    with torch.no_grad(), FlopCounterMode(display=False) as flops, DispatchRecorder() as record:
        fn()
    return flops.get_total_flops(), record.largest()


def pure_inline(side: int) -> Callable[[], Tensor]:
    q, k, v = torch.randn(3, 1, 2, side * side, 32).unbind(0)
    return lambda: inline_attention(q, k, v, 32 ** -0.5)


def pure_flatten(side: int) -> Callable[[], Tensor]:
    q, k, v = torch.randn(3, 1, side * side, 64).unbind(0)
    scale = torch.zeros(64)

    def run():
        phi_q, phi_k = (focused_feature_map(t, scale).view(1, -1, 2, 32).transpose(1, 2) for t in (q, k))
        return focused_linear_attention(phi_q, phi_k, v.view(1, -1, 2, 32).transpose(1, 2))
    return run


def module_forward(name: str, side: int) -> Callable[[], Tensor]:
    module = build_attention(name, 64, 2, (side, side))
    x = torch.randn(1, side * side, 64)
    return lambda: module(x, (side, side))


@pytest.mark.parametrize('make', [
    pure_inline, pure_flatten,
    lambda side: module_forward('inline', side), lambda side: module_forward('flatten', side),
], ids=['inline_attention', 'flatten_functions', 'inline_module', 'flatten_module'])
def test_cost_is_linear_in_tokens(make):
    small_flops, _ = count(make(32))
    large_flops, largest = count(make(64))
    n = 64 * 64
    assert small_flops > 0
    assert 4 / 1.1 <= large_flops / small_flops <= 4 * 1.1
    assert largest < n * n // 8


@pytest.mark.parametrize('name', ['inline', 'flatten'])
def test_linear_flags(name):
    assert not forms_score_matrix(name)


# ----------------------------------------------------------------------------------------------------------------
# permutation equivariance of the global terms

def test_inline_global_term_is_permutation_equivariant():
    torch.manual_seed(9)
    q, k, v = torch.randn(3, 2, 2, 24, 8, dtype=torch.float64).unbind(0)
    perm = torch.randperm(24)
    out = inline_attention(q, k, v, 8 ** -0.5)
    permuted = inline_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], 8 ** -0.5)
    torch.testing.assert_close(permuted, out[:, :, perm], rtol=0, atol=1e-12)


def test_flatten_without_position_terms_is_permutation_equivariant():
    module = randomize(build_attention('flatten', DIM, HEADS, GRID).double())
    with torch.no_grad():
        module.mixer.positional_encoding.zero_()
        module.mixer.dwc.weight.zero_()
        module.mixer.dwc.bias.zero_()
    torch.manual_seed(10)
    x = torch.randn(2, GRID[0] * GRID[1], DIM, dtype=torch.float64)
    perm = torch.randperm(x.shape[1])
    with torch.no_grad():
        out = module(x, GRID)
        permuted = module(x[:, perm], GRID)
    torch.testing.assert_close(permuted, out[:, perm], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# bad input, initialisation and checkpoint names

def test_flatten_needs_grid_size():
    with pytest.raises(ValueError, match=r"flatten attention: the positional encoding needs a fixed token grid"):
        build_attention('flatten', DIM, HEADS)


@pytest.mark.parametrize('size', [(3, 3), (6, 4)])
def test_flatten_on_another_grid_resamples_its_positional_encoding_bicubically(size):
    torch.manual_seed(0)
    module = build_attention('flatten', DIM, HEADS, GRID)
    torch.nn.init.normal_(module.mixer.positional_encoding)
    encoding = module.mixer.positional_encoding.reshape(1, *GRID, DIM).permute(0, 3, 1, 2)
    resampled = F.interpolate(encoding, size=size, mode='bicubic', align_corners=False)
    sized = build_attention('flatten', DIM, HEADS, size)
    sized.load_state_dict(dict(module.state_dict(), positional_encoding=resampled.flatten(2).mT))
    x = torch.randn(2, size[0] * size[1], DIM)
    with torch.no_grad():
        assert torch.equal(module(x, size), sized(x, size))
        module.set_grid(size)
        assert torch.equal(module.mixer.positional_encoding, sized.mixer.positional_encoding)


def test_inline_mixer_needs_tokens():
    module = build_attention('inline', DIM, HEADS, GRID)
    q = torch.randn(1, 24, DIM)
    with pytest.raises(ValueError, match=r"inline attention needs the grouped attention input \(MixContext.tokens\)"):
        module.mixer(q, q, q, MixContext(GRID))


def test_inline_rejects_spatial_reduction():
    with pytest.raises(ValueError, match="sr_ratio 2 needs"):
        build_attention('inline', DIM, HEADS, GRID, grouping='reduction', sr_ratio=2)


def test_initial_parameters():
    flatten = build_attention('flatten', DIM, HEADS, GRID, grouping='window', window_size=(2, 3),
                              attn_kwargs=dict(kernel_size=3))
    assert flatten.mixer.scale.shape == (1, 1, DIM) and not flatten.mixer.scale.any()
    assert flatten.mixer.positional_encoding.shape == (1, 6, DIM) and not flatten.mixer.positional_encoding.any()
    assert flatten.mixer.dwc.weight.shape == (DIM // HEADS, 1, 3, 3) and flatten.mixer.dwc.bias.shape == (DIM // HEADS,)
    inline = build_attention('inline', DIM, HEADS, GRID)
    shapes = {k: tuple(v.shape) for k, v in inline.state_dict().items() if k.startswith('residual')}
    assert shapes == {'residual.0.weight': (DIM, DIM // HEADS, 1), 'residual.0.bias': (DIM,),
                      'residual.2.weight': (9 * DIM, DIM // HEADS, 1), 'residual.2.bias': (9 * DIM,)}
    # PyTorch's default init, as the official models keep
    for conv in (inline.mixer.residual[0], inline.mixer.residual[2]):
        bound = (DIM // HEADS) ** -0.5
        assert conv.weight.abs().max() <= bound and conv.bias.abs().max() <= bound
        assert conv.weight.std() > bound / 4 and conv.bias.any()


@pytest.mark.parametrize('file, prefix, name, dim, heads, grid', [
    ('inline_deit_tiny_like', 'blocks.0.attn.', 'inline', 64, 2, (4, 4)),
    ('flatten_swin_like_LLSS', 'layers.0.blocks.0.attn.', 'flatten', 16, 1, (56, 56)),
    ('flatten_swin_like_LLSS', 'layers.1.blocks.0.attn.', 'flatten', 32, 2, (28, 28)),
])
def test_official_attention_weights_load_strictly(file, prefix, name, dim, heads, grid):
    state = load_golden(file)['state_dict']
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    module = build_attention(name, dim, heads, grid)
    module.load_state_dict(weights, strict=True)
