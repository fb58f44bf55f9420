"""Causal attention (`causal=True`): every causal form against the masked quadratic formula written here in float64,
gradients, numerical stability, linear cost of the linear forms, and the one-line refusals."""
import math

import pytest
import timm
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.utils.flop_counter import FlopCounterMode

import models  # noqa: F401  (registers the families)
from models.attention import build_attention
from models.attention.additive import causal_additive_pool
from models.attention.linear import causal_linear_attention
from models.attention.multimax import multimax_attention
from models.attention.softmax import softmax_attention
from dispatch import DispatchRecorder
from reference import (
    SPEC_RANGES, SPEC_TS, dense, later_keys, max_abs_err, naive_causal_softmax, naive_sigma,
)

CAUSAL = ('softmax', 'multimax', 'additive', 'linear')
DIM, HEADS = 16, 4


def build64(name, grouping='global', **kwargs):
    torch.manual_seed(0)
    attn = build_attention(name, DIM, HEADS, (3, 4), grouping=grouping, attn_kwargs=dict(causal=True),
                           **kwargs).double()
    if name == 'multimax':
        with torch.no_grad():
            attn.mixer.ranges.copy_(torch.tensor(SPEC_RANGES))
            attn.mixer.ts.copy_(torch.tensor(SPEC_TS))
    return attn


def heads_of(t, j):
    d = t.shape[-1] // HEADS
    return t[..., j * d:(j + 1) * d]


def naive_pool(x, logits):
    """(B, n, C), (B, n, heads) -> (B, n, C): row i averages x_l, l ≤ i, with the masked softmax of the logits."""
    n = x.shape[1]
    weights = naive_causal_softmax(logits.transpose(1, 2).unsqueeze(-2).expand(-1, -1, n, -1))  # (B, h, n, n)
    d = x.shape[-1] // logits.shape[-1]
    return torch.cat([weights[:, j] @ x[..., j * d:(j + 1) * d] for j in range(logits.shape[-1])], dim=-1)


def naive_linear(q, k, v):
    """One head: (n, d), (n, d), (n, e) -> rows Σ_{j≤i} (φqᵢ·φkⱼ) vⱼ / (Σ_{j≤i} φqᵢ·φkⱼ + 1e-6)."""
    phi_q = torch.where(q > 0, q + 1, torch.exp(q))
    phi_k = torch.where(k > 0, k + 1, torch.exp(k))
    scores = (phi_q @ phi_k.transpose(-2, -1)).masked_fill(later_keys(q.shape[-2]), 0.)
    return scores @ v / (scores.sum(dim=-1, keepdim=True) + 1e-6)


