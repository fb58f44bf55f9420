"""`convert_to_onednn`: the float32 CPU products of the linear layers through oneDNN, outputs and gradients
to float32 rounding of the float64 formula, with the model's state-dict keys and values unchanged, eager and
compiled by inductor, counted by the FLOP counter as `F.linear`; autocast and TorchScript keep `F.linear`.
Softmax and MultiMax attention multiply through oneDNN in their fused CPU kernel (softmax against 128 keys or
more), forward and backward, and the linear attentions by oneDNN's batched product.
"""
import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import timm
from timm.layers import Mlp

import engine.build
import models
from engine.cli import train_main
from engine.config import load_config
from engine.data import prepare_digits
from engine.errors import USAGE_EXIT_CODE, run_cli
from models.attention import multimax_cpu
from models.onednn import OneDNNLinear, OneDNNMlp, convert_to_onednn, onednn_conv2d_gelu
from models.pvt_v2 import DepthwiseConvMlp

from dispatch import recorded_ops

ONEDNN_LINEAR = torch.ops.zoo.onednn_linear.default
ONEDNN_LINEAR_GELU = torch.ops.zoo.onednn_linear_gelu.default
ONEDNN_CONV2D_GELU = torch.ops.zoo.onednn_conv2d_gelu.default
GELU = torch.ops.aten.gelu.default
ONEDNN_BMM = torch.ops.zoo.onednn_bmm.default
ATTENTION_KERNEL = torch.ops.zoo.multimax_cpu_attention.default
ATTENTION_KERNEL_BACKWARD = torch.ops.zoo.multimax_cpu_attention_backward.default
SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BLAS_PRODUCTS = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten.baddbmm.default}
TINY_DEMO = str(Path(__file__).resolve().parents[1] / 'configs' / 'demo' / 'digits_tiny.yaml')
TINY_DEIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def compile_recording_graphs(model: nn.Module):
    """`torch.compile(model, fullgraph=True)` by inductor, and the list into which each graph it compiles is written
    as text."""
    graphs = []

    def inspect_then_inductor(gm, example_inputs):
        graphs.append(str(gm.graph))
        return torch._inductor.compile(gm, example_inputs)

    return torch.compile(model, fullgraph=True, backend=inspect_then_inductor), graphs


def tiny_pair(name: str = 'inline_deit_tiny', **kwargs):
    kwargs = kwargs or TINY_DEIT
    torch.manual_seed(0)
    plain = timm.create_model(name, **kwargs).eval()
    converted = timm.create_model(name, **kwargs).eval()
    converted.load_state_dict(plain.state_dict())
    return plain, convert_to_onednn(converted)


@pytest.mark.parametrize('out_features', [80, 24])  # the weight gradient's two orders of operands
@pytest.mark.parametrize('shape, bias', [((7, 48), True), ((3, 5, 48), True), ((2, 3, 4, 48), False)])
def test_the_layer_and_its_gradients_are_the_float64_formula_to_float32_rounding(shape, bias, out_features):
    torch.manual_seed(0)
    layer = convert_to_onednn(nn.Linear(48, out_features, bias=bias))
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape[:-1], out_features)
    out, ops = recorded_ops(layer, x)
    _, backward_ops = recorded_ops(out.backward, grad)
    assert type(layer) is OneDNNLinear and ops.count(ONEDNN_LINEAR) == 1 and not BLAS_PRODUCTS & set(ops)
    assert backward_ops.count(ONEDNN_LINEAR) == 2 and not BLAS_PRODUCTS & set(backward_ops)
    params = [x, layer.weight] + ([layer.bias] if bias else [])
    exact = [p.detach().double().requires_grad_() for p in params]
    reference = F.linear(*exact[:2], exact[2] if bias else None)
    reference.backward(grad.double())
    assert out.shape == (*shape[:-1], out_features) and out.dtype == torch.float32
    for value, expected in [(out, reference)] + [(p.grad, e.grad) for p, e in zip(params, exact)]:
        # float32 rounding of sums of up to 80 (forward, grad_x) or 42 (grad_W, grad_b) products
        assert (value.double() - expected).abs().max().item() < 80 * 2 ** -24 * expected.abs().max().item()


