"""The fast paths of softmax and MultiMax against the plain formulas written here, in float64.

Windowed softmax folds the windows into the heads so that one (1, nW·h, n, n) bias serves the whole batch;
MultiMax has a plain path with a hand-written σ backward, a path in blocks of query rows with a recomputing
backward, a FlexAttention path (`score_mod`), whose CPU reference implementation runs the same math
forward-only here, and a fused CPU kernel (forward and backward).
"""
import fcntl
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models.attention import MixContext, build_attention
from models.attention import multimax, multimax_cpu
from models.attention.multimax import _Modulation, multimax_attention, multimax_modulation
from models.attention.softmax import SoftmaxMixer, fold_windows, unfold_windows
from reference import max_abs_err

from dispatch import DispatchRecorder

SPEC_RANGES = (0.1, 0.2, -0.3, 0.4)
SPEC_TS = (0.5, 0.3, 0.2, 0.1)


def plain_scores(q, k, bias=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s if bias is None else s + bias


def plain_window_mask(mask, batch):
    """(nW, n, m) -> (batch, 1, n, m), group g taking mask[g % nW], materialised as the plain formula does."""
    return torch.stack([mask[g % mask.shape[0]] for g in range(batch)]).unsqueeze(1)


def plain_sigma(x, ranges, ts):
    b, t = ranges, ts
    return (x + t[0] * (b[0] - x).clamp(min=0) + t[1] * (x - b[1]).clamp(min=0)
            + t[2] * (b[2] - x).clamp(min=0) ** 2 + t[3] * (x - b[3]).clamp(min=0) ** 2)


def windows(batch=2, num_windows=3, heads=2, n=5, d=6, dtype=torch.float64, requires_grad=False):
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch * num_windows, heads, n, d, dtype=dtype, requires_grad=requires_grad)
               for _ in range(3))
    pos_bias = torch.randn(n, n, heads, dtype=dtype, requires_grad=requires_grad).permute(2, 0, 1)
    mask = torch.where(torch.rand(num_windows, n, n) < 0.3, -100., 0.).to(dtype)
    return q, k, v, pos_bias, mask


def spec_parameters(dtype=torch.float64, requires_grad=False):
    return (torch.tensor(SPEC_RANGES, dtype=dtype, requires_grad=requires_grad),
            torch.tensor(SPEC_TS, dtype=dtype, requires_grad=requires_grad))


# ---------------------------------------------------------------- softmax in windows

def test_fold_windows_puts_each_window_in_its_own_heads():
    x = torch.randn(2 * 3, 4, 5, 6)
    folded = fold_windows(x, 3)
    assert folded.shape == (2, 3 * 4, 5, 6)
    assert torch.equal(folded[1, 2 * 4 + 3], x[1 * 3 + 2, 3])
    assert torch.equal(unfold_windows(folded, 4), x)


@pytest.mark.parametrize('with_pos_bias', [True, False])
@pytest.mark.parametrize('grad', [False, True])
def test_windowed_softmax_mix_matches_plain_formula(with_pos_bias, grad):
    """The softmax mixer on (B·nW, n, C) windows, in inference (the fused kernel) and in training (a bias with a
    gradient, which the fused CPU kernel does not take: the plain formula)."""
    q, k, v, pos_bias, mask = windows(requires_grad=grad)
    pos_bias = pos_bias if with_pos_bias else None
    Bw, heads, n, d = q.shape
    mixer = SoftmaxMixer(heads * d, heads).double().train(grad)

    def tokens(t):
        return t.transpose(1, 2).reshape(Bw, n, heads * d)

    with torch.set_grad_enabled(grad):
        out = mixer(tokens(q), tokens(k), tokens(v), MixContext((1, n), 0, pos_bias, mask))
        scores = plain_scores(q, k, pos_bias) + plain_window_mask(mask, Bw)
        expected = tokens(scores.softmax(dim=-1) @ v)
    assert max_abs_err(out, expected) < 1e-12
    if grad:
        inputs = (q, k, v) if pos_bias is None else (q, k, v, pos_bias)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        expected_grads = torch.autograd.grad(expected.square().sum(), inputs)
        for g, e in zip(grads, expected_grads):
            assert max_abs_err(g, e) < 1e-10