def naive_causal_module(attn, x):
    """The whole causal attention (projections included) with explicit n×n masked matrices."""
    qkv = dense(x, attn.qkv)
    q, k, v = qkv.chunk(3, dim=-1)
    name = attn.attention_name
    if name == 'additive':
        mixer = attn.mixer
        scale = 1 / math.sqrt(DIM // HEADS)
        global_query = naive_pool(q, dense(q, mixer.query_att) * scale)
        p = k * global_query
        global_key = naive_pool(p, dense(p, mixer.key_att) * scale)
        return dense(dense(global_key * v, mixer.transform) + q, attn.proj)
    outs = []
    for j in range(HEADS):
        qj, kj, vj = heads_of(q, j), heads_of(k, j), heads_of(v, j)
        if name == 'linear':
            outs.append(naive_linear(qj, kj, vj))
            continue
        scores = qj @ kj.transpose(-2, -1) / math.sqrt(qj.shape[-1])
        if name == 'multimax':
            scores = naive_sigma(scores, attn.mixer.ranges, attn.mixer.ts)
        outs.append(naive_causal_softmax(scores) @ vj)
    return dense(torch.cat(outs, dim=-1), attn.proj)


# ---------------------------------------------------------------- every causal form equals the masked formula

@pytest.mark.parametrize('name', CAUSAL)
def test_causal_module_matches_the_masked_formula_with_a_class_token(name):
    """1 + 10×10 tokens: the chunked forms (chunks of 64) cross a chunk boundary and end in a partial chunk."""
    attn = build64(name)
    x = 2 * torch.randn(2, 1 + 100, DIM, dtype=torch.float64)
    assert max_abs_err(attn(x, (10, 10)), naive_causal_module(attn, x)) < 1e-10


@pytest.mark.filterwarnings('ignore:`torch.jit.script` is deprecated')
@pytest.mark.parametrize('name', CAUSAL)
def test_scripted_causal_module_matches_the_masked_formula(name):
    """TorchScript takes each attention's plain path: causal there too (MultiMax's let later tokens in)."""
    attn = build64(name)
    x = 2 * torch.randn(2, 1 + 100, DIM, dtype=torch.float64)
    assert max_abs_err(torch.jit.script(attn)(x, (10, 10)), naive_causal_module(attn, x)) < 1e-10


@pytest.mark.parametrize('name', CAUSAL)
def test_causal_output_ignores_later_tokens_in_global_and_unreduced_reduction_grouping(name):
    for grouping in ('global', 'reduction'):
        attn = build64(name, grouping)
        x = torch.randn(2, 12, DIM, dtype=torch.float64)
        changed = x.clone()
        changed[:, 7:] = torch.randn(2, 5, DIM, dtype=torch.float64)
        out, out_changed = attn(x, (3, 4)), attn(changed, (3, 4))
        assert torch.equal(out[:, :7], out_changed[:, :7]), (name, grouping)
        assert (out[:, 7:] - out_changed[:, 7:]).abs().amin(dim=-1).gt(0).all(), (name, grouping)


@pytest.mark.parametrize('chunk_size', [1, 3, 4, 13, 64])
def test_causal_additive_pool_matches_masked_softmax_for_every_chunking(chunk_size):
    torch.manual_seed(chunk_size)
    x = torch.randn(2, 13, 6, dtype=torch.float64)
    logits = 20 * torch.randn(2, 13, 3, dtype=torch.float64)
    assert max_abs_err(causal_additive_pool(x, logits, chunk_size), naive_pool(x, logits)) < 1e-12


@pytest.mark.parametrize('chunk_size', [1, 3, 4, 13, 64])
def test_causal_linear_attention_matches_masked_formula_for_every_chunking(chunk_size):
    torch.manual_seed(chunk_size)
    q, k, v = (3 * torch.randn(2, 2, 13, 4, dtype=torch.float64) for _ in range(3))
    out = causal_linear_attention(q, k, v, chunk_size=chunk_size)
    for b in range(2):
        for j in range(2):
            assert max_abs_err(out[b, j], naive_linear(q[b, j], k[b, j], v[b, j])) < 1e-12


def test_causal_softmax_function_with_and_without_a_bias():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(3, 7, 7, dtype=torch.float64)
    scores = q @ k.transpose(-2, -1) / 2
    assert max_abs_err(softmax_attention(q, k, v, causal=True), naive_causal_softmax(scores) @ v) < 1e-12
    assert max_abs_err(softmax_attention(q, k, v, bias, causal=True), naive_causal_softmax(scores + bias) @ v) < 1e-12


def multimax_inputs(requires_grad=False):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 3, dtype=torch.float64, requires_grad=requires_grad) for _ in range(3))
    ranges = torch.tensor(SPEC_RANGES, dtype=torch.float64, requires_grad=requires_grad)
    ts = torch.tensor(SPEC_TS, dtype=torch.float64, requires_grad=requires_grad)
    return q, k, v, ranges, ts


def differentiable_sigma(x, b, t):
    return (x + t[0] * (b[0] - x).clamp(min=0) + t[1] * (x - b[1]).clamp(min=0)
            + t[2] * (b[2] - x).clamp(min=0) ** 2 + t[3] * (x - b[3]).clamp(min=0) ** 2)


def naive_causal_multimax(q, k, v, ranges, ts):
    scores = 3 * q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return naive_causal_softmax(differentiable_sigma(scores, ranges, ts)) @ v


def row_blocks(monkeypatch, rows):
    """Make MultiMax's plain path take `rows` query rows per block (2 images, 2 heads, 7 keys), in training too."""
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', rows * 2 * 2 * 7 * 4)
    monkeypatch.setattr('models.attention.multimax._PLAIN_TRAINING_BYTES', 0)


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')  # its CPU reference, on purpose
@pytest.mark.parametrize('path', ['plain', 'row_blocks', 'flex'])
def test_causal_multimax_masks_after_sigma_on_every_path(monkeypatch, path):
    """σ of the spec's parameters maps very negative scores to large positive ones; masking before σ would give
    NaN (σ(−inf)), masking a finite score before σ would let it back in. Forward and gradients on every path."""
    q, k, v, ranges, ts = multimax_inputs(requires_grad=True)
    if path == 'row_blocks':
        row_blocks(monkeypatch, rows=3)
    out = multimax_attention(3 * q, k, v, ranges, ts, use_flex=path == 'flex', causal=True)
    expected = naive_causal_multimax(q, k, v, ranges, ts)
    assert max_abs_err(out, expected) < 1e-12
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, ranges, ts))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v, ranges, ts))
    for grad, expected_grad in zip(grads, expected_grads):
        assert max_abs_err(grad, expected_grad) < 1e-10


