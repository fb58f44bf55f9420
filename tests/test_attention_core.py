"""Softmax, MultiMax, SimA and additive attention against plain float64 formulas written here."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.utils.flop_counter import FlopCounterMode

from models.analysis import record_attention
from models.attention import Mixer, build_attention, list_attentions, register_attention, registry
from models.attention.softmax import SoftmaxMixer
from models.attention.additive import additive_pool
from models.attention.layout import split_heads
from models.attention.multimax import multimax_attention, multimax_modulation
from models.attention.sima import l1_normalize_tokens, sima_attention
from reference import SPEC_RANGES, SPEC_TS, dense, max_abs_err, naive_l1, naive_sigma, naive_softmax

CORE = ('softmax', 'multimax', 'sima', 'additive')


def naive_module(attn, x, head_weights):
    """qkv, per head `head_weights(q_h, k_h)` (n, m) times v_h, concatenated, proj."""
    C = x.shape[-1]
    d = C // attn.num_heads
    qkv = dense(x, attn.qkv)
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    out = torch.zeros_like(q)
    for j in range(attn.num_heads):
        part = slice(j * d, (j + 1) * d)
        out[..., part] = head_weights(q[..., part], k[..., part]) @ v[..., part]
    return dense(out, attn.proj)


def dot_weights(attn):
    def weights(q, k):
        s = torch.einsum('bnc,bmc->bnm', q, k) / math.sqrt(q.shape[-1])
        if attn.attention_name == 'multimax':
            s = naive_sigma(s, attn.mixer.ranges, attn.mixer.ts)
        return naive_softmax(s)
    return weights


def sima_weights(q, k):
    return naive_l1(q) @ naive_l1(k).transpose(-2, -1)


def naive_additive(attn, x):
    """Fastformer with explicit loops over batch, heads and tokens."""
    B, n, C = x.shape
    h = attn.num_heads
    d = C // h
    qkv = dense(x, attn.qkv)
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    wq, bq = attn.mixer.query_att.weight, attn.mixer.query_att.bias
    wk, bk = attn.mixer.key_att.weight, attn.mixer.key_att.bias

    def pool(vectors, w, bias):
        pooled = torch.zeros(C, dtype=x.dtype)
        for j in range(h):
            scores = torch.stack([(w[j] @ vectors[i] + bias[j]) / math.sqrt(d) for i in range(n)])
            weights = torch.exp(scores - scores.max())
            weights = weights / weights.sum()
            for i in range(n):
                pooled[j * d:(j + 1) * d] += weights[i] * vectors[i][j * d:(j + 1) * d]
        return pooled

    out = torch.zeros_like(x)
    for b in range(B):
        global_query = pool(q[b], wq, bq)
        p = [k[b, i] * global_query for i in range(n)]
        global_key = pool(p, wk, bk)
        for i in range(n):
            o = attn.mixer.transform.weight @ (global_key * v[b, i]) + attn.mixer.transform.bias + q[b, i]
            out[b, i] = attn.proj.weight @ o + attn.proj.bias
    return out


def build64(name, dim=16, num_heads=4, grid=(3, 4), **kwargs):
    torch.manual_seed(0)
    attn = build_attention(name, dim, num_heads, grid, **kwargs).double()
    if name == 'multimax':
        with torch.no_grad():
            attn.mixer.ranges.copy_(torch.tensor(SPEC_RANGES))
            attn.mixer.ts.copy_(torch.tensor(SPEC_TS))
    return attn


# ---------------------------------------------------------------- softmax and MultiMax

@pytest.mark.parametrize('name', ['softmax', 'multimax'])
def test_dot_attention_matches_naive_with_class_token(name):
    attn = build64(name)
    x = 2 * torch.randn(2, 1 + 12, 16, dtype=torch.float64)
    err = max_abs_err(attn(x, (3, 4)), naive_module(attn, x, dot_weights(attn)))
    assert err < 1e-10


def test_multimax_modulation_matches_spec_vector():
    x = torch.tensor([-2., -1., 0., 0.15, 1., 3.], dtype=torch.float64)
    ranges = torch.tensor(SPEC_RANGES, dtype=torch.float64)
    ts = torch.tensor(SPEC_TS, dtype=torch.float64)
    sigma = multimax_modulation(x, ranges, ts)
    expected_sigma = torch.tensor([-0.372, -0.352, 0.05, 0.15, 1.276, 4.516], dtype=torch.float64)
    assert max_abs_err(sigma, expected_sigma) < 1e-12
    expected = torch.tensor([0.006987, 0.007129, 0.010656, 0.011776, 0.036310, 0.927141], dtype=torch.float64)
    assert max_abs_err(sigma.softmax(-1), expected) < 1e-6
    plain = torch.tensor([0.005314, 0.014444, 0.039264, 0.045618, 0.106730, 0.788631], dtype=torch.float64)
    assert max_abs_err(x.softmax(-1), plain) < 1e-6


def test_multimax_with_zero_parameters_is_softmax():
    scores = 30 * torch.randn(4, 50, dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.float64)
    assert torch.equal(multimax_modulation(scores, zeros, zeros), scores)

    multimax, softmax = build64('multimax'), build64('softmax')
    with torch.no_grad():
        multimax.mixer.ranges.zero_()
        multimax.mixer.ts.zero_()
    softmax.load_state_dict({k: v for k, v in multimax.state_dict().items() if k not in ('ranges', 'ts')})
    x = 2 * torch.randn(2, 13, 16, dtype=torch.float64)
    assert max_abs_err(multimax(x, (3, 4)), softmax(x, (3, 4))) < 1e-12


def test_multimax_gradients_at_zero_init():
    attn = build64('multimax')
    with torch.no_grad():
        attn.mixer.ranges.zero_()
        attn.mixer.ts.zero_()
    x = 2 * torch.randn(2, 13, 16, dtype=torch.float64)
    (attn(x, (3, 4)) * torch.randn(2, 13, 16, dtype=torch.float64)).sum().backward()
    assert torch.equal(attn.mixer.ranges.grad, torch.zeros(4, dtype=torch.float64))
    assert (attn.mixer.ts.grad != 0).all()


def test_multimax_parameters_shape_and_init():
    torch.manual_seed(0)
    values = []
    for _ in range(300):
        attn = build_attention('multimax', 4, 1)
        assert attn.mixer.ranges.shape == (4,) and attn.mixer.ts.shape == (4,)
        values += [attn.mixer.ranges.detach(), attn.mixer.ts.detach()]
    values = torch.cat(values)
    assert abs(values.std().item() - 0.02) < 0.002
    assert abs(values.mean().item()) < 0.002


# ---------------------------------------------------------------- SimA

@pytest.mark.parametrize('grid', [(3, 4), (4, 5)], ids=['quadratic-order', 'linear-order'])
def test_sima_matches_naive_with_class_token(grid):
    attn = build64('sima', dim=32, num_heads=2, grid=grid)
    x = torch.randn(2, 1 + grid[0] * grid[1], 32, dtype=torch.float64)
    err = max_abs_err(attn(x, grid), naive_module(attn, x, sima_weights))
    assert err < 1e-12


@pytest.mark.parametrize('n, m, quadratic', [(13, 13, True), (15, 8, True), (16, 8, False), (40, 40, False)])
def test_sima_order_follows_shapes_and_both_agree(n, m, quadratic):
    torch.manual_seed(0)
    d = 16
    q = torch.randn(2, 3, n, d, dtype=torch.float64)
    k, v = torch.randn(2, 2, 3, m, d, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        out = sima_attention(q, k, v)
    per_head = 2 * (n * m * d + n * m * d) if quadratic else 2 * (m * d * d + n * d * d)
    assert counter.get_total_flops() == 2 * 3 * per_head
    assert max_abs_err(out, sima_weights(q, k) @ v) < 1e-12
    assert max_abs_err(out, naive_l1(q) @ (naive_l1(k).transpose(-2, -1) @ v)) < 1e-12


def test_sima_l1_normalization_of_zero_channel_is_zero_in_half_precision():
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(2, 5, 4).to(dtype)
        x[:, :, 1] = 0
        out = l1_normalize_tokens(x)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert (out[:, :, 1] == 0).all()
        assert max_abs_err(out.double(), naive_l1(x.double())) < 1e-2


# ---------------------------------------------------------------- additive

def test_additive_matches_naive_loop_with_class_token():
    attn = build64('additive', dim=8, num_heads=2, grid=(2, 3))
    x = 2 * torch.randn(2, 1 + 6, 8, dtype=torch.float64)
    assert max_abs_err(attn(x, (2, 3)), naive_additive(attn, x)) < 1e-12


def test_additive_pool_weights_sum_to_one_over_tokens():
    torch.manual_seed(0)
    B, n, heads, d = 2, 5, 3, 6
    logits = 50 * torch.randn(B, n, heads, dtype=torch.float64)
    ones = torch.ones(B, n, heads * d, dtype=torch.float64)
    assert max_abs_err(additive_pool(ones, logits), torch.ones(B, 1, heads * d, dtype=torch.float64)) < 1e-12
    # token i carries a one in channel i of every head, so the pooled channel i of head j is α_{j,i}
    picks = torch.zeros(B, n, heads, d, dtype=torch.float64)
    for i in range(n):
        picks[:, i, :, i] = 1
    alpha = additive_pool(picks.view(B, n, heads * d), logits).view(B, heads, d)[..., :n]
    expected = naive_softmax(logits.transpose(1, 2))
    assert max_abs_err(alpha, expected) < 1e-12
    assert max_abs_err(alpha.sum(-1), torch.ones(B, heads, dtype=torch.float64)) < 1e-12


# ---------------------------------------------------------------- every registered attention

@pytest.mark.parametrize('name', list_attentions())
def test_module_gradcheck(name):
    attn = build64(name, dim=8, num_heads=2, grid=(2, 2))
    x = torch.randn(1, 1 + 4, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: attn(t, (2, 2)), (x,))


def test_function_gradchecks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ranges = torch.tensor(SPEC_RANGES, dtype=torch.float64, requires_grad=True)
    ts = torch.tensor(SPEC_TS, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda a, b, c, r, t: multimax_attention(3 * a, b, c, r, t), (q, k, v, ranges, ts))
    assert gradcheck(sima_attention, (q, k, v))
    q3, k3, v3 = (torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert gradcheck(sima_attention, (q3, k3, v3))
    additive = build64('additive', dim=4, num_heads=2, grid=(2, 2))
    x = torch.randn(1, 4, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: additive(t, (2, 2)), (x,))
    logits = torch.randn(1, 4, 2, dtype=torch.float64, requires_grad=True)
    assert gradcheck(additive_pool, (x, logits))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', list_attentions())
def test_autocast_outputs_and_grads_finite(name, dtype):
    torch.manual_seed(0)
    attn = build_attention(name, 32, 2, (4, 4))
    x = 10 * torch.randn(2, 1 + 16, 32)
    if name == 'multimax':
        with torch.no_grad():
            attn.mixer.ranges.zero_()
            attn.mixer.ts.copy_(torch.tensor([0., 0., 100., 100.]))
            q, k, _ = attn.qkv(x).chunk(3, dim=-1)
            scores = torch.einsum('bnc,bmc->bnm', q[..., :16], k[..., :16]) / 4
        assert torch.isinf(multimax_modulation(scores.half(), attn.mixer.ranges.half(), attn.mixer.ts.half())).any()
    x.requires_grad_(True)
    with torch.autocast('cpu', dtype=dtype):
        out = attn(x, (4, 4))
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for pname, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize('name', CORE)
def test_global_attention_is_permutation_equivariant(name):
    attn = build64(name)
    x = 2 * torch.randn(2, 12, 16, dtype=torch.float64)
    perm = torch.randperm(12)
    assert max_abs_err(attn(x[:, perm], (3, 4)), attn(x, (3, 4))[:, perm]) < 1e-12


def count_flops(name, side):
    with torch.device('meta'):
        attn = build_attention(name, 64, 4, (side, side))
        x = torch.empty(1, side * side, 64)
    with FlopCounterMode(display=False) as counter:
        attn(x, (side, side))
    return counter.get_total_flops()


def test_linear_attentions_flops_grow_linearly():
    for name in ('sima', 'additive'):
        ratio = count_flops(name, 64) / count_flops(name, 32)
        assert 4 / 1.1 <= ratio <= 4 * 1.1, (name, ratio)
    assert count_flops('softmax', 64) / count_flops('softmax', 32) > 8


# ---------------------------------------------------------------- registry

ALL = ('softmax', 'multimax', 'inline', 'flatten', 'sima', 'additive')


def test_registry_lists_the_papers_attentions_first():
    assert tuple(list_attentions()[:len(ALL)]) == ALL


def test_unknown_attention_lists_valid_names():
    with pytest.raises(ValueError, match='nope') as info:
        build_attention('nope', 64, 4, (8, 8))
    for name in list_attentions():
        assert name in str(info.value)


class Wrapped(torch.nn.Module):
    """A Linear inside a module of its own, with no `weight` of its own, as adapters and int8 quantization leave
    them (a quantized Linear's `weight` is a method)."""

    def __init__(self, inner: torch.nn.Linear):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize('name', list_attentions())
def test_every_attention_runs_with_its_linear_layers_replaced(name):
    """The additive mixer read its layers' weights and failed once they were replaced ('function' object has no
    attribute 'shape' under torch.ao.quantization.quantize_dynamic)."""
    attn = build64(name, dim=8, num_heads=2, grid=(2, 2))
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    expected = attn(x, (2, 2))
    for parent in list(attn.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, child_name, Wrapped(child))
    assert max_abs_err(attn(x, (2, 2)), expected) == 0


@pytest.mark.parametrize('name', list_attentions())
def test_every_attention_builds_and_keeps_shape(name):
    attn = build_attention(name, dim=64, num_heads=4, grid_size=(8, 8))
    assert attn(torch.randn(2, 64, 64), (8, 8)).shape == (2, 64, 64)
    keys = set(attn.state_dict())
    assert {'qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias'} <= keys
    expected_extra = {
        'softmax': set(),
        'multimax': {'ranges', 'ts'},
        'sima': set(),
        'additive': {f'{layer}.{p}' for layer in ('query_att', 'key_att', 'transform') for p in ('weight', 'bias')},
    }
    if name in expected_extra:
        assert keys - {'qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias'} == expected_extra[name]


@pytest.mark.parametrize('grouping', [dict(), dict(grouping='window', window_size=2, shift_size=1)])
def test_multimax_takes_torch_func_gradients_and_per_sample_gradients(grouping):
    """`torch.func.grad`, `jacrev` and `vmap(grad)` (per-sample gradients) through MultiMax failed: its custom
    autograd functions had no rules for the transforms. They equal autograd's, sample by sample; with shifted
    windows the position bias and the shift mask take part too."""
    attn = build64('multimax', dim=8, num_heads=2, grid=(4, 4), **grouping)
    params = {name: p.detach() for name, p in attn.named_parameters()}
    x = torch.randn(3, 16, 8, dtype=torch.float64)

    def loss(params, x):
        return torch.func.functional_call(attn, params, (x, (4, 4))).square().mean()

    grads = torch.func.grad(loss)(params, x)
    loss(dict(attn.named_parameters()), x).backward()
    for name, p in attn.named_parameters():
        assert max_abs_err(grads[name], p.grad) < 1e-12, name
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x.unsqueeze(1))
    for i in range(len(x)):
        one = torch.func.grad(loss)(params, x[i:i + 1])
        for name in params:
            assert max_abs_err(per_sample[name][i], one[name]) < 1e-12, name