@pytest.mark.parametrize('out_features', [80, 24])
def test_a_head_on_the_class_token_gets_the_float64_gradients(out_features):
    """A head's input pooled as the class token of every image is a strided view, and a loss summed over its
    outputs gives a gradient of stride 0: both reach the weight gradient's products as they are."""
    torch.manual_seed(0)
    layer = convert_to_onednn(nn.Linear(48, out_features))
    tokens = torch.randn(6, 17, 48, requires_grad=True)
    layer(tokens[:, 0]).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (tokens, layer.weight, layer.bias)]
    F.linear(exact[0][:, 0], *exact[1:]).sum().backward()
    for value, expected in zip((tokens.grad, layer.weight.grad, layer.bias.grad), (e.grad for e in exact)):
        assert (value.double() - expected).abs().max().item() < 48 * 2 ** -24 * expected.abs().max().item()
    assert layer.weight.grad.is_contiguous()


def test_a_converted_model_keeps_its_state_dict_and_outputs(onednn_products):
    plain, converted = tiny_pair()
    linears = [m for m in converted.modules() if isinstance(m, nn.Linear)]
    mlps = [m for m in converted.modules() if isinstance(m, Mlp)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    assert mlps and all(type(m) is OneDNNMlp for m in mlps)
    assert list(converted.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(converted.state_dict().values(), plain.state_dict().values()))
    converted.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = plain(x)
        out, ops = recorded_ops(converted, x)
    # each MLP's first layer and its GELU in one product (InLine's residual has a GELU of its own)
    gelus = [m for m in converted.modules() if isinstance(m, nn.GELU)]
    assert ops.count(ONEDNN_LINEAR_GELU) == len(mlps) and ops.count(ONEDNN_LINEAR) == len(linears) - len(mlps)
    assert not BLAS_PRODUCTS & set(ops) and ops.count(torch.ops.aten.gelu.default) == len(gelus) - len(mlps)
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize('approximate', ['none', 'tanh'])
def test_the_mlp_applies_gelu_inside_its_first_product_in_inference_only(approximate):
    torch.manual_seed(0)
    mlp = Mlp(48, 96, act_layer=partial(nn.GELU, approximate=approximate))
    exact = Mlp(48, 96, act_layer=partial(nn.GELU, approximate=approximate)).double()
    exact.load_state_dict(mlp.state_dict())
    convert_to_onednn(mlp)
    x = torch.randn(3, 7, 48)
    with torch.no_grad():
        out, ops = recorded_ops(mlp, x)
        expected = exact(x.double())
    assert type(mlp) is OneDNNMlp and ops.count(ONEDNN_LINEAR_GELU) == 1 and torch.ops.aten.gelu.default not in ops
    # float32 rounding of sums of 48 and 96 products
    assert (out.double() - expected).abs().max().item() < 100 * 2 ** -24 * expected.abs().max().item()
    # with gradients, the product and GELU apart: GELU's backward needs the product
    out, ops = recorded_ops(mlp, x)
    assert ONEDNN_LINEAR_GELU not in ops and ops.count(torch.ops.aten.gelu.default) == 1
    out.sum().backward()
    exact(x.double()).sum().backward()
    for (name, p), want in zip(mlp.named_parameters(), exact.parameters()):
        assert (p.grad.double() - want.grad).abs().max().item() < 1e-5 * want.grad.abs().max().item(), name


@pytest.mark.parametrize('approximate', ['none', 'tanh'])
def test_the_fused_depthwise_convolution_and_gelu_is_the_float64_formula_to_float32_rounding(approximate):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 6, 48).permute(0, 3, 1, 2)  # a channels-last image of tokens, as the MLP passes it
    weight, bias = torch.randn(48, 1, 3, 3), torch.randn(48)
    out = onednn_conv2d_gelu(x, weight, bias, [1, 1], 48, approximate)
    expected = F.gelu(F.conv2d(x.double(), weight.double(), bias.double(), padding=1, groups=48),
                      approximate=approximate)
    assert out.shape == (2, 48, 7, 6) and out.is_contiguous(memory_format=torch.channels_last)
    # float32 rounding of sums of 9 products and a bias
    assert (out.double() - expected).abs().max().item() < 20 * 2 ** -24 * expected.abs().max().item()


