"""MultiMax's fused CPU kernel (`csrc/multimax_cpu.cpp`), built on first use as a torch C++ extension.

Hand-written because no maintained library fuses an element-wise function of the scores into CPU attention
forward and backward: inductor's CPU FlexAttention, which takes σ as its `score_mod`, has no backward pass and
runs compiled inference only; the unfused path writes and rereads every score several times. With the kernel,
MultiMax-DeiT-T takes 1.04–1.07× softmax's time for inference and 0.99–1.06× for a training step from 224² (batch
8) to 1024², eager, both through oneDNN, where the unfused path took 1.27× at 224² (`docs/benchmarks.md`). It is
registered as the custom ops `zoo::multimax_cpu_attention` and `zoo::multimax_cpu_attention_backward`, so
`torch.compile(fullgraph=True)` calls them as they stand.

The build needs a C++ compiler and ninja (torch's `cpp_extension`), and is cached in torch's extension folder, keyed
by the source, the flags, the machine's instruction set (it is compiled for the CPU it runs on) and the torch
install, one process building at a time. Its matrix products call the BLAS inside torch by its Fortran names
(`sgemm_`, `dgemm_`, exported by torch's x86-64 Linux wheels, which link MKL). With `onednn=True`, its large float32
products go through oneDNN instead (ATen's own oneDNN matrix product), as `models.convert_to_onednn` asks for, which
gives softmax attention the kernel too (σ with zero scalars is the identity). Where it cannot be built or loaded,
MultiMax keeps its other paths, and says why once.

The extension also gives the linear attentions oneDNN's batched product (`onednn_bmm`, through
`attention_matmul`): torch's `bmm` takes the BLAS, which on the CPUs above multiplies their (n × d)·(d × e) state
products at 0.41–0.49× oneDNN's rate.

σ's formula (`multimax_modulation`) lives here, beside the kernel that fuses it, so that `KernelAttention`, the
kernel's autograd function through which MultiMax and softmax attention both train, can differentiate the formula
where a second derivative is asked for; softmax attention's module cannot import MultiMax's, which subclasses it.
"""
import contextlib
import hashlib
import logging
import math
import os
import platform
import re
import shutil
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .mixer import cpu_float32_kernels_apply, differentiable_grads

__all__ = ['multimax_modulation', 'modulation_by_parts', 'multimax_cpu', 'multimax_cpu_backward', 'KernelAttention',
           'cpu_kernel_available',
           'onednn_products_available', 'onednn_products_apply', 'onednn_bmm', 'onednn_matmul',
           'attention_matmul']

_logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), 'csrc', 'multimax_cpu.cpp')
# -ffast-math lets the compiler call the vector exponential (libmvec); the kernel keeps no inf or NaN of its own
_CFLAGS = ['-O3', '-march=native', '-ffast-math', '-fopenmp']
_NOT_LOADED = object()
# whether oneDNN's matrix product runs here, found on first use
_onednn_products: Optional[bool] = None
_extension: Any = _NOT_LOADED


def _build_tag() -> str:
    """A short digest of the CPU's feature flags, the torch install and the source's place: `-march=native` code
    built on one machine must not be loaded from a shared cache on another, and torch names its cache folder by
    Python's and CUDA's versions alone, so two torch installs or two checkouts would rebuild it over each other."""
    build = platform.machine() + torch.__version__ + os.path.dirname(torch.__file__) + _SOURCE
    try:
        with open('/proc/cpuinfo') as info:
            build += next((line for line in info if line.startswith(('flags', 'Features'))), '')
    except OSError:
        build += platform.processor()
    return hashlib.sha1(build.encode()).hexdigest()[:8]