class _Subclassed(SoftmaxMixer):
    """A softmax with a forward of its own (temperature 2): recording it by softmax's weights would be wrong."""

    def forward(self, q, k, v, ctx):
        return super().forward(q * 2, k, v, ctx)


class _NoForward(Mixer):
    pass


class _PositionalOption(Mixer):
    def __init__(self, dim, num_heads, scale):
        super().__init__(dim, num_heads)

    def forward(self, q, k, v, ctx):
        return v


class _PositionalAfterMixerArguments(Mixer):
    def __init__(self, dim, num_heads, group_grid=None, attn_drop=0., temperature: float = 10.):
        super().__init__(dim, num_heads, group_grid, attn_drop)

    def forward(self, q, k, v, ctx):
        return v


class _ForwardWithoutContext(Mixer):
    def forward(self, q, k, v):
        return v


class _ReadsTokensUnflagged(Mixer):
    """Adds the mean input token, as InLine's residual does, without declaring needs_tokens."""

    def forward(self, q, k, v, context):
        return v + context.tokens.mean(1, keepdim=True)


class _ReadsBiasUnflagged(Mixer):
    def forward(self, q, k, v, ctx):
        return v if ctx.pos_bias is None else v + 1


class _ReadsTokensFlagged(_ReadsTokensUnflagged):
    needs_tokens = True


