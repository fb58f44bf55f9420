"""Linear layers and attention products through oneDNN on the CPU.

PyTorch computes a float32 `nn.Linear` on the CPU with its BLAS library (MKL in the official wheels). On CPUs for
which that library takes a narrower vector path than the machine has (MKL on AMD's AVX-512 CPUs), oneDNN, the
deep-learning library PyTorch also ships, multiplies at up to twice the rate: 240 against 105 GFLOP/s for a
2048² product on one core of the benchmark machine (`docs/benchmarks.md`). `convert_to_onednn` swaps a model's
`nn.Linear` modules for `OneDNNLinear`, which keeps their parameters and state-dict keys and multiplies through
oneDNN in float32 on the CPU, forward and backward, and has softmax and MultiMax attention multiply their scores
through oneDNN where their fused CPU kernel computes them (`attention/multimax_cpu.py`; softmax against long
sequences, where the kernel is faster than `scaled_dot_product_attention`).

The outputs and gradients differ from `F.linear`'s by float32 rounding (the two libraries sum in different orders).
The product is the custom op `zoo::onednn_linear`, which `torch.compile` calls as it stands (inductor's own
lowering of oneDNN's op takes frozen weights only) and `torch.utils.flop_counter` counts. Autocast, other dtypes
and devices, TorchScript and export take `F.linear` as before, and the attentions their other paths.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from .attention.mixer import cpu_float32_kernels_apply
from .attention.softmax import SoftmaxMixer

__all__ = ['OneDNNLinear', 'convert_to_onednn', 'onednn_available', 'onednn_linear']


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN (`torch.backends.mkldnn`) and it is enabled."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


@torch.library.custom_op('zoo::onednn_linear', mutates_args=(), device_types='cpu')
def onednn_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """`F.linear` by oneDNN, differentiable. x: (*, in), weight: (out, in), bias: (out,) -> (*, out),
    contiguous."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, 'none', [], '').contiguous()


@onednn_linear.register_fake
def _onednn_linear_shape(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    return x.new_empty(x.shape[:-1] + weight.shape[:1])


def _save_inputs(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.with_bias = bias is not None


def _onednn_linear_backward(ctx, grad: Tensor):
    """The backward pass's products through oneDNN as well: grad_x = grad·W and grad_W = gradᵀ·x (the transposed
    activations go in as strided views, which oneDNN takes faster than copies); grad_b = the sum of grad's rows."""
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = onednn_linear(grad, weight.t().contiguous())
    if ctx.needs_input_grad[1]:
        grad_weight = onednn_linear(rows.t(), x.reshape(-1, x.shape[-1]).t())
    if ctx.with_bias and ctx.needs_input_grad[2]:
        grad_bias = rows.sum(dim=0)
    return grad_x, grad_weight, grad_bias


onednn_linear.register_autograd(_onednn_linear_backward, setup_context=_save_inputs)


@register_flop_formula(torch.ops.zoo.onednn_linear)
def _onednn_linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """2 per multiply-add, as `torch.utils.flop_counter` counts `F.linear`."""
    return 2 * math.prod(x_shape) * weight_shape[0]


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose float32 CPU products run through oneDNN. x: (*, in_features) -> (*, out_features)."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_scripting():
            if cpu_float32_kernels_apply(x, self.weight):
                return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def convert_to_onednn(module: nn.Module) -> nn.Module:
    """Make every `nn.Linear` in `module` (itself included, subclasses excluded) a `OneDNNLinear`, and have every
    softmax and MultiMax mixer multiply through oneDNN in its fused CPU kernel, in place; return `module`.

    Only the linear modules' class changes, as `torch.nn.utils.parametrize` changes it, and the mixers' `onednn`
    flag: parameters, buffers, hooks and state-dict keys stay, so optimizers and checkpoints see the same model.
    """
    if not onednn_available():
        raise RuntimeError("oneDNN is not available in this PyTorch build, or torch.backends.mkldnn.enabled is False; "
                           "expected torch.backends.mkldnn.is_available() to be True")
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = OneDNNLinear
        elif isinstance(child, SoftmaxMixer):
            child.onednn = True
    return module