@contextlib.contextmanager
def _pip_ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH. pip installs it, a declared dependency, beside the environment's Python,
    which is not on PATH where the environment is used without being activated (its Python called by path, a
    notebook kernel, a service): that folder goes on PATH while the kernel builds."""
    path = os.environ.get('PATH')
    if shutil.which('ninja') is None:
        with contextlib.suppress(ImportError):
            import ninja
            if ninja.BIN_DIR:
                os.environ['PATH'] = os.pathsep.join([ninja.BIN_DIR, path or os.defpath])
    try:
        yield
    finally:
        if path is None:
            os.environ.pop('PATH', None)
        else:
            os.environ['PATH'] = path


def _build(name: str) -> Any:
    """torch's `cpp_extension.load` of the kernel, one process at a time. torch before 2.14 marks a build in
    progress by the mere existence of a file `lock` in the build folder, which a process killed while building
    leaves behind: every later build would wait for it forever, silently. The kernel's own lock is an OS lock,
    released when its holder dies, and whoever holds it removes such a leftover before building."""
    import fcntl
    from torch.utils.cpp_extension import get_default_build_root, load
    directory = os.path.join(os.environ.get('TORCH_EXTENSIONS_DIR') or get_default_build_root(), name)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, 'zoo.lock'), 'a') as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, 'lock'))
        with _pip_ninja_on_path():
            return load(name, [_SOURCE], extra_cflags=_CFLAGS, extra_ldflags=['-fopenmp'],
                        build_directory=directory)


_BUILD_FAILURE = re.compile(r'error|: not found|permission denied', re.IGNORECASE)


def _failure_reason(error: Exception) -> str:
    """What stopped the build or load, in one line. torch reports a failed build as its first line, the ninja
    command, then the compiler's output, where the cause stands: the first line that reports an error after the
    first (a full disk: "Fatal error: can't write ... No space left on device"; a compile error) or that the shell
    could not run the compiler ("/bin/sh: 1: c++: not found")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    causes = [line for line in lines[1:] if _BUILD_FAILURE.search(line) and not line.startswith('ninja:')]
    return causes[0] if causes else lines[0]


def _load() -> Optional[Any]:
    global _extension
    if _extension is _NOT_LOADED:
        try:
            _extension = _build(f'zoo_multimax_cpu_{_build_tag()}')
        except (OSError, RuntimeError, ImportError, ValueError) as e:  # no compiler or ninja, a failed build or load
            reason = _failure_reason(e)
            _logger.warning(f"MultiMax's CPU kernel could not be built or loaded ({reason}); MultiMax runs unfused "
                            "on CPU, softmax attention keeps scaled_dot_product_attention, and the linear attentions "
                            "torch's matmul")
            _extension = None
    return _extension


def _built(op: str) -> Any:
    """The kernel's extension for the custom op `op`: one sentence, not an AttributeError, where it could not be
    built or loaded."""
    extension = _load()
    if extension is None:
        raise RuntimeError(f"zoo::{op} needs MultiMax's CPU kernel, which could not be built or loaded (the warning "
                           "above says why); the zoo checks cpu_kernel_available() before calling it")
    return extension