@pytest.mark.parametrize('shift', [2, 0])
def test_windowed_softmax_inference_is_fused_and_its_bias_does_not_grow_with_the_batch(shift):
    heads, grid, window = 2, (8, 8), 4
    n, num_windows = window * window, (8 // window) ** 2
    attn = build_attention('softmax', 24, heads, grid, grouping='window', window_size=window, shift_size=shift,
                           rel_pos_bias=True).eval()
    largest = {}
    for batch in (1, 8):
        x = torch.randn(batch, 64, 24)
        with torch.no_grad(), DispatchRecorder() as record:
            attn(x, grid)
        largest[batch] = record.largest((n, n))
        assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in record.ops
    # one (1, nW·h, n, n) bias per forward (nW = 1 without a mask), however many images: no (B·nW, ·, n, n) copy
    assert largest[1] == largest[8] == (num_windows if shift else 1) * heads * n * n


# ---------------------------------------------------------------- MultiMax

def plain_multimax(q, k, v, ranges, ts, bias=None, mask=None):
    s = plain_sigma(plain_scores(q, k, bias), ranges, ts)
    if mask is not None:
        s = s + plain_window_mask(mask, q.shape[0])
    return s.softmax(dim=-1) @ v


def test_modulation_backward_matches_autograd_of_the_formula_at_and_between_the_breakpoints():
    ranges, ts = spec_parameters(requires_grad=True)
    x = torch.cat([torch.linspace(-2, 2, 101, dtype=torch.float64), ranges.detach()]).requires_grad_()
    grad = torch.randn_like(x)
    out = _Modulation.apply(x, ranges, ts)
    expected = multimax_modulation(x, ranges, ts)
    assert max_abs_err(out, expected) < 1e-15
    got = torch.autograd.grad(out, (x, ranges, ts), grad)
    want = torch.autograd.grad(expected, (x, ranges, ts), grad)
    for g, w in zip(got, want):
        assert max_abs_err(g, w) < 1e-12


def test_modulation_gradcheck_and_second_derivatives():
    ranges, ts = spec_parameters(requires_grad=True)
    x = (torch.randn(3, 7, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(_Modulation.apply, (x, ranges, ts))
    assert torch.autograd.gradgradcheck(_Modulation.apply, (x, ranges, ts))


def grads_of_square_sum(out, q, k, v, ranges, ts, bias=None):
    """Gradients of Σ out² with respect to q, k, v, bias (where given), ranges and ts."""
    return torch.autograd.grad(out.square().sum(), [t for t in (q, k, v, bias, ranges, ts) if t is not None])


def assert_matches_formula(out, grads, q, k, v, ranges, ts, bias=None, mask=None):
    """`out` is MultiMax of (3q, k, v) and `grads` its `grads_of_square_sum`, both as the plain formula's."""
    expected = plain_multimax(3 * q, k, v, ranges, ts, bias, mask)
    assert max_abs_err(out, expected) < 1e-12
    for g, e in zip(grads, grads_of_square_sum(expected, q, k, v, ranges, ts, bias)):
        assert g.shape == e.shape
        assert max_abs_err(g, e) < 1e-10


def test_multimax_plain_path_matches_formula_with_bias_and_mask():
    q, k, v, pos_bias, mask = windows(requires_grad=True)
    ranges, ts = spec_parameters(requires_grad=True)
    out = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=False, use_kernel=False)
    assert_matches_formula(out, grads_of_square_sum(out, q, k, v, ranges, ts, pos_bias), q, k, v, ranges, ts,
                           pos_bias, mask)


def row_block_bytes(q, rows=2):
    """Bytes of `rows` query rows of float32 scores for q's batch and heads, with as many keys as queries."""
    batch, heads, n, _ = q.shape
    return rows * batch * heads * n * 4


@pytest.mark.parametrize('masked', [False, True])
def test_multimax_inference_runs_in_row_blocks_that_match_the_formula(monkeypatch, masked):
    """Without autograd the plain path takes 2 query rows at a time here (5 rows: blocks of 2, 2, 1); no
    operation returns an n×n score tensor, and the result is the formula's."""
    q, k, v, pos_bias, mask = windows()
    ranges, ts = spec_parameters()
    mask = mask if masked else None
    batch, heads, n, _ = q.shape
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', row_block_bytes(q))
    with torch.no_grad(), DispatchRecorder() as record:
        out = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=False, use_kernel=False)
    assert record.largest((n, n)) == 0
    assert max_abs_err(out, plain_multimax(3 * q, k, v, ranges, ts, pos_bias, mask)) < 1e-12
    with DispatchRecorder() as record:  # with autograd, below the training budget: the whole matrix at once
        multimax_attention(3 * q, k, v, ranges, ts.requires_grad_(), pos_bias, mask, use_flex=False, use_kernel=False)
    assert record.largest((n, n)) == batch * heads * n * n


def row_blocks(monkeypatch, q, rows=2):
    """Make the plain path take `rows` query rows per block, in training too."""
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', row_block_bytes(q, rows))
    monkeypatch.setattr('models.attention.multimax._PLAIN_TRAINING_BYTES', 0)


@pytest.mark.parametrize('bias_kind', ['none', 'per_row', 'row_broadcast'])
@pytest.mark.parametrize('masked', [False, True])
def test_multimax_training_in_row_blocks_matches_the_formula_and_keeps_no_score_matrix(monkeypatch, bias_kind,
                                                                                       masked):
    """Forward and backward a block of 2 query rows at a time: output and every gradient (q, k, v, bias, ranges,
    ts) are the formula's, and no operation returns a score-sized tensor, in the forward pass or the backward
    pass: the largest n×n one is the (heads, n, n) bias's gradient."""
    q, k, v, pos_bias, mask = windows(requires_grad=True)
    ranges, ts = spec_parameters(requires_grad=True)
    bias = {'none': None, 'per_row': pos_bias, 'row_broadcast': pos_bias[:, :1].detach().requires_grad_()}[bias_kind]
    mask = mask if masked else None
    row_blocks(monkeypatch, q)
    n = q.shape[-2]
    with DispatchRecorder() as record:
        out = multimax_attention(3 * q, k, v, ranges, ts, bias, mask, use_flex=False, use_kernel=False)
        grads = grads_of_square_sum(out, q, k, v, ranges, ts, bias)
    assert record.largest((n, n)) == (pos_bias.numel() if bias_kind == 'per_row' else 0)
    assert_matches_formula(out, grads, q, k, v, ranges, ts, bias, mask)


def test_multimax_row_blocks_gradcheck_and_second_derivatives(monkeypatch):
    q, k, v, pos_bias, mask = windows(batch=1, num_windows=2, n=4, d=3, requires_grad=True)
    ranges, ts = spec_parameters(requires_grad=True)
    row_blocks(monkeypatch, q, rows=3)

    def attention(q, k, v, bias, ranges, ts):
        return multimax_attention(3 * q, k, v, ranges, ts, bias, mask, use_flex=False, use_kernel=False)

    assert torch.autograd.gradcheck(attention, (q, k, v, pos_bias, ranges, ts))
    assert torch.autograd.gradgradcheck(attention, (q, k, v, pos_bias, ranges, ts))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_multimax_row_blocks_under_autocast_work_in_float32_and_return_the_input_dtypes(monkeypatch, dtype):
    q, k, v, pos_bias, mask = windows(dtype=torch.float32)
    ranges, ts = spec_parameters(torch.float32, requires_grad=True)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    pos_bias = pos_bias.detach().requires_grad_()
    row_blocks(monkeypatch, q)
    with torch.autocast('cpu', dtype=dtype):
        out = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=False, use_kernel=False)
    inputs = (q, k, v, pos_bias, ranges, ts)
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    assert out.dtype == dtype
    assert [g.dtype for g in grads] == [t.dtype for t in inputs]
    exact_inputs = [t.detach().double().requires_grad_() for t in inputs]
    q64, k64, v64, bias64, ranges64, ts64 = exact_inputs
    expected = plain_multimax(3 * q64, k64, v64, ranges64, ts64, bias64, mask.double())
    expected_grads = torch.autograd.grad(expected.square().sum(), exact_inputs)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-3  # rounding of the output and gradients; the work is in float32
    assert max_abs_err(out.double(), expected) < tol
    for g, e in zip(grads, expected_grads):
        assert max_abs_err(g.double(), e) < tol * max(1., e.abs().max().item())