@pytest.mark.parametrize('name, cls, error, message', [
    (3, _Subclassed, ValueError, "attention name 3: expected a lower-case identifier such as 'cosine'"),
    ('', _Subclassed, ValueError, "attention name '': expected a lower-case identifier"),
    # an official pattern string, which names a layout of inline / flatten / softmax stages
    ('IISS', _Subclassed, ValueError, "attention name 'IISS': expected a lower-case identifier"),
    # timm reads what follows a dot in a model name as a weights tag
    ('cos.v2', _Subclassed, ValueError, "attention name 'cos.v2': expected a lower-case identifier"),
    ('fn', len, TypeError, "attention 'fn': len must be a class that subclasses models.attention.Mixer"),
    ('again', SoftmaxMixer, ValueError, "attention 'again': SoftmaxMixer is registered as 'softmax' already; expected "
                                        "a subclass of it for a second name"),
    ('empty', _NoForward, TypeError, "attention 'empty': _NoForward defines no forward(q, k, v, ctx)"),
    ('positional', _PositionalOption, TypeError, "attention 'positional': _PositionalOption's constructor cannot take "
                                                 "the groupings' (dim, num_heads, group_grid, attn_drop=...)"),
    # taken positionally, `temperature` was no option: create_model(..., temperature=3.) blamed the model's
    # constructor, attn_kwargs said the attention takes no options, and without a value its default held silently
    ('optional', _PositionalAfterMixerArguments, TypeError,
     "attention 'optional': _PositionalAfterMixerArguments's constructor argument 'temperature' is not keyword-only, "
     "so it cannot be a method option; expected it after a bare * (__init__(self, dim, num_heads, group_grid=None, "
     "attn_drop=0., *, temperature=...))"),
    # failed at the first forward, in training after the data was read, with Python's own argument count error
    ('noctx', _ForwardWithoutContext, TypeError, "attention 'noctx': _ForwardWithoutContext.forward cannot take the "
                                                 "groupings' (q, k, v, ctx) ("),
    # its first call failed on None.mean, in training after the data was read, naming neither the field nor the flag
    ('unflagged', _ReadsTokensUnflagged, TypeError,
     "attention 'unflagged': _ReadsTokensUnflagged.forward reads ctx.tokens, which the groupings give only to mixers "
     "that declare it; expected the class attribute needs_tokens = True"),
    # a bias it can never be given: silently the unbiased branch in every grouping
    ('unbiased', _ReadsBiasUnflagged, TypeError,
     "attention 'unbiased': _ReadsBiasUnflagged.forward reads ctx.pos_bias, which the groupings give only to mixers "
     "that declare it; expected the class attribute accepts_score_bias = True"),
])
def test_registering_a_bad_name_or_class_is_refused_in_one_line(name, cls, error, message):
    """Each was accepted and failed later, elsewhere: an int name broke every later unknown-attention message, a
    pattern-shaped name replaced the official pattern, a second name renamed the first, a mixer without forward
    failed at its first call with an empty message."""
    before = list_attentions()
    with pytest.raises(error) as raised:
        register_attention(name)(cls)
    assert str(raised.value).startswith(message) and '\n' not in str(raised.value)
    assert list_attentions() == before and SoftmaxMixer.attention_name == 'softmax'