def multimax_modulation(x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
    """Element-wise σ(x) with `ranges` = (b₀, b₁, b₂, b₃) and `ts` = (t₀, t₁, t₂, t₃); zeros give σ(x) = x."""
    return modulation_by_parts(x, ranges[0], ranges[1], ranges[2], ranges[3], ts[0], ts[1], ts[2], ts[3])


def modulation_by_parts(x: Tensor, b0: Tensor, b1: Tensor, b2: Tensor, b3: Tensor,
                        t0: Tensor, t1: Tensor, t2: Tensor, t3: Tensor) -> Tensor:
    """`multimax_modulation` with its eight parameters apart, for callers that hold them as separate tensors."""
    return (x + t0 * torch.relu(b0 - x) + t1 * torch.relu(x - b1)
            + t2 * torch.relu(b2 - x).square() + t3 * torch.relu(x - b3).square())


@torch.compiler.assume_constant_result
def cpu_kernel_available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return _load() is not None


@torch.compiler.assume_constant_result
def onednn_products_available() -> bool:
    """Whether the kernel is built, this torch has the oneDNN matrix product its `onednn` option calls, and the
    product runs on this CPU: torch's `mkldnn_matmul` refuses, in float32 too, CPUs without AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, where the kernels keep the BLAS."""
    global _onednn_products
    if not (cpu_kernel_available() and _load().onednn_products_available()):
        return False
    if _onednn_products is None:
        _onednn_products = _onednn_product_runs()
    return _onednn_products


def _onednn_product_runs() -> bool:
    try:
        _load().onednn_bmm(torch.ones(1, 1, 1), torch.ones(1, 1, 1))
    except RuntimeError as e:
        _logger.info(f"oneDNN's matrix product does not run on this CPU ({str(e).splitlines()[0]}); the kernels "
                     f"multiply through the BLAS")
        return False
    return True


# Inductor's on-disk cache keys a compiled graph by the ops it calls, not by their fake implementations: a change
# of an op's arguments that earlier calls would not fit, or of its output layout, takes a new name, or graphs
# compiled before it would call it wrongly (an argument added last with a default fits them). A compiled training
# graph also keeps, as it was traced, the backward formula registered for an op (`onednn_bmm`'s below,
# `models/onednn.py`'s `zoo::onednn_linear`): a change of that formula's values takes a new name as well.
@torch.library.custom_op('zoo::multimax_cpu_attention', mutates_args=(), device_types='cpu')
def multimax_cpu(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor] = None,
                 mask: Optional[Tensor] = None, onednn: bool = False) -> Tuple[Tensor, Tensor]:
    """softmax(σ(q·kᵀ/√d + bias) + mask) v without storing the scores. q: (B, h, n, d), k: (B, h, m, d),
    v: (B, h, m, dv), float32 or float64, `ranges`, `ts`: (4,), `bias` broadcasting to (B, h, n, m), `mask`
    (nW, n, m) with batch entry b taking mask[b % nW] -> output (B, h, n, dv) and each row's log-sum-exp
    (B, h, n, 1). `onednn`: large float32 products through oneDNN (`onednn_products_available`). Not
    differentiable itself: `multimax_cpu_backward` gives the gradients without bias or mask."""
    out, lse = _built('multimax_cpu_attention').multimax_forward(q, k, v, ranges, ts, bias, mask, onednn)
    return out, lse


@multimax_cpu.register_fake
def _multimax_cpu_shapes(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor] = None,
                         mask: Optional[Tensor] = None, onednn: bool = False) -> Tuple[Tensor, Tensor]:
    # the kernel writes the output (B, n, h, dv), so that merging its heads is a view
    B, h, n, _ = q.shape
    return q.new_empty((B, n, h, v.shape[-1])).transpose(1, 2), q.new_empty(q.shape[:-1] + (1,))


@torch.library.custom_op('zoo::multimax_cpu_attention_backward', mutates_args=(), device_types='cpu')
def multimax_cpu_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          ranges: Tensor, ts: Tensor, onednn: bool = False, scalar_grads: bool = True
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `multimax_cpu`'s output for q, k, v, `ranges` and `ts` from its output and log-sum-exp,
    recomputing the scores a block at a time; `onednn` as the forward pass took it. Without `scalar_grads`, those
    of `ranges` and `ts` are zeros, and with all of `ts` zero (softmax attention) the pass skips σ: 1.20–1.28×
    faster on one thread at 197 to 4097 tokens."""
    extension = _built('multimax_cpu_attention_backward')
    grad_q, grad_k, grad_v, grad_ranges, grad_ts = extension.multimax_backward(grad_out, q, k, v, out, lse, ranges, ts,
                                                                               onednn, scalar_grads)
    return grad_q, grad_k, grad_v, grad_ranges.to(ranges.dtype), grad_ts.to(ts.dtype)


@multimax_cpu_backward.register_fake
def _multimax_cpu_backward_shapes(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  ranges: Tensor, ts: Tensor, onednn: bool = False, scalar_grads: bool = True
                                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.new_empty(t.shape) for t in (q, k, v, ranges, ts))  # contiguous, as the kernel returns them


@register_flop_formula(torch.ops.zoo.multimax_cpu_attention)
def _forward_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """The two matrix products, 2·B·h·n·m·(d + dv), as `torch.utils.flop_counter` counts attention (σ and the
    softmax are element-wise and not counted)."""
    *batch, n, d = q_shape
    return 2 * math.prod(batch) * n * k_shape[-2] * (d + v_shape[-1])


@register_flop_formula(torch.ops.zoo.multimax_cpu_attention_backward)
def _backward_flops(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Twice the forward pass's products, as for attention's backward pass (the recomputed scores not counted)."""
    return 2 * _forward_flops(q_shape, k_shape, v_shape)


