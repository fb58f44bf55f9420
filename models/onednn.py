"""Linear layers and attention products through oneDNN on the CPU.

PyTorch computes a float32 `nn.Linear` on the CPU with its BLAS library (MKL in the official wheels). On CPUs for
which that library takes a narrower vector path than the machine has (MKL on AMD's AVX-512 CPUs), oneDNN, the
deep-learning library PyTorch also ships, multiplies at up to twice the rate: 240 against 105 GFLOP/s for a
2048² product on one core of the benchmark machine (`docs/benchmarks.md`). `convert_to_onednn` swaps a model's
`nn.Linear` modules for `OneDNNLinear`, which keeps their parameters and state-dict keys and multiplies through
oneDNN in float32 on the CPU, forward and backward, and has softmax and MultiMax attention multiply their scores
through oneDNN where their fused CPU kernel computes them (`attention/multimax_cpu.py`; softmax against long
sequences, where the kernel is faster than `scaled_dot_product_attention`), and the linear attentions (InLine,
FLatten, SimA, linear) their keys, values and states by oneDNN's batched product (`zoo::onednn_bmm`). In
inference, timm's `Mlp` applies its GELU inside the first layer's oneDNN product (`OneDNNMlp`), and PVT v2's MLP
inside its depthwise convolution (`onednn_conv2d_gelu`), to each block of the output while it is in cache.
Modules with an `onednn` flag of their own (every attention mixer, PVT v2's MLP) have it set.

The outputs and gradients differ from `F.linear`'s by float32 rounding (the two libraries sum in different orders).
The product is the custom op `zoo::onednn_linear`, which `torch.compile` calls as it stands (inductor's own
lowering of oneDNN's op takes frozen weights only) and `torch.utils.flop_counter` counts. Autocast, other dtypes
and devices, TorchScript and export take `F.linear` as before, and the attentions their other paths.
"""
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

from timm.layers import Mlp

from .attention.mixer import cpu_float32_kernels_apply, needs_grad

__all__ = ['OneDNNLinear', 'OneDNNMlp', 'convert_to_onednn', 'fuses_in_inference', 'onednn_available',
           'onednn_conv2d_gelu', 'onednn_linear', 'onednn_linear_gelu']


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN (`torch.backends.mkldnn`) and it is enabled."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


# The on-disk cache of compiled graphs keeps the backward formula registered below as it was traced (the weight
# gradient's operand order reached compiled runs only with a cold cache): a change of the gradients' values takes
# a new name for the op, as `attention/multimax_cpu.py` says of its ops.
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


def _weight_gradient(grad_rows: Tensor, x_rows: Tensor) -> Tensor:
    """grad_W = gradᵀ·x for grad_rows (N, out) and x_rows (N, in) through oneDNN, both transposed as views.

    oneDNN copies its first operand into rows and reads its second (a layer's weight in the forward pass) as laid
    out, and a strided second operand costs it hundreds of times a dense one: the class token of every image that
    a head pools from the tokens took 32 ms against 0.05 ms (DeiT-T's training step 1.10× faster, PVT-T's 1.16×,
    one thread), so the second operand is made dense. The narrower of the two goes first, the copy being smaller:
    xᵀ·grad, then transposed, where in < out (the product 1.13–1.50× faster at DeiT-T's and PVT-T's widening
    layers, the training step 1.01–1.03×), gradᵀ·x otherwise. An empty batch (no rows) gives zeros, which oneDNN
    cannot form from a product over no rows."""
    if x_rows.shape[0] == 0:
        return x_rows.new_zeros(grad_rows.shape[1], x_rows.shape[1])
    if x_rows.shape[1] < grad_rows.shape[1]:
        return onednn_linear(x_rows.t(), grad_rows.contiguous().t()).t().contiguous()
    return onednn_linear(grad_rows.t(), x_rows.contiguous().t())


def _onednn_linear_backward(ctx, grad: Tensor):
    """The backward pass's products through oneDNN as well: grad_x = grad·W and grad_W = gradᵀ·x
    (`_weight_gradient`); grad_b = the sum of grad's rows."""
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = onednn_linear(grad, weight.t().contiguous())
    if ctx.needs_input_grad[1]:
        grad_weight = _weight_gradient(rows, x.reshape(-1, x.shape[-1]))
    if ctx.with_bias and ctx.needs_input_grad[2]:
        grad_bias = rows.sum(dim=0)
    return grad_x, grad_weight, grad_bias


onednn_linear.register_autograd(_onednn_linear_backward, setup_context=_save_inputs)