def test_multimax_training_takes_row_blocks_only_past_the_plain_budget(monkeypatch):
    q, k, v, pos_bias, mask = windows(requires_grad=True)
    ranges, ts = spec_parameters(requires_grad=True)
    batch, heads, n, _ = q.shape
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', row_block_bytes(q))
    paths = {}
    for budget in (batch * heads * n * n * 4, batch * heads * n * n * 4 - 1):
        monkeypatch.setattr('models.attention.multimax._PLAIN_TRAINING_BYTES', budget)
        out = multimax_attention(q, k, v, ranges, ts, pos_bias, mask, use_flex=False, use_kernel=False)
        paths[budget] = type(out.grad_fn).__name__
    assert list(paths.values()) == ['UnsafeViewBackward0', '_MultiMaxInRowBlocksBackward']
    out = multimax_attention(q, k, v, ranges, ts, pos_bias, mask, dropout_p=0.5, use_flex=False, use_kernel=False)
    assert type(out.grad_fn).__name__ != '_MultiMaxInRowBlocksBackward'  # dropout: the plain path


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
@pytest.mark.parametrize('dtype, tol', [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize('masked', [False, True])
def test_multimax_flex_path_matches_plain_path(dtype, tol, masked):
    q, k, v, pos_bias, mask = windows(dtype=dtype)
    ranges, ts = spec_parameters(dtype)
    mask = mask if masked else None
    with torch.no_grad():  # FlexAttention has no backward on CPU
        flex = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=True)
        plain = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=False, use_kernel=False)
        expected = plain_multimax(*(t.double() for t in (3 * q, k, v, ranges, ts, pos_bias)),
                                  None if mask is None else mask.double())
    assert flex.dtype == dtype
    assert max_abs_err(flex, plain) < tol
    assert max_abs_err(flex.double(), expected) < tol


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
@pytest.mark.parametrize('masked, causal', [(False, False), (True, False), (False, True)])
def test_multimax_flex_with_parameters_per_row_matches_the_formula(masked, causal):
    """The score_mod that CUDA training takes, σ's eight scalars copied per query row, computes σ: here in
    inference, the only FlexAttention pass the CPU has (tests/test_cuda.py checks its gradients on a GPU)."""
    q, k, v, pos_bias, mask = windows(dtype=torch.float64)
    ranges, ts = spec_parameters(torch.float64)
    mask = mask if masked else None
    with torch.no_grad():
        out, _ = multimax._multimax_flex(3 * q, k, v, ranges, ts, pos_bias, mask, causal, per_row_parameters=True)
        expected = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=False, use_kernel=False,
                                      causal=causal)
    assert max_abs_err(out, expected) < 1e-12


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
@pytest.mark.parametrize('masked', [False, True])
def test_multimax_flex_training_keeps_flex_log_sum_exp_and_backpropagates_in_row_blocks(monkeypatch, masked):
    """Training through FlexAttention: its forward pass (the unfused reference here) supplies the output and the
    log-sum-exp that the backward pass in row blocks recomputes the probabilities from."""
    q, k, v, pos_bias, mask = windows(requires_grad=True)
    ranges, ts = spec_parameters(requires_grad=True)
    mask = mask if masked else None
    monkeypatch.setattr('models.attention.multimax._FLEX_BACKWARD_BLOCK_BYTES', row_block_bytes(q))
    out = multimax_attention(3 * q, k, v, ranges, ts, pos_bias, mask, use_flex=True)
    assert type(out.grad_fn).__name__ == '_MultiMaxInRowBlocksBackward'
    assert_matches_formula(out, grads_of_square_sum(out, q, k, v, ranges, ts, pos_bias), q, k, v, ranges, ts,
                           pos_bias, mask)