def test_causal_multimax_inference_in_row_blocks(monkeypatch):
    q, k, v, ranges, ts = multimax_inputs()
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', 2 * 2 * 2 * 7 * 4)
    with torch.no_grad():
        out = multimax_attention(3 * q, k, v, ranges, ts, use_flex=False, causal=True)
    assert max_abs_err(out, naive_causal_multimax(q, k, v, ranges, ts)) < 1e-12


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize('name', CAUSAL)
def test_causal_module_gradcheck(name):
    attn = build64(name)
    x = torch.randn(1, 1 + 4, DIM, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: attn(t, (2, 2)), (x,))


def test_causal_function_gradchecks_across_chunks():
    torch.manual_seed(0)
    x = torch.randn(1, 5, 2, dtype=torch.float64, requires_grad=True)
    logits = (3 * torch.randn(1, 5, 1, dtype=torch.float64)).requires_grad_()
    assert gradcheck(lambda a, b: causal_additive_pool(a, b, chunk_size=2), (x, logits))
    q, k, v = (torch.randn(1, 1, 5, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert gradcheck(lambda a, b, c: causal_linear_attention(a, b, c, chunk_size=2), (q, k, v))
    assert gradcheck(lambda a, b, c: softmax_attention(a, b, c, causal=True), (q, k, v))


def test_causal_multimax_row_blocks_gradcheck_and_second_derivatives(monkeypatch):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ranges = torch.tensor(SPEC_RANGES, dtype=torch.float64, requires_grad=True)
    ts = torch.tensor(SPEC_TS, dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', 2 * 3 * 4)
    monkeypatch.setattr('models.attention.multimax._PLAIN_TRAINING_BYTES', 0)

    def attention(q, k, v, ranges, ts):
        return multimax_attention(3 * q, k, v, ranges, ts, use_flex=False, causal=True)

    assert type(attention(q, k, v, ranges, ts).grad_fn).__name__ == '_MultiMaxInRowBlocksBackward'
    assert gradcheck(attention, (q, k, v, ranges, ts))
    assert gradgradcheck(attention, (q, k, v, ranges, ts))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', CAUSAL)
def test_causal_autocast_outputs_and_grads_finite(name, dtype):
    torch.manual_seed(0)
    attn = build_attention(name, 32, 2, (9, 9), attn_kwargs=dict(causal=True))
    x = (10 * torch.randn(2, 1 + 81, 32)).requires_grad_()
    with torch.autocast('cpu', dtype=dtype):
        out = attn(x, (9, 9))
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for pname, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


# ---------------------------------------------------------------- numerical stability of the prefix pools

def plain_prefix_pool(x, logits):
    """The textbook prefix-sum form sᵢ = Σ_{l≤i} e^{a_l} x_l, zᵢ = Σ_{l≤i} e^{a_l}, gᵢ = sᵢ / zᵢ (one head)."""
    e = logits.exp()
    return (e * x).cumsum(dim=1) / e.cumsum(dim=1)


def test_prefix_pool_is_stable_where_plain_prefix_sums_overflow_or_divide_zero_by_zero():
    """Logits of ±1000 (e^710 is float64's limit): plain exponential prefix sums overflow, and shifting them by
    the global maximum makes the early prefixes 0/0; the pooled values stay finite and equal the masked softmax."""
    torch.manual_seed(0)
    logits = torch.tensor([-900., -905., 0., 3., 800., 795., -1000., 1000., 999., 20., -3., 990., 1000.],
                          dtype=torch.float64).view(1, 13, 1)
    x = torch.randn(1, 13, 3, dtype=torch.float64)
    assert not torch.isfinite(plain_prefix_pool(x, logits)).all()
    assert not torch.isfinite(plain_prefix_pool(x, logits - logits.max())).all()
    expected = naive_pool(x, logits)
    for chunk_size in (1, 4, 64):
        pooled = causal_additive_pool(x, logits, chunk_size)
        assert torch.isfinite(pooled).all()
        assert max_abs_err(pooled, expected) < 1e-12


def test_prefix_pool_in_float32_with_logits_beyond_its_exp_range():
    torch.manual_seed(0)
    x = torch.randn(2, 300, 8, dtype=torch.float64)
    logits = 200 * torch.randn(2, 300, 2, dtype=torch.float64)
    assert not torch.isfinite(plain_prefix_pool(x[..., :4].float(), logits[..., :1].float())).all()
    pooled = causal_additive_pool(x.float(), logits.float())
    assert pooled.dtype == torch.float32
    assert max_abs_err(pooled.double(), naive_pool(x, logits)) < 1e-5


# ---------------------------------------------------------------- linear cost of the linear forms

def count_flops(name, n):
    with torch.device('meta'):
        attn = build_attention(name, 64, 4, None, attn_kwargs=dict(causal=True))
        x = torch.empty(1, n, 64)
    with FlopCounterMode(display=False) as counter:
        attn(x, (1, n))
    return counter.get_total_flops()


def largest_tensor(name, n):
    attn = build_attention(name, 64, 4, None, attn_kwargs=dict(causal=True))
    x = torch.randn(1, n, 64, requires_grad=True)
    with DispatchRecorder() as record:
        attn(x, (1, n)).sum().backward()
    return record.largest()


@pytest.mark.parametrize('name', ['additive', 'linear'])
def test_causal_linear_forms_grow_linearly_in_flops_and_memory(name):
    """FLOPs (matrix products; the counter counts no cumulative sums) and the largest tensor of the forward and
    backward passes, 1,024 -> 4,096 tokens: both within 1.1× of 4×, and nothing near 4,096² elements."""
    assert 4 / 1.1 <= count_flops(name, 4096) / count_flops(name, 1024) <= 4 * 1.1
    small, large = largest_tensor(name, 1024), largest_tensor(name, 4096)
    assert 4 / 1.1 <= large / small <= 4 * 1.1
    assert large < 4096 * 4096 / 8


def test_causal_softmax_stays_quadratic():
    assert count_flops('softmax', 4096) / count_flops('softmax', 1024) > 8


# ---------------------------------------------------------------- refusals and the model-level option

@pytest.mark.parametrize('name, message', [
    ('sima', "sima attention has no causal form: its ℓ1 normalisation of queries and keys sums over all tokens, "
             "later ones included"),
    ('inline', "inline attention has no causal form: its local residual is a 2-D convolution over the grid, with "
               "kernels and a mean key taken from all tokens"),
    ('flatten', "flatten attention has no causal form: its depthwise 2-D convolution of V mixes every token with "
                "its neighbours on all sides of the grid"),
])
def test_attentions_without_a_causal_form_refuse_it_in_one_line(name, message):
    with pytest.raises(ValueError) as info:
        build_attention(name, DIM, HEADS, (3, 4), attn_kwargs=dict(causal=True))
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        timm.create_model(f'{name}_deit_tiny', img_size=32, patch_size=16, attn_kwargs=dict(causal=True))
    assert str(info.value) == message
    build_attention(name, DIM, HEADS, (3, 4), attn_kwargs=dict(causal=False))


REFUSED_GROUPINGS = [
    ('window', dict(window_size=2), "tokens within windows of the grid"),
    ('stripes', dict(split_size=1), "tokens within stripes of the grid"),
    ('reduction', dict(sr_ratio=2), "queries with keys pooled from patches of the grid"),
    ('reduction', dict(pool_size=2), "queries with keys pooled from patches of the grid"),
]


@pytest.mark.parametrize('grouping, kwargs, what', REFUSED_GROUPINGS)
@pytest.mark.parametrize('name', CAUSAL)
def test_groupings_without_one_token_order_refuse_causal_in_one_line(name, grouping, kwargs, what):
    with pytest.raises(ValueError) as info:
        build_attention(name, DIM, HEADS, (4, 4), grouping=grouping, attn_kwargs=dict(causal=True), **kwargs)
    assert str(info.value) == (f"causal=True needs one sequence of tokens (grouping 'global', or 'reduction' with "
                               f"sr_ratio=1 and no pool_size); grouping {grouping!r} mixes {what}, where token order "
                               f"has no meaning")


def test_windowed_families_refuse_causal():
    with pytest.raises(ValueError, match="grouping 'window' mixes tokens within windows"):
        timm.create_model('softmax_swin_tiny', img_size=64, window_size=2, attn_kwargs=dict(causal=True))


PVT_TINY = dict(img_size=64, embed_dims=[16, 32, 32, 32], num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2],
                depths=[1, 1, 1, 1], num_classes=5)


@pytest.mark.parametrize('name', ['additive', 'linear'])
@pytest.mark.parametrize('family, what', [
    ('pvt_tiny', 'PVT merges patches of the grid between its stages'),
    ('pvt_v2_b0', "PVT v2 embeds overlapping patches of the grid between its stages and mixes neighbouring tokens"),
])
def test_pyramids_refuse_causal_though_their_linear_stages_are_global(name, family, what):
    """A pyramid of global linear attentions (sr_ratio 1 in every stage) has no token order across its stages:
    a PVT v2 output token moved with earlier tokens, a PVT class token saw only itself."""
    for kwargs in (dict(attn_kwargs=dict(causal=True)), dict(causal=True)):
        with pytest.raises(ValueError, match=f"^causal=True needs one sequence of tokens in order; {what}"):
            timm.create_model(f'{name}_{family}', **PVT_TINY, **kwargs)


@pytest.mark.parametrize('name', CAUSAL)
def test_a_causal_deit_does_not_classify_from_its_class_token(name):
    """The class token comes first and sees only itself: a classifier on it gave every image the same logits. A
    causal DeiT pools the patch tokens by default and refuses a classifier on the class token; its features and
    its class token's output remain."""
    message = (r"^global_pool 'token' classifies from the class token, which under causal=True comes first and sees "
               r"only itself; expected one of 'avg', 'max', 'avgmax'$")
    tiny = dict(img_size=32, patch_size=16, depth=2, embed_dim=16, num_heads=2, causal=True, class_token=True)
    model = timm.create_model(f'{name}_deit_tiny', num_classes=3, **tiny).eval()
    x = torch.randn(2, 3, 32, 32)
    assert model.global_pool == 'avg' and model(x).shape == (2, 3)
    with pytest.raises(ValueError, match=message):
        timm.create_model(f'{name}_deit_tiny', num_classes=3, global_pool='token', **tiny)
    with pytest.raises(ValueError, match=message):
        model.reset_classifier(3, 'token')
    assert model.global_pool == 'avg'
    model.reset_classifier(0, 'token')
    assert model(x).shape == (2, 16)
    features = timm.create_model(f'{name}_deit_tiny', features_only=True, out_indices=(0, 1), **tiny)
    assert [f.shape for f in features(x)] == [(2, 16, 2, 2)] * 2


@pytest.mark.parametrize('name', CAUSAL)
def test_create_model_passes_causal_to_every_block(name):
    for kwargs in (dict(attn_kwargs=dict(causal=True)), dict(causal=True)):
        model = timm.create_model(f'{name}_deit_tiny', img_size=32, patch_size=16, depth=2, num_classes=3,
                                  global_pool='avg', **kwargs)
        assert [block.attn.mixer.causal for block in model.blocks] == [True, True]
        assert 'causal=True' in repr(model.blocks[0].attn.mixer)
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_an_attention_without_the_option_refuses_causal_instead_of_ignoring_it(monkeypatch):
    """One attn_kwargs dict serves every attention of a model; one that does not declare `causal` would silently
    mix later tokens into a model built as causal."""
    from models.attention import Mixer, registry

    class NoOptions(Mixer):
        attention_name = 'no_options'

        def forward(self, q, k, v, ctx):
            return v

    monkeypatch.setitem(registry._MIXERS, 'no_options', NoOptions)
    build_attention('no_options', DIM, HEADS, (3, 4), attn_kwargs=dict(causal=False))
    with pytest.raises(ValueError) as info:
        build_attention('no_options', DIM, HEADS, (3, 4), attn_kwargs=dict(causal=True))
    assert str(info.value) == "no_options attention takes no causal option, so it cannot serve causal=True"


def test_causal_linear_attention_refuses_queries_and_keys_of_other_lengths():
    """Five queries over three keys returned three rows, in silence."""
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match='^causal linear attention takes as many queries as keys and values, got 5 '
                                         'queries, 3 keys and 3 values$'):
        causal_linear_attention(q, k, v)


@pytest.mark.filterwarnings('ignore:`torch.jit.script` is deprecated')
def test_causal_functions_compile_with_torchscript_and_match_eager():
    torch.manual_seed(0)
    x, logits = torch.randn(2, 9, 6), 5 * torch.randn(2, 9, 3)
    q, k, v = torch.randn(3, 2, 2, 9, 4).unbind(0)
    torch.testing.assert_close(torch.jit.script(causal_additive_pool)(x, logits, 4), causal_additive_pool(x, logits, 4))
    torch.testing.assert_close(torch.jit.script(causal_linear_attention)(q, k, v, 1e-6, 4),
                               causal_linear_attention(q, k, v, chunk_size=4))
    torch.testing.assert_close(torch.jit.script(softmax_attention)(q, k, v, None, 0., True),
                               softmax_attention(q, k, v, causal=True))
