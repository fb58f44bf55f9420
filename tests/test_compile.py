"""torch.compile(fullgraph=True) of every family with every attention on a tiny configuration, MultiMax through
its CPU kernel (with a position bias and a window mask in inference), through FlexAttention when compiled for CPU
inference with causal masking or without the kernel, and the `--compile` / `TRAIN.COMPILE` path of train.py and
eval.py.

`fullgraph=True` turns any graph break into an error; the traced graph runs on the eager backend (kernel
generation is the benchmark's business: `scripts/benchmark.py --compile`), except in the small inductor tests of
MultiMax's paths, and its outputs and gradients must match the eager model's.
"""
import json
import math
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import timm

import engine.evaluation
import models  # noqa: F401  (registers the families)
from engine.cli import eval_main, train_main
from engine.data import prepare_digits
from engine.errors import run_cli
from models.attention import list_attentions
from models.attention import multimax_cpu
from models.attention.mixer import is_exporting
from models.attention.multimax import multimax_attention
from digits_subset import copy_digits_subset
from reference import SPEC_RANGES, SPEC_TS, max_abs_err

REPO = Path(__file__).resolve().parents[1]
TINY_DEMO = str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml')

# Tiny versions of each family that still reach every grouping: class token (DeiT), spatial reduction (PVT),
# shifted windows and a window covering the grid (Swin), stripes and a single global branch (CSwin).
TINY = {
    'deit': dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
    'pvt': dict(img_size=64, embed_dims=[16, 32, 32, 32], num_heads=[2, 2, 2, 2], depths=[1, 1, 1, 1],
                mlp_ratios=[2, 2, 2, 2]),
    'swin': dict(img_size=64, embed_dim=16, depths=[2, 1, 1, 1], num_heads=[2, 2, 2, 2], window_size=2),
    'cswin': dict(img_size=64, embed_dim=16, depth=[1, 1, 1, 1], num_heads=[2, 2, 2, 2], split_size=[1, 2, 2, 2]),
}
# Smaller still where the CPU tests trace, which takes seconds per block: one DeiT block, and Swin in two stages, a
# 4x4 grid of 2x2 windows (shifted in the second block) then a 2x2 grid that one window covers. (test_cuda.py keeps
# TINY: there the heads of Swin's deeper stages are wide enough for FlexAttention on windows.)
TRACED = {**TINY, 'deit': dict(TINY['deit'], depth=1),
          'swin': dict(img_size=16, embed_dim=16, depths=[2, 1], num_heads=[2, 2], window_size=2)}


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def gradients(model: torch.nn.Module):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def tiny_model(family: str, attention: str, sizes: Dict[str, Dict[str, Any]] = TINY) -> nn.Module:
    """The tiny model of `family` (its `sizes`) with `attention` in every block, 5 classes, no drop path, from
    seed 0."""
    torch.manual_seed(0)
    return timm.create_model(f'softmax_{family}_tiny', attn_type=attention, num_classes=5, drop_path_rate=0.,
                             **sizes[family])


def assert_compiled_matches_eager(family: str, attention: str) -> None:
    model = tiny_model(family, attention, TRACED)
    size = TRACED[family]['img_size']
    x = torch.randn(2, 3, size, size)
    weights = torch.randn(2, 5)

    compiled = torch.compile(model, fullgraph=True, backend='eager')
    out = compiled(x)
    (out * weights).sum().backward()
    compiled_grads = gradients(model)
    model.zero_grad(set_to_none=True)

    expected = model(x)
    (expected * weights).sum().backward()
    expected_grads = gradients(model)

    assert (out - expected).abs().max().item() < 1e-5
    assert compiled_grads.keys() == expected_grads.keys() and len(expected_grads) > 0
    for name, grad in expected_grads.items():
        assert (compiled_grads[name] - grad).abs().max().item() < 1e-5, name


@pytest.mark.parametrize('attention', list_attentions())
@pytest.mark.parametrize('family', list(TINY))
def test_fullgraph_compile_matches_eager(family, attention):
    assert_compiled_matches_eager(family, attention)