# every shape a bias may take that broadcasts to the (B, h, n, m) scores of `windows()` (B = 6, h = 2, n = m = 5)
BIAS_SHAPES = [(2, 5, 5), (6, 2, 5, 5), (1, 2, 5, 5), (5, 5), (5,), ()]


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
@pytest.mark.parametrize('shape', BIAS_SHAPES, ids=str)
def test_multimax_takes_a_bias_of_any_broadcasting_shape_on_every_path(monkeypatch, shape):
    """The row blocks read the bias's rows (a per-key bias or a number had none: IndexError) and FlexAttention's
    score_mod indexed it by head alone (a per-image bias was misread, a 2-D or 1-D one failed)."""
    q, k, v, _, mask = windows(requires_grad=True)
    ranges, ts = spec_parameters(requires_grad=True)
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    row_blocks(monkeypatch, q)
    out = multimax_attention(3 * q, k, v, ranges, ts, bias, mask, use_flex=False, use_kernel=False)
    assert type(out.grad_fn).__name__ == '_MultiMaxInRowBlocksBackward'
    assert_matches_formula(out, grads_of_square_sum(out, q, k, v, ranges, ts, bias), q, k, v, ranges, ts, bias, mask)
    q, k, v, ranges, ts, bias = (t.detach() for t in (q, k, v, ranges, ts, bias))  # FlexAttention: no CPU backward
    expected = plain_multimax(3 * q, k, v, ranges, ts, bias, mask)
    for path in (dict(use_flex=False, use_kernel=False), dict(use_flex=True)):
        assert max_abs_err(multimax_attention(3 * q, k, v, ranges, ts, bias, mask, **path), expected) < 1e-12


def test_multimax_flex_path_refuses_dropout():
    q, k, v, _, _ = windows()
    ranges, ts = spec_parameters()
    with pytest.raises(ValueError, match='dropout_p=0.1'):
        multimax_attention(q, k, v, ranges, ts, dropout_p=0.1, use_flex=True)


@pytest.mark.parametrize('path', [dict(), dict(use_kernel=False), dict(use_flex=True)])
def test_multimax_refuses_other_than_four_ranges_and_ts(path):
    """Three of each made the CPU kernel read past them, in silence."""
    q, k, v, ranges, ts = kernel_inputs(6, 6)
    with pytest.raises(ValueError, match=r"^MultiMax takes four ranges \(b0..b3\) and four ts \(t0..t3\), got shapes "
                                         r"\(3,\) and \(4,\)$"):
        multimax_attention(q, k, v, ranges[:3], ts, **path)
    with pytest.raises(ValueError, match=r"got shapes \(4,\) and \(2, 4\)$"):
        multimax_attention(q, k, v, ranges, ts.expand(2, 4), **path)


def test_eager_multimax_on_cpu_takes_flex_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr('models.attention.multimax._multimax_flex', lambda *a: calls.append(a) or (a[2], None))
    q, k, v, _, _ = windows()
    ranges, ts = spec_parameters()
    multimax_attention(q, k, v, ranges, ts)
    assert calls == []
    multimax_attention(q, k, v, ranges, ts, use_flex=True)
    assert len(calls) == 1


# ---------------------------------------------------------------- MultiMax's CPU kernel

def kernel_inputs(n, m, batch=2, heads=3, d=8, dv=5, dtype=torch.float64, requires_grad=False):
    """Scores spread over all of σ's pieces (the spec's breakpoints lie within ±0.4)."""
    generator = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(batch, heads, n, d, dtype=dtype, generator=generator)
    k, v = (torch.randn(batch, heads, m, dim, dtype=dtype, generator=generator) for dim in (d, dv))
    ranges, ts = spec_parameters(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, ranges, ts)]


def assert_grads_match_in_float64(grads, expected_grads):
    """Gradients of (q, k, v, ranges, ts) against the formula's. Each of σ's scalars sums one term from every score
    (2·10⁶ of them at 300 × 1100), which float64 rounds, in the kernel's order and in autograd's, to within about
    1e-12 of the result (up to 0.95e-12 over 100 draws of the output's gradient): those are held to 1e-11."""
    for name, grad, want in zip(('q', 'k', 'v', 'ranges', 'ts'), grads, expected_grads):
        relative = 1e-11 if name in ('ranges', 'ts') else 1e-12
        assert max_abs_err(grad, want) < relative * max(1.0, want.abs().max().item()), name