class KernelAttention(torch.autograd.Function):
    """softmax(σ(q·kᵀ/√d)) v by the kernel, forward and backward (from the output and each row's log-sum-exp);
    softmax attention with `ranges` and `ts` zero. q: (B, h, n, d), k, v: (B, h, m, d) -> (B, h, n, d), float32 or
    float64; `onednn` as `multimax_cpu` takes it. A backward pass that builds a graph (create_graph=True)
    differentiates the formula instead, which, unlike the kernel, is differentiable twice."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, onednn: bool) -> Tensor:
        out, lse = multimax_cpu(q, k, v, ranges, ts, None, None, onednn)
        ctx.save_for_backward(q, k, v, ranges, ts, out, lse)
        ctx.onednn = onednn
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, ranges, ts, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
            formula = torch.matmul(multimax_modulation(scores, ranges, ts).softmax(dim=-1), v)
            return differentiable_grads(ctx, formula, (q, k, v, ranges, ts), grad_out) + (None,)
        grads = multimax_cpu_backward(grad_out.contiguous(), q, k, v, out, lse, ranges, ts, ctx.onednn,
                                      any(ctx.needs_input_grad[3:5]))
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:5])) + (None,)


@torch.library.custom_op('zoo::onednn_bmm', mutates_args=(), device_types='cpu')
def onednn_bmm(a: Tensor, b: Tensor) -> Tensor:
    """`torch.bmm(a, b)` by oneDNN, differentiable: a (B, m, k), b (B, k, n), float32 -> (B, m, n), contiguous.
    Needs `onednn_products_available()`."""
    return _built('onednn_bmm').onednn_bmm(a, b)


@onednn_bmm.register_fake
def _onednn_bmm_shape(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


def _save_operands(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _onednn_bmm_backward(ctx, grad: Tensor):
    """Both gradients' products through oneDNN as well, the transposed operands as strided views (which oneDNN
    reads in place)."""
    a, b = ctx.saved_tensors
    grad_a = onednn_bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
    grad_b = onednn_bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


onednn_bmm.register_autograd(_onednn_bmm_backward, setup_context=_save_operands)


@register_flop_formula(torch.ops.zoo.onednn_bmm)
def _onednn_bmm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 per multiply-add, as `torch.utils.flop_counter` counts `bmm`."""
    batch, m, k = a_shape
    return 2 * batch * m * k * b_shape[-1]


def onednn_products_apply(*tensors: Tensor) -> bool:
    """Whether oneDNN's matrix product (the kernel's `onednn` option, `onednn_bmm`) may compute on `tensors`: the
    zoo's float32 CPU kernels apply to them (`cpu_float32_kernels_apply`) and this torch has the product."""
    return cpu_float32_kernels_apply(*tensors) and onednn_products_available()


def onednn_matmul(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b` by oneDNN's batched product (`onednn_bmm`) for operands of the same batch shape, (*, m, k) and
    (*, k, n) -> (*, m, n), where `onednn_products_apply(a, b)`: the caller checks."""
    batch = a.shape[:-2]
    out = onednn_bmm(a.reshape(-1, a.shape[-2], a.shape[-1]), b.reshape(-1, b.shape[-2], b.shape[-1]))
    return out.view(batch + out.shape[-2:])


def attention_matmul(a: Tensor, b: Tensor, onednn: bool) -> Tensor:
    """`a @ b` for operands of the same batch shape, (*, m, k) and (*, k, n) -> (*, m, n), through oneDNN's batched
    product (`onednn_matmul`) where `onednn` (`models.convert_to_onednn`) and `onednn_products_apply`, as the linear
    attentions multiply their queries, keys, values and states."""
    if not torch.jit.is_scripting():
        if onednn and onednn_products_apply(a, b):
            return onednn_matmul(a, b)
    return a @ b