@torch.library.custom_op('zoo::onednn_linear_gelu', mutates_args=(), device_types='cpu')
def onednn_linear_gelu(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, approximate: str = 'none'
                       ) -> Tensor:
    """`F.gelu(F.linear(x, weight, bias), approximate=approximate)` in one oneDNN product, which applies GELU to each
    block of its output while the block is in cache. Not differentiable: GELU's backward pass needs the product
    before it, which this op never stores. x: (*, in), weight: (out, in), bias: (out,) -> (*, out), contiguous."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, 'gelu', [], approximate).contiguous()


@onednn_linear_gelu.register_fake
def _onednn_linear_gelu_shape(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                              approximate: str = 'none') -> Tensor:
    return x.new_empty(x.shape[:-1] + weight.shape[:1])


@register_flop_formula([torch.ops.zoo.onednn_linear, torch.ops.zoo.onednn_linear_gelu])
def _onednn_linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """2 per multiply-add, as `torch.utils.flop_counter` counts `F.linear`."""
    return 2 * math.prod(x_shape) * weight_shape[0]


@torch.library.custom_op('zoo::onednn_conv2d_gelu', mutates_args=(), device_types='cpu')
def onednn_conv2d_gelu(x: Tensor, weight: Tensor, bias: Optional[Tensor], padding: List[int], groups: int,
                       approximate: str = 'none') -> Tensor:
    """`F.gelu(F.conv2d(x, weight, bias, padding=padding, groups=groups), approximate=approximate)` (stride and
    dilation 1) in one oneDNN convolution, which applies GELU to each block of its output while the block is in
    cache. Not differentiable. x: (B, C, H, W) -> (B, C_out, H', W'), channels-last."""
    out = torch.ops.mkldnn._convolution_pointwise(x, weight, bias, padding, [1, 1], [1, 1], groups, 'gelu', [],
                                                  approximate)
    return out.contiguous(memory_format=torch.channels_last)


@onednn_conv2d_gelu.register_fake
def _onednn_conv2d_gelu_shape(x: Tensor, weight: Tensor, bias: Optional[Tensor], padding: List[int], groups: int,
                              approximate: str = 'none') -> Tensor:
    B, _, H, W = x.shape
    shape = (B, weight.shape[0], H + 2 * padding[0] - weight.shape[2] + 1, W + 2 * padding[1] - weight.shape[3] + 1)
    return x.new_empty(shape).contiguous(memory_format=torch.channels_last)


@register_flop_formula(torch.ops.zoo.onednn_conv2d_gelu)
def _onednn_conv2d_gelu_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """As `torch.utils.flop_counter` counts the convolution (GELU is not counted)."""
    return conv_flop_count(x_shape, weight_shape, out_shape)


def fuses_in_inference(*tensors: Optional[Tensor]) -> bool:
    """Whether an activation may run inside the oneDNN product or convolution before it, on `tensors` (its input
    and parameters): no gradient required of them (the activation's backward pass needs what the fused op never
    stores), and float32 on the CPU where the zoo's kernels apply (`cpu_float32_kernels_apply`)."""
    return not needs_grad(*tensors) and cpu_float32_kernels_apply(*(t for t in tensors if t is not None))


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose float32 CPU products run through oneDNN. x: (*, in_features) -> (*, out_features)."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_scripting():
            if cpu_float32_kernels_apply(x, self.weight):
                return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class OneDNNMlp(Mlp):
    """timm's `Mlp` (linear layers, GELU) whose first layer and GELU run as one oneDNN product in float32 CPU
    inference (`onednn_linear_gelu`): the activation no longer makes a pass of its own over the hidden features,
    which at PVT-T's first stage (25 088 × 512 at batch 8) took 1.78× the time of the fused product, and at DeiT-T's
    1.02–1.08×. Where gradients are required, and wherever `OneDNNLinear` takes `F.linear`, the two stay apart.
    x: (*, in_features) -> (*, out_features)."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_scripting():
            if fuses_in_inference(x, self.fc1.weight, self.fc1.bias):
                return self._after_activation(onednn_linear_gelu(x, self.fc1.weight, self.fc1.bias,
                                                                 self.act.approximate))
        return self._after_activation(self.act(self.fc1(x)))

    def _after_activation(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


def _fusable_mlp(module: nn.Module) -> bool:
    """timm's own `Mlp` of linear layers whose activation is `nn.GELU` itself."""
    return (type(module) is Mlp and isinstance(module.fc1, nn.Linear) and isinstance(module.fc2, nn.Linear)
            and type(module.act) is nn.GELU)


def convert_to_onednn(module: nn.Module) -> nn.Module:
    """Make every `nn.Linear` in `module` (itself included, subclasses excluded) a `OneDNNLinear` and every timm
    `Mlp` with GELU a `OneDNNMlp`, and set the `onednn` flag of every module that has one (softmax and MultiMax
    mixers multiply through oneDNN in their fused CPU kernel, the linear attentions by its batched product, PVT
    v2's MLP fuses its GELU), in place; return `module`.

    Only the modules' class changes, as `torch.nn.utils.parametrize` changes it, and the `onednn` flags:
    parameters, buffers, hooks and state-dict keys stay, so optimizers and checkpoints see the same model.
    """
    if not onednn_available():
        raise RuntimeError("oneDNN is not available in this PyTorch build, or torch.backends.mkldnn.enabled is False; "
                           "expected torch.backends.mkldnn.is_available() to be True")
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = OneDNNLinear
        elif _fusable_mlp(child):
            child.__class__ = OneDNNMlp
        elif isinstance(getattr(child, 'onednn', None), bool):
            child.onednn = True
    return module