def test_pvt_v2_applies_gelu_inside_its_depthwise_convolution_in_inference_only():
    plain, converted = tiny_pair('softmax_pvt_v2_b0', img_size=64, depths=(1, 1, 1, 1), num_classes=5)
    mlps = [m for m in converted.modules() if isinstance(m, DepthwiseConvMlp)]
    assert len(mlps) == 4 and all(m.onednn for m in mlps) and not any(m.onednn for m in plain.modules()
                                                                          if isinstance(m, DepthwiseConvMlp))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = plain(x)
        out, ops = recorded_ops(converted, x)
        assert ops.count(ONEDNN_CONV2D_GELU) == len(mlps) and GELU not in ops
        assert (out - expected).abs().max().item() < 1e-5
        flops = []
        for model in (plain, converted):
            with FlopCounterMode(display=False) as counter:
                model(x)
            flops.append(counter.get_total_flops())
        assert flops[0] == flops[1]
    torch.compiler.reset()
    compiled, graphs = compile_recording_graphs(converted)
    with torch.no_grad():  # inductor calls the op as it stands, with its fake implementation's layout
        out = compiled(x)
    assert graphs[0].count('zoo.onednn_conv2d_gelu') == len(mlps) and (out - expected).abs().max().item() < 1e-5
    torch.compiler.reset()
    plain.train(), converted.train()
    (plain(x) ** 2).sum().backward()
    loss, ops = recorded_ops(lambda: (converted(x) ** 2).sum())
    assert ONEDNN_CONV2D_GELU not in ops and ops.count(GELU) == len(mlps)
    loss.backward()
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_the_flop_counter_counts_the_onednn_product_as_f_linear():
    plain, converted = tiny_pair()
    x = torch.randn(2, 3, 32, 32)
    counts = []
    for model in (plain, converted):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(x)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_inductor_compiles_the_onednn_product_and_its_backward_without_frozen_weights():
    torch.compiler.reset()
    plain, converted = tiny_pair()
    x = torch.randn(2, 3, 32, 32)
    compiled, graphs = compile_recording_graphs(converted)
    with torch.no_grad():
        out, expected = compiled(x), plain(x)
        assert (out - expected).abs().max().item() < 1e-5
        # new weights: the graph reads them, it did not freeze them
        for p in converted.parameters():
            p.mul_(0.5)
        plain.load_state_dict(converted.state_dict())
        assert (compiled(x) - plain(x)).abs().max().item() < 1e-5
    linears = len([m for m in converted.modules() if isinstance(m, nn.Linear)])
    mlps = len([m for m in converted.modules() if isinstance(m, Mlp)])
    assert len(graphs) == 1 and graphs[0].count('zoo.onednn_linear') == linears
    assert graphs[0].count('zoo.onednn_linear_gelu') == mlps
    # training: the compiled forward and backward passes give the plain model's gradients
    plain.train(), converted.train()
    (plain(x) ** 2).sum().backward()
    (compiled(x) ** 2).sum().backward()
    assert len(graphs) == 2 and graphs[1].count('zoo.onednn_linear') == linears
    assert 'zoo.onednn_linear_gelu' not in graphs[1]
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name
    torch.compiler.reset()


def test_a_converted_model_trains_to_the_gradients_of_the_plain_one():
    plain, converted = tiny_pair()
    plain.train(), converted.train()
    x = torch.randn(2, 3, 32, 32)
    (plain(x) ** 2).sum().backward()
    (converted(x) ** 2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_autocast_and_torchscript_take_f_linear():
    plain, converted = tiny_pair()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        out, ops = recorded_ops(converted, x)
        assert ONEDNN_LINEAR not in ops and torch.equal(out, plain(x))
    with torch.no_grad():
        scripted = torch.jit.script(converted)
        assert torch.equal(scripted(x), plain(x))


def test_torch_export_of_a_converted_model_takes_f_linear():
    plain, converted = tiny_pair()
    x = torch.randn(2, 3, 32, 32)
    exported = torch.export.export(converted, (x,))
    assert 'onednn' not in str(exported.graph) and 'linear' in str(exported.graph)
    with torch.no_grad():
        assert (exported.module()(x) - plain(x)).abs().max().item() < 1e-6


def test_without_onednn_the_conversion_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, 'is_available', lambda: False)
    with pytest.raises(RuntimeError, match=r"^oneDNN is not available in this PyTorch build, or "
                                           r"torch\.backends\.mkldnn\.enabled is False; expected "):
        convert_to_onednn(nn.Linear(4, 4))


