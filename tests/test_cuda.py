"""The CUDA paths on a GPU: every family with every attention against the same model in float64 on the CPU
(outputs and gradients, training and inference), bfloat16 autocast, MultiMax through compiled FlexAttention
against its formula, models compiled by inductor without recompilation, and train.py / eval.py on the GPU with
AMP and `--compile`.

They need a CUDA device and are skipped without one (CI has none): on a GPU machine,
`python -m pytest -q tests/test_cuda.py`.
"""
import copy
import json

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import models  # noqa: F401  (registers the families)
from engine.cli import eval_main, train_main
from models.attention import list_attentions, multimax
from models.attention.multimax import multimax_attention
from test_compile import TINY, TINY_DEMO, few_digits, tiny_model  # noqa: F401  (few_digits: a fixture)
from test_fast_paths import plain_multimax, spec_parameters, windows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
CUDA = torch.device('cuda')


@pytest.fixture(autouse=True)
def exact_float32(monkeypatch):
    """float32 products in float32 (not TF32), the CPU reference without MultiMax's C++ kernel (built on first use;
    the float64 formula is the reference), and compiled code of one test not reused by the next."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    monkeypatch.setattr('models.attention.multimax.cpu_kernel_available', lambda: False)
    torch.compiler.reset()
    yield
    torch.compiler.reset()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()


def assert_gradients_close(got: dict, want: dict, tol: float) -> None:
    """Each parameter's gradient within `tol` of the reference's, relative to its norm or, for gradients that
    are zero or nearly so (a zero-initialised layer behind it, a bias a softmax ignores), to a thousandth of the
    norm of all the gradients."""
    assert got.keys() == want.keys() and len(want) > 0
    floor = 1e-3 * torch.cat([g.detach().double().cpu().flatten() for g in want.values()]).norm().item()
    for name, grad in want.items():
        error = (got[name].detach().double().cpu() - grad.detach().double().cpu()).norm().item()
        assert error <= tol * max(grad.norm().item(), floor), (name, error, grad.norm().item())


def forward_backward(model: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor, **autocast):
    """Inference output, training output and parameter gradients of Σ weights · out."""
    model.eval()
    with torch.no_grad(), torch.autocast(x.device.type, enabled=bool(autocast), **autocast):
        inferred = model(x)
    model.train()
    with torch.autocast(x.device.type, enabled=bool(autocast), **autocast):
        out = model(x)
    (out.float() * weights).sum().backward()
    named = getattr(model, '_orig_mod', model).named_parameters()  # a compiled model's names are the model's
    grads = {name: p.grad for name, p in named if p.grad is not None}
    return inferred, out, grads


def inputs(family: str, device: torch.device, dtype: torch.dtype = torch.float32):
    size = TINY[family]['img_size']
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, size, size, generator=generator, dtype=torch.float64)
    weights = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    return x.to(device, dtype), weights.to(device, dtype)


@pytest.mark.parametrize('attention', list_attentions())
@pytest.mark.parametrize('family', list(TINY))
def test_every_attention_on_cuda_matches_the_float64_model_on_the_cpu(family, attention):
    model = tiny_model(family, attention)
    reference = copy.deepcopy(model).double()
    got = forward_backward(model.to(CUDA), *inputs(family, CUDA))
    want = forward_backward(reference, *inputs(family, torch.device('cpu'), torch.float64))
    assert relative_error(got[0], want[0]) < 1e-5
    assert relative_error(got[1], want[1]) < 1e-5
    assert_gradients_close(got[2], want[2], 1e-4)


@pytest.mark.parametrize('attention', list_attentions())
def test_bfloat16_autocast_on_cuda_stays_near_float32(attention):
    model = tiny_model('swin', attention).to(CUDA)
    x, weights = inputs('swin', CUDA)
    low = forward_backward(model, x, weights, dtype=torch.bfloat16)
    model.zero_grad(set_to_none=True)
    full = forward_backward(model, x, weights)
    assert relative_error(low[0], full[0]) < 3e-2
    assert relative_error(low[1], full[1]) < 3e-2
    all_grads = [torch.cat([g.flatten() for g in grads.values()]) for grads in (low[2], full[2])]
    assert relative_error(*all_grads) < 1e-1


@pytest.mark.parametrize('masked', [False, True])
@pytest.mark.parametrize('dtype, tol', [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_multimax_on_cuda_takes_compiled_flex_attention_and_matches_the_formula(masked, dtype, tol):
    """Inference and training (FlexAttention's forward and backward passes, σ's parameters copied per query row)
    against the float64 formula, with Swin's position bias and shift mask."""
    q, k, v, bias, mask = windows(batch=4, num_windows=4, heads=3, n=49, d=32)
    ranges, ts = spec_parameters()
    mask = mask if masked else None
    args = [t.to(CUDA, dtype) for t in (q, k, v, ranges, ts, bias)]  # in multimax_attention's order
    cuda_mask = None if mask is None else mask.to(CUDA, dtype)
    with torch.no_grad():
        inferred = multimax_attention(*args, cuda_mask)
    assert multimax._compiled_flex is not None  # the compiled kernel, not FlexAttention's unfused reference
    leaves = [t.requires_grad_() for t in args]
    out = multimax_attention(*leaves, cuda_mask)
    assert type(out.grad_fn).__name__ != '_MultiMaxInRowBlocksBackward'  # FlexAttention's own backward
    grads = torch.autograd.grad(out.float().square().sum(), leaves)

    reference = [t.detach().double().cpu().requires_grad_() for t in leaves]
    expected = plain_multimax(*reference[:3], *reference[3:5], reference[5], mask)
    expected_grads = torch.autograd.grad(expected.square().sum(), reference)
    assert inferred.dtype == out.dtype == dtype
    assert relative_error(inferred, expected) < tol
    assert relative_error(out, expected) < tol
    for name, grad, want in zip(('q', 'k', 'v', 'ranges', 'ts', 'bias'), grads, expected_grads):
        assert relative_error(grad, want) < 10 * tol, name