class _ExportProbe(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if is_exporting() else x - 1


def test_only_torch_export_takes_the_exporters_paths():
    """`is_exporting()` chooses the paths every exporter takes (no custom kernels): not in eager mode, not inside
    torch.compile (torch 2.11's tracer answers torch.compiler.is_exporting() with True there, which took the
    compiled models off their kernels), but under torch.export."""
    x = torch.zeros(2)
    assert _ExportProbe()(x).tolist() == [-1, -1]
    assert torch.compile(_ExportProbe(), fullgraph=True, backend='eager')(x).tolist() == [-1, -1]
    assert torch.export.export(_ExportProbe(), (x,)).module()(x).tolist() == [1, 1]


# Bytes of scores per block of query rows that leave a few rows per block, which the trace unrolls: 7 of DeiT's 17
# tokens (272 bytes a row for two images of two heads), 2 of the 4 tokens of a window in Swin's first stage, shifted
# and not (256 bytes a row: four windows an image); Swin's last stage, one window, is small enough for the plain path.
ROW_BLOCK_BYTES = {'deit': 2048, 'swin': 512}


@pytest.mark.parametrize('family', list(ROW_BLOCK_BYTES))
def test_fullgraph_compile_of_multimax_in_row_blocks_matches_eager(family, monkeypatch):
    """MultiMax's path in blocks of query rows (an autograd.Function with a recomputing backward) traces too."""
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', ROW_BLOCK_BYTES[family])
    monkeypatch.setattr('models.attention.multimax._PLAIN_TRAINING_BYTES', 0)
    monkeypatch.setattr('models.attention.multimax.cpu_kernel_available', lambda: False)
    assert_compiled_matches_eager(family, 'multimax')


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
def test_fullgraph_compile_of_multimax_flex_training_matches_eager():
    """The CUDA training path of MultiMax (FlexAttention forward, backward in row blocks) traces into one graph
    with its backward; on CPU FlexAttention runs its unfused reference."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 9, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 9, 9, requires_grad=True)
    mask = torch.where(torch.rand(2, 9, 9) < 0.3, -100., 0.)
    ranges, ts = (torch.randn(4).mul_(0.3).requires_grad_() for _ in range(2))
    inputs = (q, k, v, ranges, ts, bias)

    def attention(q, k, v, ranges, ts, bias):
        return multimax_attention(q, k, v, ranges, ts, bias, mask, use_flex=True)

    out = torch.compile(attention, fullgraph=True, backend='aot_eager')(*inputs)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    expected = multimax_attention(q, k, v, ranges, ts, bias, mask, use_flex=False)
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs)
    assert (out - expected).abs().max().item() < 1e-5
    for grad, want in zip(grads, expected_grads):
        assert (grad - want).abs().max().item() < 1e-4


# ---------------------------------------------------------------- MultiMax through FlexAttention when compiled

def flex_calls(graphs) -> int:
    return sum(node.target is torch.ops.higher_order.flex_attention for g in graphs for node in g.graph.nodes)


def plain_multimax(q, k, v, ranges, ts, bias, mask):
    """The formula: softmax(σ(q·kᵀ/√d + bias) + mask[b % nW]) v, differentiable in every input but the mask."""
    x, b, t = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias, ranges, ts
    scores = (x + t[0] * (b[0] - x).clamp(min=0) + t[1] * (x - b[1]).clamp(min=0)
              + t[2] * (b[2] - x).clamp(min=0) ** 2 + t[3] * (x - b[3]).clamp(min=0) ** 2)
    scores = scores + torch.stack([mask[b % mask.shape[0]] for b in range(q.shape[0])]).unsqueeze(1)
    return scores.softmax(dim=-1) @ v


def multimax_inputs(requires_grad: bool = False):
    """Windows of two images (3 windows each, 2 heads, 7 tokens), a position bias and a window mask, float32."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 7, 8, requires_grad=requires_grad) for _ in range(3))
    bias = torch.randn(2, 7, 7, requires_grad=requires_grad)
    mask = torch.where(torch.rand(3, 7, 7) < 0.3, -100., 0.)
    ranges, ts = (torch.tensor(p, requires_grad=requires_grad) for p in (SPEC_RANGES, SPEC_TS))
    return q, k, v, ranges, ts, bias, mask


@pytest.mark.parametrize('causal', [False, True], ids=['mask', 'causal'])
def test_compiled_cpu_inference_runs_multimax_through_flex_attention(causal):
    """Inductor's fused CPU FlexAttention kernel with σ as `score_mod` and the window mask (where MultiMax's own
    kernel is not taken) or causal masking, against the float64 formula (FlexAttention takes no float64 on the
    CPU: float32 to rounding)."""
    q, k, v, ranges, ts, _, mask = multimax_inputs()
    counter = CompileCounterWithBackend('inductor')

    def attention(q, k, v, ranges, ts):
        if causal:
            return multimax_attention(q, k, v, ranges, ts, causal=True)
        return multimax_attention(q, k, v, ranges, ts, mask=mask, use_kernel=False)

    with torch.no_grad():
        out = torch.compile(attention, fullgraph=True, backend=counter)(q, k, v, ranges, ts)
    assert flex_calls(counter.graphs) == 1
    no_bias = torch.zeros(1, 7, 7, dtype=torch.float64)
    added = torch.full((1, 7, 7), -math.inf).triu(1) if causal else mask
    expected = plain_multimax(*(t.double() for t in (q, k, v, ranges, ts)), no_bias, added.double())
    assert out.dtype == torch.float32 and max_abs_err(out.double(), expected) < 1e-5


def test_compiled_cpu_training_of_multimax_keeps_its_own_backward():
    """FlexAttention has no backward pass on the CPU: compiled training takes the plain path, whose gradients
    (of q, k, v, the bias and σ's parameters) match the float64 formula's."""
    inputs = multimax_inputs(requires_grad=True)
    *differentiable, mask = inputs
    counter = CompileCounterWithBackend('aot_eager')

    def attention(q, k, v, ranges, ts, bias):
        return multimax_attention(q, k, v, ranges, ts, bias, mask)

    out = torch.compile(attention, fullgraph=True, backend=counter)(*differentiable)
    grads = torch.autograd.grad(out.square().sum(), differentiable)
    assert flex_calls(counter.graphs) == 0
    wide = [t.detach().double().requires_grad_() for t in differentiable]
    expected = plain_multimax(*wide, mask.double())
    expected_grads = torch.autograd.grad(expected.square().sum(), wide)
    assert max_abs_err(out.double(), expected) < 1e-5
    for grad, want in zip(grads, expected_grads):
        assert max_abs_err(grad.double(), want) < 1e-4


@pytest.mark.parametrize('use_kernel', [None, False], ids=['kernel', 'without-kernel'])
def test_inductor_compiles_multimax_swin_for_cpu_inference_in_one_graph(monkeypatch, use_kernel):
    """Compiled Swin inference calls MultiMax's kernel with the position bias and the window mask. Without the
    kernel it takes the plain path, which inductor fuses: the bias is computed in the graph from its table, which
    inductor's CPU FlexAttention cannot read in a `score_mod` (its lowering fails)."""
    if use_kernel is False:
        monkeypatch.setattr(multimax_cpu, '_extension', None)  # a build that failed
    torch.manual_seed(0)
    model = timm.create_model('multimax_swin_tiny', num_classes=5, **TRACED['swin']).eval()
    x = torch.randn(2, 3, TRACED['swin']['img_size'], TRACED['swin']['img_size'])
    counter = CompileCounterWithBackend('inductor')
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend=counter)(x)
        expected = model(x)
    assert counter.frame_count == 1 and flex_calls(counter.graphs) == 0
    assert calls_kernel(counter.graphs) == (use_kernel is None)
    assert max_abs_err(out, expected) < 1e-5