def test_the_package_exports_the_conversion():
    assert models.convert_to_onednn is convert_to_onednn


def test_train_py_with_onednn_trains_as_the_plain_run_and_checks_its_settings(tmp_path, capsys, monkeypatch):
    digits = prepare_digits(str(tmp_path / 'digits'))
    records = []
    for extra in ([], ['--onednn']):
        output = tmp_path / f'run{len(records)}'
        argv = ['--cfg', TINY_DEMO, '--output', str(output), '--data-path', digits, *extra, '--opts',
                'DATA.BATCH_SIZE', '64', 'TRAIN.EPOCHS_PER_RUN', '1']
        assert run_cli(train_main, argv) == 0
        assert ('; products through oneDNN' in capsys.readouterr().out) == bool(extra)
        with open(output / 'log.jsonl') as f:
            records.append(json.loads(f.readline()))
        checkpoint = torch.load(output / 'last.pth', weights_only=True)
        assert checkpoint['model'].keys() == checkpoint['model_ema'].keys()
    plain, onednn = records
    assert onednn['train_loss'] == pytest.approx(plain['train_loss'], rel=1e-5)
    assert abs(onednn['val_top1'] - plain['val_top1']) <= 100 / 360 + 1e-9  # one validation image at most
    capsys.readouterr()
    code = run_cli(train_main, ['--cfg', TINY_DEMO, '--output', str(tmp_path / 'amp'), '--onednn', '--opts',
                                'AMP.ENABLED', 'True'])
    assert code == USAGE_EXIT_CODE and capsys.readouterr().err.strip().splitlines() == [
        "error: TRAIN.ONEDNN with AMP.ENABLED: the model's products would take autocast's path; expected float32 "
        "(leave out AMP.ENABLED or TRAIN.ONEDNN)"]
    assert not (tmp_path / 'amp').exists()
    # evaluation ignores the training key: a checkpoint's config that set it evaluates on any device
    cfg = load_config(TINY_DEMO, ['TRAIN.ONEDNN', 'True', 'DEVICE', 'cuda'])
    assert cfg.TRAIN.ONEDNN and cfg.DEVICE == 'cuda'
    monkeypatch.setattr(engine.build, 'onednn_available', lambda: False)
    code = run_cli(train_main, ['--cfg', TINY_DEMO, '--output', str(tmp_path / 'none'), '--onednn'])
    assert code == USAGE_EXIT_CODE and capsys.readouterr().err.strip().splitlines() == [
        "error: TRAIN.ONEDNN: this PyTorch build has no oneDNN, or torch.backends.mkldnn.enabled is False; "
        "expected torch.backends.mkldnn.is_available()"]
    assert not (tmp_path / 'none').exists()  # refused before the output folder is made


# 64 / 4 = 16² patches and a class token: 257 keys, heads of 64 channels
LONG_DEIT = dict(img_size=64, patch_size=4, embed_dim=128, depth=1, num_heads=2, num_classes=5)
# 32² patches and a class token: 1025 keys, several blocks of rows and keys in the kernel
LONGER_DEIT = dict(LONG_DEIT, img_size=128)