# several blocks of query rows (256 forward, 128 backward) and of keys (512), each with a ragged last block; one block
@pytest.mark.parametrize('n, m', [(300, 1100), (5, 7)])
def test_multimax_cpu_kernel_matches_the_formula_in_float64_forward_and_backward(n, m):
    inputs = kernel_inputs(n, m, requires_grad=True)
    out = multimax_attention(*inputs, use_kernel=True)
    expected = plain_multimax(*inputs)
    assert max_abs_err(out, expected) < 1e-13
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    assert_grads_match_in_float64(grads, torch.autograd.grad(expected, inputs, grad_out))


# zero weights: σ is the identity, which the kernel skips, and its backward pass skips σ's derivative where no
# gradient of σ's scalars is asked for (softmax attention); asked for, that of `ts` is not zero
@pytest.mark.parametrize('scalar_grads', [False, True], ids=['softmax', 'zero-weights'])
def test_with_zero_weights_the_kernel_is_softmax_attention_forward_and_backward(scalar_grads):
    q, k, v, ranges, _ = kernel_inputs(300, 1100, requires_grad=True)
    ts = torch.zeros(4, dtype=torch.float64)
    inputs = [q, k, v] + [t.detach().requires_grad_(scalar_grads) for t in (ranges, ts)]
    out = multimax_attention(*inputs, use_kernel=True)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    assert max_abs_err(out, expected) < 1e-13
    grad_out = torch.randn_like(out)
    wanted = inputs if scalar_grads else inputs[:3]
    grads = torch.autograd.grad(out, wanted, grad_out)
    assert_grads_match_in_float64(grads, torch.autograd.grad(plain_multimax(*inputs), wanted, grad_out))
    if scalar_grads:
        assert torch.equal(grads[3], torch.zeros(4, dtype=torch.float64)) and grads[4].abs().min().item() > 1e-3


def test_multimax_cpu_kernel_in_float32_and_bfloat16_matches_the_float64_formula():
    inputs = kernel_inputs(130, 600)
    expected = plain_multimax(*inputs)
    out = multimax_attention(*(t.float() for t in inputs), use_kernel=True)
    assert out.dtype == torch.float32 and max_abs_err(out.double(), expected) < 1e-5
    rounded = [t.bfloat16() for t in inputs[:3]]
    with torch.autocast('cpu', dtype=torch.bfloat16):  # computes in float32, answers in v's dtype
        out = multimax_attention(*rounded, *inputs[3:], use_kernel=True)
    expected = plain_multimax(*(t.double() for t in rounded), *inputs[3:])
    assert out.dtype == torch.bfloat16 and max_abs_err(out.double(), expected) < 2 ** -7 * expected.abs().max()


_SAME_BITS_ON_ONE_AND_TWO_THREADS = """
import torch
from test_fast_paths import kernel_inputs, multimax_attention

results = []
for count in (1, 2):
    torch.set_num_threads(count)
    inputs = kernel_inputs(150, 530, dtype=torch.float32, requires_grad=True)
    out = multimax_attention(*inputs, use_kernel=True)
    results.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
print([torch.equal(a, b) for a, b in zip(*results)])
"""