# ---------------------------------------------------------------- the --compile / TRAIN.COMPILE user path

@pytest.fixture(scope='module')
def few_digits(tmp_path_factory) -> Path:
    """An image folder of the digits demo's first 8 training and 5 validation images of each of its 10 classes."""
    digits = Path(prepare_digits(str(tmp_path_factory.getbasetemp() / 'digits')))
    return copy_digits_subset(digits, tmp_path_factory.mktemp('few_digits'), 8, 5)


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters['stats']['unique_graphs']


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_train_and_eval_with_compile(tmp_path, few_digits, capsys):
    """train.py --compile: one graph for the training step and one per validation batch size, kept over epochs;
    plain checkpoint keys that resume without compilation; eval.py --compile equal to eval.py."""
    output = tmp_path / 'run'
    # 5 updates of 16 images an epoch; validation in batches of 24 (50 images: 2 full, then 2); one block of the
    # demo's two, as each graph's trace takes seconds per block
    base = ['--cfg', TINY_DEMO, '--output', str(output), '--data-path', str(few_digits)]
    opts = ['DATA.DATASET', 'imagefolder', 'TRAIN.EPOCHS', '3', 'TRAIN.EPOCHS_PER_RUN', '2',
            'TRAIN.COMPILE_BACKEND', 'eager', 'MODEL.KWARGS.depth', '1']
    torch._dynamo.utils.counters.clear()
    assert train_main(base + ['--compile', '--opts', *opts]) == 0
    assert graphs_compiled() == 3  # no recompilation in the second epoch
    logged = [line for line in capsys.readouterr().out.splitlines() if 'torch.compile:' in line]
    assert len(logged) == 2 and 'the training step compiled in about' in logged[0]

    checkpoint = torch.load(output / 'last.pth', weights_only=True)
    plain_keys = timm.create_model('inline_deit_tiny', num_classes=10, img_size=16, patch_size=4, embed_dim=64,
                                   depth=1, num_heads=4).state_dict().keys()
    assert checkpoint['model'].keys() == checkpoint['model_ema'].keys() == plain_keys
    assert (checkpoint['epoch'], checkpoint['step']) == (1, 10)

    assert train_main(base + ['--opts', *opts]) == 0  # resumes without compilation
    assert torch.load(output / 'last.pth', weights_only=True)['step'] == 15

    torch._dynamo.utils.counters.clear()
    capsys.readouterr()
    evaluate = ['--checkpoint', str(output / 'last.pth'), '--data-path', str(few_digits), '--batch-size', '20']
    assert eval_main(evaluate) == 0
    eager = last_json(capsys)
    assert eval_main(evaluate + ['--compile', '--opts', 'TRAIN.COMPILE_BACKEND', 'eager']) == 0
    compiled = last_json(capsys)
    assert graphs_compiled() == 2  # batches of 20 and the last one of 10
    assert compiled['compiled'] and not eager['compiled'] and compiled['count'] == eager['count'] == 50
    assert compiled['top1'] == eager['top1'] and compiled['loss'] == pytest.approx(eager['loss'], rel=1e-5)