def test_softmax_takes_the_fused_kernel_with_onednn_products_in_inference_and_training(onednn_products,
                                                                                       onednn_matmuls):
    plain, converted = tiny_pair('softmax_deit_tiny', **LONG_DEIT)
    assert 'onednn=True' in repr(converted.blocks[0].attn)
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        expected = plain(x)
        (out, ops), products = onednn_matmuls(lambda: recorded_ops(converted, x))
    assert ops.count(ATTENTION_KERNEL) == 1 and SDPA_CPU not in ops
    # scores and values for 2 images × 2 heads, one block of rows and keys each (the linear layers' products are
    # oneDNN's inner products)
    assert products == 2 * 2 * 2
    assert (out - expected).abs().max().item() < 1e-5
    plain.train(), converted.train()
    (plain(x) ** 2).sum().backward()
    (loss, ops), products = onednn_matmuls(lambda: recorded_ops(lambda: (converted(x) ** 2).sum()))
    (_, backward_ops), backward_products = onednn_matmuls(lambda: recorded_ops(loss.backward))
    assert ops.count(ATTENTION_KERNEL) == 1 and backward_ops.count(ATTENTION_KERNEL_BACKWARD) == 1
    # the 5 backward products for 2 images × 2 heads, one block of all 257 rows and keys each
    assert (products, backward_products) == (2 * 4, 5 * 4)
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_autocast_and_export_keep_softmax_off_the_kernel():
    plain, converted = tiny_pair('softmax_deit_tiny', **LONG_DEIT)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        out, ops = recorded_ops(converted, x)
        assert ATTENTION_KERNEL not in ops and torch.equal(out, plain(x))
    exported = torch.export.export(converted, (x,))
    assert 'multimax_cpu' not in str(exported.graph)
    with torch.no_grad():
        assert (exported.module()(x) - plain(x)).abs().max().item() < 1e-5


# what the zoo says once where its CPU kernel cannot be built (`kernel_build_fails`)
KERNEL_BUILD_WARNING = ("MultiMax's CPU kernel could not be built or loaded (Ninja is required to load C++ "
                        "extensions); MultiMax runs unfused on CPU, softmax attention keeps "
                        "scaled_dot_product_attention, and the linear attentions torch's matmul")