def test_a_mixer_that_declares_the_tokens_it_reads_gets_them_in_every_grouping(monkeypatch):
    monkeypatch.setattr(registry, '_MIXERS', dict(registry._MIXERS))
    register_attention('mean_token_value')(_ReadsTokensFlagged)
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    attn = build_attention('mean_token_value', 8, 2, (4, 4)).double()
    expected = attn.proj(attn.qkv(x)[..., 16:] + x.mean(1, keepdim=True))
    assert max_abs_err(attn(x, (4, 4)), expected) < 1e-14
    for grouping in (dict(grouping='window', window_size=2), dict(grouping='stripes', split_size=2)):
        attn = build_attention('mean_token_value', 8, 2, (4, 4), **grouping).double()
        assert attn(x, (4, 4)).shape == x.shape  # the grouped tokens arrived: None has no mean


class _HeadsLeftSplit(Mixer):
    forms_scores = reduces_keys = True

    def forward(self, q, k, v, ctx):
        h = self.num_heads
        return F.scaled_dot_product_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h))


@pytest.mark.parametrize('grouping', [{}, dict(grouping='reduction', sr_ratio=2),
                                      dict(grouping='window', window_size=2), dict(grouping='stripes', split_size=2)])
@pytest.mark.parametrize('heads', [1, 2])
def test_a_mixer_output_of_another_shape_is_named_in_one_line(monkeypatch, grouping, heads):
    """Heads left split failed in the projection ("mat1 and mat2 shapes cannot be multiplied"), and with one head
    ran on as (B, 1, n, C) tokens that the block blamed on the input ("2 tokens cannot hold a 4x4 grid")."""
    monkeypatch.setattr(registry, '_MIXERS', dict(registry._MIXERS))
    register_attention('split_heads_out')(_HeadsLeftSplit)
    heads *= 2 if grouping.get('grouping') == 'stripes' else 1  # two branches of half the heads and channels
    attn = build_attention('split_heads_out', 8, heads, (4, 4), **grouping)
    with pytest.raises(ValueError, match=r"^attention 'split_heads_out': _HeadsLeftSplit.forward returned shape "
                                         r"\(\d+, \d+, \d+, \d+\) for queries of shape \(\d+, \d+, \d+\); "
                                         r"expected the queries' shape \(B', n, C\), heads merged back "
                                         r"\(models.attention.layout.merge_heads\)$"):
        attn(torch.randn(2, 16, 8), (4, 4))


def test_a_subclass_with_its_own_forward_is_not_recorded_as_its_base():
    """record_attention took softmax's weights for a subclass that scales its queries: silently wrong maps. It
    refuses when recording begins."""
    attn = build_attention('softmax', 8, 2, (2, 2))
    attn.mixer.__class__ = _Subclassed
    with pytest.raises(ValueError, match=r"^no attention matrix is defined for _Subclassed; register one with "
                                         r"models.analysis.attention_matrix$"):
        with record_attention(attn):
            pass