def test_multimax_cpu_kernel_gives_the_same_bits_on_two_threads_as_on_one():
    """Threads take whole (batch, head) pairs and never share a sum, so the thread count changes no bit of the
    kernel's own work. The BLAS it calls is held to the same: on an AVX-512 Intel CPU, MKL's default paths round
    dK's products differently inside a parallel region than outside one (three quarters of dK's elements differ in
    their last bits, in float32 and in float64), so the comparison runs under MKL's strict reproducible mode, which
    MKL reads as torch loads: in a process of its own."""
    env = dict(os.environ, MKL_CBWR='AUTO,STRICT', PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]))
    done = subprocess.run([sys.executable, '-c', _SAME_BITS_ON_ONE_AND_TWO_THREADS], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # output, then the gradients of q, k, v, ranges and ts
    assert done.stdout.splitlines()[-1] == str([True] * 6)


def test_multimax_cpu_kernel_with_onednn_products_matches_the_float64_formula_forward_and_backward(
        onednn_products, onednn_matmuls):
    # 64 channels: every product of the blocks (all 300 rows, 512 keys) is large enough to go through oneDNN
    inputs = kernel_inputs(300, 600, batch=1, heads=2, d=64, dv=64, requires_grad=True)
    grad_out = torch.randn(1, 2, 300, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = plain_multimax(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    results = []
    for onednn in (False, True):
        single = [t.detach().float().requires_grad_() for t in inputs]
        out, forward_products = onednn_matmuls(lambda: multimax_attention(*single, onednn=onednn))
        grads, backward_products = onednn_matmuls(lambda: torch.autograd.grad(out, single, grad_out.float()))
        # for 2 heads × 2 blocks of keys, 2 products forward and 5 backward
        assert (forward_products, backward_products) == ((8, 20) if onednn else (0, 0))
        # float32 rounding of scores up to about 20 (q is scaled by 3), the same with either library
        assert max_abs_err(out.double(), expected) < 3e-5
        # σ's scalars: sums over all 360000 scores
        tolerances = (2e-5,) * 3 + (1e-4,) * 2
        for name, grad, want, rel in zip(('q', 'k', 'v', 'ranges', 'ts'), grads, expected_grads, tolerances):
            assert max_abs_err(grad.double(), want) < rel * max(1.0, want.abs().max().item()), (onednn, name)
        results.append((out, *grads))
    assert not torch.equal(results[0][0], results[1][0])  # two libraries, different roundings


def test_the_onednn_products_leave_small_blocks_to_the_blas_and_give_the_same_bits_on_two_threads(
        onednn_products, onednn_matmuls):
    # 49-token windows: oneDNN's per-call cost outweighs its speed on products this small
    small = [t.float() for t in kernel_inputs(49, 49, batch=8, d=32, dv=32)]
    _, products = onednn_matmuls(lambda: multimax_cpu.multimax_cpu(*small, None, None, True))
    assert products == 0
    threads = torch.get_num_threads()
    results = []
    for count in (1, 2):
        torch.set_num_threads(count)
        try:
            inputs = [t.float().requires_grad_() for t in kernel_inputs(300, 600, d=64, dv=64)]
            out = multimax_attention(*inputs, onednn=True)
            results.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_through_onednn_the_kernel_packs_strided_heads_once_not_once_per_block(onednn_products):
    """Heads split from one projection have rows 2·h·d apart, and oneDNN's product copies any block whose rows are
    not packed: the kernel packs q, k, v (and the output's gradient) once each, so the copies do not grow with the
    number of blocks; the results are those of packed inputs, bit for bit."""
    ranges, ts = (t.float() for t in spec_parameters())
    copies = []
    for tokens in (600, 1800):  # 2 and 4 blocks of 512 rows, against 2 and 4 blocks of 512 keys
        q, k, v, grad = (heads_in_place(1, tokens, 2, 64, torch.float32) for _ in range(4))
        with torch.no_grad(), torch.profiler.profile() as profile:
            out, lse = multimax_cpu.multimax_cpu(q, k, v, ranges, ts, None, None, True)
            grads = multimax_cpu.multimax_cpu_backward(grad, q, k, v, out, lse, ranges, ts, True)
        copies.append(sum(event.count for event in profile.key_averages() if event.key == 'aten::copy_'))
        packed = [t.contiguous() for t in (q, k, v, grad)]
        with torch.no_grad():
            out_packed, lse_packed = multimax_cpu.multimax_cpu(*packed[:3], ranges, ts, None, None, True)
            grads_packed = multimax_cpu.multimax_cpu_backward(packed[3], *packed[:3], out_packed, lse_packed,
                                                              ranges, ts, True)
        assert torch.equal(out, out_packed) and all(torch.equal(a, b) for a, b in zip(grads, grads_packed))
    assert copies[0] == copies[1]


def test_multimax_cpu_kernel_second_derivatives():
    inputs = kernel_inputs(4, 6, batch=1, heads=1, d=3, dv=2, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda *t: multimax_attention(*t, use_kernel=True), inputs)


def heads_in_place(batch, tokens, heads, d, dtype=torch.float64):
    """(B, h, L, d) heads split from a (B, L, 2·h·d) projection, as the groupings pass them: rows 2·h·d apart."""
    return torch.randn(batch, tokens, 2, heads, d, dtype=dtype)[:, :, 0].transpose(1, 2)


# several blocks of query rows and keys with ragged last ones, and one block; a bias per head gathered from a table
# (strided, as Swin's), per image, or one row for every query; the window mask of two windows an image
@pytest.mark.parametrize('n, m, bias_shape', [(300, 1100, 'head'), (7, 7, 'image'), (7, 9, 'row')])
def test_multimax_cpu_kernel_with_bias_and_mask_matches_the_formula_in_float64(n, m, bias_shape):
    torch.manual_seed(0)
    batch, heads = 4, 3
    q = 3 * heads_in_place(batch, n, heads, 8)
    k, v = heads_in_place(batch, m, heads, 8), heads_in_place(batch, m, heads, 5)
    ranges, ts = spec_parameters()
    bias = {'head': lambda: torch.randn(n, m, heads, dtype=torch.float64).permute(2, 0, 1),
            'image': lambda: torch.randn(batch, 1, n, m, dtype=torch.float64),
            'row': lambda: torch.randn(m, dtype=torch.float64)}[bias_shape]()
    mask = torch.where(torch.rand(2, n, m) < 0.3, -100., 0.).to(torch.float64)
    with torch.no_grad():
        out = multimax_attention(q, k, v, ranges, ts, bias, mask, use_kernel=True)
    assert max_abs_err(out, plain_multimax(q, k, v, ranges, ts, bias, mask)) < 1e-12
    # written (B, n, h, dv): merging the heads back into channels is a view
    assert out.transpose(1, 2).is_contiguous()


def test_multimax_on_cpu_takes_the_kernel_by_default_in_inference_and_in_training_without_bias_or_mask(monkeypatch):
    calls, kernel = [], multimax_cpu.multimax_cpu
    for caller in ('models.attention.multimax', 'models.attention.multimax_cpu'):  # inference, training
        monkeypatch.setattr(f'{caller}.multimax_cpu', lambda *a: calls.append(a) or kernel(*a))
    q, k, v, ranges, ts = kernel_inputs(6, 6)
    _, _, _, pos_bias, mask = windows(batch=1, num_windows=2, heads=3, n=6)
    with torch.no_grad():
        for kwargs in (dict(causal=True), dict(use_flex=True), dict(dropout_p=0.5)):
            multimax_attention(q, k, v, ranges, ts, **kwargs)
        assert calls == []
        out = multimax_attention(q, k, v, ranges, ts, pos_bias, mask)
    assert len(calls) == 1 and max_abs_err(out, plain_multimax(q, k, v, ranges, ts, pos_bias, mask)) < 1e-13
    multimax_attention(*kernel_inputs(6, 6, requires_grad=True)).sum().backward()  # training too
    assert len(calls) == 2
    multimax_attention(*kernel_inputs(6, 6, requires_grad=True), pos_bias, mask).sum().backward()  # but not these
    assert len(calls) == 2


# torch's report of a build that failed on a full disk: the ninja command first, the compiler's output after it
FULL_DISK = ("Error building extension 'zoo_multimax_cpu_b957b0af': [1/2] c++ -MMD -MF multimax_cpu.o.d -O3 -c "
             "multimax_cpu.cpp -o multimax_cpu.o \nFAILED: [code=1] multimax_cpu.o \nc++ -MMD -MF multimax_cpu.o.d "
             "-O3 -c multimax_cpu.cpp -o multimax_cpu.o \n/tmp/ccma8jUD.s: Assembler messages:\n/tmp/ccma8jUD.s: "
             "Fatal error: can't write 107 bytes to section .text of multimax_cpu.o: 'No space left on device'\n"
             "/tmp/ccma8jUD.s: Fatal error: multimax_cpu.o: No such file or directory\nninja: build stopped: "
             "subcommand failed.\n")


# torch's report of a build where the shell finds no compiler: its complaint comes after the ninja command
NO_COMPILER = ("Error building extension 'zoo_multimax_cpu_b957b0af': [1/2] c++ -MMD -MF multimax_cpu.o.d -O3 -c "
               "multimax_cpu.cpp -o multimax_cpu.o \nFAILED: [code=127] multimax_cpu.o \nc++ -MMD -MF "
               "multimax_cpu.o.d -O3 -c multimax_cpu.cpp -o multimax_cpu.o \n/bin/sh: 1: c++: not found\nninja: "
               "build stopped: subcommand failed.\n")


# no compiler or ninja; a build whose library does not load (a torch whose BLAS does not export `sgemm_`); a full
# disk, whose cause torch reports after the ninja command
@pytest.mark.parametrize('failure, reason', [
    (RuntimeError("Ninja is required to load C++ extensions"), "Ninja is required to load C++ extensions"),
    (ImportError("zoo_multimax_cpu.so: undefined symbol: sgemm_"), "zoo_multimax_cpu.so: undefined symbol: sgemm_"),
    (RuntimeError(FULL_DISK), "/tmp/ccma8jUD.s: Fatal error: can't write 107 bytes to section .text of "
                              "multimax_cpu.o: 'No space left on device'"),
    (RuntimeError(NO_COMPILER), "/bin/sh: 1: c++: not found"),
], ids=['build', 'load', 'full-disk', 'no-compiler'])
def test_multimax_without_its_kernel_warns_once_and_runs_unfused(monkeypatch, caplog, failure, reason):
    def failing_build(*args, **kwargs):
        raise failure

    monkeypatch.setattr(multimax_cpu, '_extension', multimax_cpu._NOT_LOADED)
    monkeypatch.setattr('torch.utils.cpp_extension.load', failing_build)
    q, k, v, ranges, ts = kernel_inputs(6, 6)
    with caplog.at_level('WARNING', logger=multimax_cpu.__name__):
        out = multimax_attention(q, k, v, ranges, ts)
        multimax_attention(q, k, v, ranges, ts)
    # only this module's records: importing torch's cpp_extension the first time logs a line of its own
    assert [r.getMessage() for r in caplog.records if r.name == multimax_cpu.__name__] == [
        f"MultiMax's CPU kernel could not be built or loaded ({reason}); MultiMax runs unfused on CPU, softmax "
        "attention keeps scaled_dot_product_attention, and the linear attentions torch's matmul"]
    assert max_abs_err(out, plain_multimax(q, k, v, ranges, ts)) < 1e-13


def test_kernel_build_removes_a_lock_left_by_a_killed_build_under_an_os_lock_of_its_own(monkeypatch, tmp_path):
    """torch before 2.14 waits forever on a file `lock` that a build killed midway left in the build folder; the
    kernel's loader removes it, holding an OS lock that no other process can take until the build is done."""
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))
    folder = tmp_path / f'zoo_multimax_cpu_{multimax_cpu._build_tag()}'
    folder.mkdir()
    (folder / 'lock').touch()
    seen = {}

    def build(name, sources, build_directory, **kwargs):
        seen.update(name=name, directory=build_directory, leftover=os.path.exists(folder / 'lock'))
        with open(folder / 'zoo.lock') as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return 'the extension'

    monkeypatch.setattr(multimax_cpu, '_extension', multimax_cpu._NOT_LOADED)
    monkeypatch.setattr('torch.utils.cpp_extension.load', build)
    assert multimax_cpu.cpu_kernel_available()
    assert seen == dict(name=folder.name, directory=str(folder), leftover=False)
    with open(folder / 'zoo.lock') as other:  # released once built
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_kernel_build_finds_the_ninja_pip_installed_outside_path(monkeypatch, tmp_path):
    """`ninja` is a dependency, installed by pip beside the environment's Python; torch runs it from PATH, which
    lacks that folder where the environment is used without activating it (`/path/venv/bin/python train.py`, a
    notebook kernel, a service): the kernel then never built and the warning asked to install ninja."""
    from torch.utils.cpp_extension import is_ninja_available
    monkeypatch.setenv('PATH', str(tmp_path))
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))
    assert not is_ninja_available()
    seen = []
    monkeypatch.setattr(multimax_cpu, '_extension', multimax_cpu._NOT_LOADED)
    monkeypatch.setattr('torch.utils.cpp_extension.load', lambda *args, **kwargs: seen.append(is_ninja_available()))
    multimax_cpu.cpu_kernel_available()
    assert seen == [True]
    assert os.environ['PATH'] == str(tmp_path)  # only while it builds