# the tiny DeiT's heads have 16 channels: its MultiMax trains through FlexAttention inside the compiled model
@pytest.mark.parametrize('family, attention', [('swin', 'softmax'), ('swin', 'multimax'), ('swin', 'inline'),
                                               ('swin', 'flatten'), ('deit', 'multimax')])
def test_inductor_compiled_model_on_cuda_matches_eager_without_recompiling(family, attention):
    model = tiny_model(family, attention).to(CUDA)
    x, weights = inputs(family, CUDA)
    counter = CompileCounterWithBackend('inductor')
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    got = forward_backward(compiled, x, weights)
    model.zero_grad(set_to_none=True)
    again = forward_backward(compiled, x.flip(0), weights)
    model.zero_grad(set_to_none=True)
    want = forward_backward(model, x, weights)
    assert counter.frame_count == 2  # one graph for inference, one for training, each kept for the second batch
    assert relative_error(again[0], model.eval()(x.flip(0))) < 1e-5
    assert relative_error(got[0], want[0]) < 1e-5 and relative_error(got[1], want[1]) < 1e-5
    assert_gradients_close(got[2], want[2], 1e-4)


def test_train_and_eval_on_cuda_with_amp_and_compile(tmp_path, few_digits, capsys):  # noqa: F811
    """The demo on the GPU: a compiled first epoch with bfloat16 autocast, a second epoch resumed uncompiled with
    float16 and its gradient scaler, then eval.py with and without --compile giving the same top-1."""
    output = tmp_path / 'run'
    base = ['--cfg', TINY_DEMO, '--output', str(output), '--data-path', str(few_digits)]
    opts = ['DEVICE', 'cuda', 'DATA.DATASET', 'imagefolder', 'TRAIN.EPOCHS', '2', 'TRAIN.EPOCHS_PER_RUN', '1']
    assert train_main(base + ['--compile', '--opts', *opts, 'AMP.DTYPE', 'bfloat16']) == 0
    assert train_main(base + ['--opts', *opts, 'AMP.DTYPE', 'float16']) == 0
    with open(output / 'log.jsonl') as f:
        epochs = [json.loads(line) for line in f]
    assert [e['epoch'] for e in epochs] == [0, 1]
    assert all(torch.isfinite(torch.tensor(e['train_loss'])) for e in epochs)

    capsys.readouterr()
    evaluate = ['--checkpoint', str(output / 'last.pth'), '--data-path', str(few_digits), '--batch-size', '20',
                '--opts', 'DEVICE', 'cuda']
    assert eval_main(evaluate) == 0
    eager = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert eval_main(evaluate[:-3] + ['--compile', '--opts', 'DEVICE', 'cuda']) == 0
    compiled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert eager['count'] == compiled['count'] == 50 and compiled['compiled']
    assert abs(compiled['top1'] - eager['top1']) <= 100 / 50 and compiled['loss'] == pytest.approx(eager['loss'],
                                                                                                     rel=1e-2)


@pytest.mark.parametrize('qk_dim', [8, 16])
def test_multimax_heads_too_small_for_flex_attention_on_cuda_take_the_paths_without_it(qk_dim):
    """Inductor's CUDA FlexAttention kernel takes heads of 16 channels or more, in q and k and in v: smaller ones
    run the plain path (and match the formula), and forcing FlexAttention on them names the limit."""
    q, k, v, bias, mask = windows(heads=2, n=9, d=8)
    q, k = (torch.randn(*t.shape[:-1], qk_dim, dtype=t.dtype) for t in (q, k))
    ranges, ts = spec_parameters()
    args = [t.to(CUDA, torch.float32).requires_grad_() for t in (q, k, v, ranges, ts, bias)]
    out = multimax_attention(*args, mask.to(CUDA, torch.float32))
    expected = plain_multimax(q, k, v, ranges, ts, bias, mask)
    assert relative_error(out, expected) < 1e-5
    with pytest.raises(ValueError, match=r"^the FlexAttention path of MultiMax on CUDA takes heads of at least 16 "
                                         rf"channels, got {qk_dim} \(q, k\) and 8 \(v\)$"):
        multimax_attention(*args, use_flex=True)