class GraphBreak(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.model(x)


def test_a_model_that_does_not_compile_as_one_graph_fails_on_one_line(monkeypatch, capsys):
    create_model = engine.evaluation.create_model
    monkeypatch.setattr(engine.evaluation, 'create_model', lambda *a, **k: GraphBreak(create_model(*a, **k)))
    code = run_cli(eval_main, ['--cfg', TINY_DEMO, '--throughput', '--batch-size', '2', '--warmup-forwards', '1',
                               '--timed-forwards', '1', '--compile', '--opts', 'TRAIN.COMPILE_BACKEND', 'eager'])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: model 'inline_deit_tiny' cannot be compiled as one graph (")


def test_compile_settings_are_checked_on_one_line(capsys):
    for opts, message in ((['TRAIN.COMPILE_MODE', 'fastest'], "TRAIN.COMPILE_MODE is 'fastest'; expected one of"),
                          (['TRAIN.COMPILE_BACKEND', 'nope'], "TRAIN.COMPILE_BACKEND is 'nope'; expected one of"),
                          (['TRAIN.COMPILE_BACKEND', 'eager', 'TRAIN.COMPILE_MODE', 'max-autotune'],
                           "TRAIN.COMPILE_MODE is 'max-autotune'; expected 'default' with TRAIN.COMPILE_BACKEND")):
        code = run_cli(train_main, ['--cfg', TINY_DEMO, '--compile', '--opts', *opts])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0]


def calls_kernel(graphs, op: str = 'zoo.multimax_cpu_attention') -> bool:
    """Whether a traced graph or one nested in it (an autograd.Function's) calls MultiMax's CPU kernel (`op`: its
    forward or `zoo.multimax_cpu_attention_backward`)."""
    return any(op in module.code for g in graphs for module in g.modules() if isinstance(module, torch.fx.GraphModule))


def test_compiled_cpu_multimax_inference_without_bias_calls_its_kernel_in_one_graph_per_batch_size():
    """Without bias or mask, compiled CPU inference calls MultiMax's CPU kernel (a custom op) inside the graph,
    against the float64 formula, and a second batch of the same size reuses the graph."""
    q, k, v, ranges, ts, _, _ = multimax_inputs()
    no_bias = (torch.zeros(2, 7, 7), torch.zeros(1, 7, 7))
    expected = plain_multimax(*(t.double() for t in (q, k, v, ranges, ts, *no_bias)))
    counter = CompileCounterWithBackend('inductor')
    compiled = torch.compile(multimax_attention, fullgraph=True, backend=counter)
    with torch.no_grad():
        out = compiled(q, k, v, ranges, ts)
        compiled(q + 1, k, v, ranges, ts)
    assert counter.frame_count == 1 and calls_kernel(counter.graphs)
    assert max_abs_err(out.double(), expected) < 1e-5


def test_compiled_cpu_multimax_training_calls_its_kernel_forward_and_backward():
    """Compiled training without bias or mask calls the kernel's forward and backward (custom ops) in one graph,
    short sequences too; the gradients match the float64 formula's."""
    q, k, v, ranges, ts, _, _ = multimax_inputs()
    no_bias = (torch.zeros(2, 7, 7), torch.zeros(1, 7, 7))
    differentiable = [t.detach().clone().requires_grad_() for t in (q, k, v, ranges, ts)]
    counter = CompileCounterWithBackend('aot_eager')
    out = torch.compile(multimax_attention, fullgraph=True, backend=counter)(*differentiable)
    grads = torch.autograd.grad(out.square().sum(), differentiable)
    assert counter.frame_count == 1 and calls_kernel(counter.graphs)
    assert calls_kernel(counter.graphs, 'zoo.multimax_cpu_attention_backward')
    wide = [t.detach().double().requires_grad_() for t in differentiable]
    expected = plain_multimax(*wide, *(t.double() for t in no_bias))
    expected_grads = torch.autograd.grad(expected.square().sum(), wide)
    assert max_abs_err(out.double(), expected) < 1e-5
    for grad, want in zip(grads, expected_grads):
        assert max_abs_err(grad.double(), want) < 1e-4