def test_kernel_builds_apart_for_each_torch_install(monkeypatch):
    """torch names its cache folder by Python's and CUDA's versions alone: two installs of one torch version in
    two environments would rebuild one folder over each other's on every alternation."""
    tag = multimax_cpu._build_tag()
    monkeypatch.setattr(torch, '__file__', '/another/env/site-packages/torch/__init__.py')
    assert multimax_cpu._build_tag() != tag


def test_flop_counter_counts_the_kernel_as_attention_forward_and_backward():
    q, k, v, ranges, ts = kernel_inputs(10, 12, batch=2, heads=3, d=8, dv=5, dtype=torch.float32, requires_grad=True)
    forward = 2 * 2 * 3 * 10 * 12 * (8 + 5)
    with FlopCounterMode(display=False) as counter:
        out = multimax_attention(q, k, v, ranges, ts, use_kernel=True)
    assert counter.get_total_flops() == forward
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 2 * forward


def test_forcing_the_kernel_names_what_it_cannot_take(monkeypatch):
    q, k, v, ranges, ts = kernel_inputs(6, 6)
    _, _, _, pos_bias, mask = windows(batch=1, num_windows=2, heads=3, n=6)
    for kwargs, named in ((dict(mask=mask, causal=True), 'got causal=True$'),
                          (dict(dropout_p=0.1), 'got dropout_p=0.1$')):
        with pytest.raises(ValueError, match=named):
            multimax_attention(q, k, v, ranges, ts, use_kernel=True, **kwargs)
    with pytest.raises(ValueError, match="in inference only, got bias and mask with gradients required$"):
        multimax_attention(*kernel_inputs(6, 6, requires_grad=True), pos_bias, mask, use_kernel=True)
    with pytest.raises(ValueError, match="takes CPU tensors, got device meta$"):
        multimax_attention(*(t.to('meta') for t in (q, k, v, ranges, ts)), use_kernel=True)
    monkeypatch.setattr(multimax_cpu, '_extension', None)  # a build that failed
    with pytest.raises(RuntimeError, match="could not be built or loaded"):
        multimax_attention(q, k, v, ranges, ts, use_kernel=True)