@pytest.fixture
def kernel_build_fails(monkeypatch):
    """The CPU kernel not built yet, and its build failing as it does on a machine without ninja."""
    def failing_build(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(multimax_cpu, '_extension', multimax_cpu._NOT_LOADED)
    monkeypatch.setattr('torch.utils.cpp_extension.load', failing_build)


def test_without_the_kernel_a_converted_softmax_model_keeps_sdpa_and_says_so_once(kernel_build_fails, caplog):
    plain, converted = tiny_pair('softmax_deit_tiny', **LONG_DEIT)
    x = torch.randn(2, 3, 64, 64)
    with caplog.at_level('WARNING', logger=multimax_cpu.__name__), torch.no_grad():
        out, ops = recorded_ops(converted, x)
        converted(x)
    assert ATTENTION_KERNEL not in ops and ops.count(SDPA_CPU) == 1
    assert [r.getMessage() for r in caplog.records if r.name == multimax_cpu.__name__] == [KERNEL_BUILD_WARNING]
    with torch.no_grad():
        assert (out - plain(x)).abs().max().item() < 1e-5


def test_a_gradient_penalty_through_the_softmax_kernel_differentiates_the_formula():
    plain, converted = tiny_pair('softmax_deit_tiny', **LONGER_DEIT)
    x = torch.randn(1, 3, 128, 128)
    penalties = []
    for model in (plain, converted):
        images = x.clone().requires_grad_()
        # the plain model through the math backend: the CPU's fused kernel has no second derivative
        with sdpa_kernel(SDPBackend.MATH):
            (grad,) = torch.autograd.grad(model(images).square().sum(), images, create_graph=True)
        penalty = grad.square().sum()
        penalty.backward()
        penalties.append((penalty, [p.grad for p in model.parameters()]))
    (expected, expected_grads), (penalty, grads) = penalties
    assert (penalty - expected).abs().item() <= 1e-4 * expected.abs().item()
    for want, got in zip(expected_grads, grads):
        assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item() + 1e-7


def test_multimax_trains_through_its_kernel_with_onednn_products(onednn_products, onednn_matmuls):
    plain, converted = tiny_pair('softmax_deit_tiny', attn_type='multimax', **LONG_DEIT)
    plain.train(), converted.train()
    x = torch.randn(2, 3, 64, 64)
    (plain(x) ** 2).sum().backward()
    _, products = onednn_matmuls(lambda: (converted(x) ** 2).sum().backward())
    # oneDNN's matrix products (the linear layers' are its inner products): for each of 2 images × 2 heads, the
    # kernel's 2 forward ones and 5 backward ones, one block of all 257 rows and keys each
    assert products == 4 * (2 + 5)
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_shifted_windows_of_49_tokens_keep_scaled_dot_product_attention():
    plain, converted = tiny_pair('softmax_swin_tiny', img_size=56, window_size=7, embed_dim=32, depths=(2,),
                                 num_heads=(2,), num_classes=5)
    x = torch.randn(2, 3, 56, 56)
    with torch.inference_mode():
        out, ops = recorded_ops(converted, x)
        assert ATTENTION_KERNEL not in ops and (out - plain(x)).abs().max().item() < 1e-5


def test_a_compiled_converted_softmax_model_calls_the_kernel_and_trains_to_the_plain_gradients(
        onednn_products, onednn_matmuls):
    torch.compiler.reset()
    plain, converted = tiny_pair('softmax_deit_tiny', **LONGER_DEIT)
    compiled, graphs = compile_recording_graphs(converted)
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        assert (compiled(x) - plain(x)).abs().max().item() < 1e-5
    assert len(graphs) == 1 and graphs[0].count('zoo.multimax_cpu_attention') == 1
    plain.train(), converted.train()
    (plain(x) ** 2).sum().backward()
    loss = (compiled(x) ** 2).sum()
    _, backward_products = onednn_matmuls(loss.backward)
    assert len(graphs) == 2 and backward_products == 2 * 5 * 3 * 3  # the kernel's backward pass, as eager
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name
    torch.compiler.reset()


@pytest.mark.parametrize('transposed', [(False, False), (True, False), (False, True), (True, True)])
def test_the_batched_product_and_its_gradients_are_the_float64_formula_to_float32_rounding(onednn_products,
                                                                                           transposed):
    torch.manual_seed(0)
    exact = [torch.randn(5, 37, 24, dtype=torch.float64), torch.randn(5, 24, 19, dtype=torch.float64)]
    # operands as the attentions pass them: packed, or transposed views of packed tensors
    a, b = [(x.transpose(1, 2).contiguous().transpose(1, 2) if t else x).float().requires_grad_()
            for x, t in zip(exact, transposed)]
    grad = torch.randn(5, 37, 19, dtype=torch.float64)
    out = multimax_cpu.onednn_bmm(a, b)
    out.backward(grad.float())
    exact = [x.requires_grad_() for x in exact]
    (exact[0] @ exact[1]).backward(grad)
    assert out.shape == (5, 37, 19) and out.is_contiguous()
    for value, expected in [(out, exact[0].detach() @ exact[1].detach()), (a.grad, exact[0].grad),
                            (b.grad, exact[1].grad)]:
        # float32 rounding of sums of up to 37 products of unit normal numbers
        assert (value.double() - expected).abs().max().item() < 64 * 2 ** -24 * expected.abs().max().item()


@pytest.mark.parametrize('attention, products', [('inline', 2), ('flatten', 2), ('linear', 2), ('sima', 2)])
def test_the_linear_attentions_multiply_through_onednn_in_inference_and_training(onednn_products, attention, products,
                                                                                 onednn_matmuls):
    plain, converted = tiny_pair('softmax_deit_tiny', attn_type=attention, **TINY_DEIT)
    blocks = len(converted.blocks)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = plain(x)
        (out, ops), executed = onednn_matmuls(lambda: recorded_ops(converted, x))
    assert ops.count(ONEDNN_BMM) == products * blocks and not BLAS_PRODUCTS & set(ops)
    assert executed == products * blocks  # one oneDNN matrix product for all images and heads
    assert (out - expected).abs().max().item() < 1e-5
    plain.train(), converted.train()
    (plain(x) ** 2).sum().backward()
    (loss, ops), _ = onednn_matmuls(lambda: recorded_ops(lambda: (converted(x) ** 2).sum()))
    (_, backward_ops), backward_products = onednn_matmuls(lambda: recorded_ops(loss.backward))
    assert ops.count(ONEDNN_BMM) == products * blocks
    assert backward_ops.count(ONEDNN_BMM) == 2 * products * blocks and backward_products == 2 * products * blocks
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_a_compiled_converted_linear_attention_model_calls_the_batched_product_and_trains_to_the_plain_gradients(
        onednn_products, onednn_matmuls):
    torch.compiler.reset()
    plain, converted = tiny_pair('softmax_deit_tiny', attn_type='flatten', **TINY_DEIT)
    blocks = len(converted.blocks)
    compiled, graphs = compile_recording_graphs(converted)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (compiled(x) - plain(x)).abs().max().item() < 1e-5
    assert len(graphs) == 1 and graphs[0].count('zoo.onednn_bmm') == 2 * blocks
    plain.train(), converted.train()
    (plain(x) ** 2).sum().backward()
    loss = (compiled(x) ** 2).sum()
    _, backward_products = onednn_matmuls(loss.backward)
    # the compiled backward pass: two oneDNN products for each of the forward pass's two per block
    assert len(graphs) == 2 and graphs[1].count('zoo.onednn_bmm') == 2 * blocks and backward_products == 4 * blocks
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name
    torch.compiler.reset()


REFUSED_PRODUCT = ('mkldnn_matmul: mkldnn_matmul bf16 path needs the cpu support avx_ne_convert or avx512bw, '
                   'avx512vl and avx512dq, or AWS Graviton3')


def test_a_cpu_that_refuses_onednn_products_keeps_the_blas(monkeypatch, caplog):
    """torch's `mkldnn_matmul` refuses CPUs without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, float32 products
    included: the kernels took oneDNN's products wherever torch had them, and on such a CPU every converted model
    and MultiMax's oneDNN path failed in that error. A first product now tells, and the BLAS multiplies."""
    built = multimax_cpu._load()

    class RefusingCpu:
        def __getattr__(self, name):
            return getattr(built, name)

        def onednn_bmm(self, a, b):
            raise RuntimeError(REFUSED_PRODUCT)
    monkeypatch.setattr(multimax_cpu, '_extension', RefusingCpu())
    monkeypatch.setattr(multimax_cpu, '_onednn_products', None)
    with caplog.at_level('INFO', logger=multimax_cpu.__name__):
        assert not multimax_cpu.onednn_products_available()
    assert f"oneDNN's matrix product does not run on this CPU ({REFUSED_PRODUCT})" in caplog.text
    x = torch.randn(2, 3, 32, 32)
    for attention in ('inline', 'multimax'):
        plain, converted = tiny_pair('softmax_deit_tiny', attn_type=attention, **TINY_DEIT)
        with torch.no_grad():
            out, ops = recorded_ops(converted, x)
            assert ONEDNN_BMM not in ops and (out - plain(x)).abs().max().item() < 1e-5, attention
        plain.train(), converted.train()
        (plain(x) ** 2).sum().backward()
        (converted(x) ** 2).sum().backward()
        for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_without_the_kernel_a_converted_linear_attention_model_keeps_torch_matmul(kernel_build_fails, caplog):
    plain, converted = tiny_pair('softmax_deit_tiny', attn_type='inline', **TINY_DEIT)
    x = torch.randn(2, 3, 32, 32)
    with caplog.at_level('WARNING', logger=multimax_cpu.__name__), torch.no_grad():
        out, ops = recorded_ops(converted, x)
    assert ONEDNN_BMM not in ops and ops.count(torch.ops.aten.baddbmm.default) == len(converted.blocks)
    assert [r.getMessage() for r in caplog.records if r.name == multimax_cpu.__name__] == [KERNEL_BUILD_WARNING]
    with torch.no_grad():
        assert (out - plain(x)).abs().max().item() < 1e-5


@pytest.mark.parametrize('op, args', [
    ('onednn_bmm', lambda: (torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    ('multimax_cpu_attention', lambda: (torch.randn(1, 2, 3, 4),) * 3 + (torch.zeros(4),) * 2),
])
def test_without_the_kernel_its_ops_called_directly_say_so_in_one_sentence(kernel_build_fails, op, args):
    with pytest.raises(RuntimeError, match=rf"^zoo::{op} needs MultiMax's CPU kernel, which could not be built or "
                                           r"loaded \(the warning above says why\)"):
        getattr(torch.ops.zoo, op)(*args())
