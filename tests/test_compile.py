"""torch.compile(fullgraph=True) of every family with every attention on a tiny configuration.

`fullgraph=True` turns any graph break into an error; the traced graph runs on the eager backend (kernel
generation is the benchmark's business: `scripts/benchmark.py --compile`), and its outputs and gradients must
match the eager model's.
"""
import pytest
import torch

import timm

import models  # noqa: F401  (registers the families)
from models.attention import list_attentions
from models.attention.multimax import multimax_attention

# Tiny versions of each family that still reach every grouping: class token (DeiT), spatial reduction (PVT),
# shifted windows and a window covering the grid (Swin), stripes and a single global branch (CSwin).
TINY = {
    'deit': dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
    'pvt': dict(img_size=64, embed_dims=[16, 32, 32, 32], num_heads=[2, 2, 2, 2], depths=[1, 1, 1, 1],
                mlp_ratios=[2, 2, 2, 2]),
    'swin': dict(img_size=64, embed_dim=16, depths=[2, 1, 1, 1], num_heads=[2, 2, 2, 2], window_size=2),
    'cswin': dict(img_size=64, embed_dim=16, depth=[1, 1, 1, 1], num_heads=[2, 2, 2, 2], split_size=[1, 2, 2, 2]),
}


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def gradients(model: torch.nn.Module):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_compiled_matches_eager(family: str, attention: str) -> None:
    torch.manual_seed(0)
    model = timm.create_model(f'softmax_{family}_tiny', attn_type=attention, num_classes=5, drop_path_rate=0.,
                              **TINY[family])
    size = TINY[family]['img_size']
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


@pytest.mark.parametrize('family', ['deit', 'swin'])
def test_fullgraph_compile_of_multimax_in_row_blocks_matches_eager(family, monkeypatch):
    """MultiMax's path in blocks of query rows (an autograd.Function with a recomputing backward) traces too."""
    monkeypatch.setattr('models.attention.multimax._ROW_BLOCK_BYTES', 1)
    monkeypatch.setattr('models.attention.multimax._PLAIN_TRAINING_BYTES', 0)
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