def test_compiled_flex_attention_keeps_a_graph_for_every_shape_a_model_needs(monkeypatch):
    """MultiMax's FlexAttention on CUDA is compiled for each shape of its inputs: past torch's default limit of 8
    graphs it would run unfused, forming every score matrix (a MultiMax Swin with validation needs more), so its
    first use raises the limit. The eager backend stands in for inductor on the CPU."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda fn, **kwargs: compile_(fn, **{'backend': 'eager', **kwargs}))
    monkeypatch.setattr(multimax, '_compiled_flex', None)
    # set and restored by hand: pytest's monkeypatch would delete the key from torch's config module on undo
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 8  # torch's default
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    try:
        attend = multimax._fused_flex()
        for n in range(16, 25):  # nine shapes: one past the default limit
            q = torch.randn(1, 2, n, 16)
            expected = (q @ q.transpose(-2, -1) / 2).softmax(-1) @ q
            with torch.no_grad():
                assert max_abs_err(attend(q, q, q, score_mod=lambda score, b, h, i, j: score * 2), expected) < 1e-5
        assert dict(torch._dynamo.utils.counters['frames']) == dict(total=9, ok=9)  # each shape compiled
        assert torch._dynamo.config.recompile_limit == multimax._FLEX_GRAPHS
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch.compiler.reset()
