"""MultiMax: softmax of piece-wise modulated scores, softmax(σ(q·kᵀ/√d + bias) + mask) v.

σ(x) = x + t₀·max(b₀ − x, 0) + t₁·max(x − b₁, 0) + t₂·max(b₂ − x, 0)² + t₃·max(x − b₃, 0)², with b = `ranges`
and t = `ts`, four learned scalars each shared by all heads of the module. σ runs before the mask is added
(σ(−inf) would be NaN) and, like the softmax, in float32 whatever the autocast dtype, since its squares
overflow float16.

Four paths compute the same function. On CUDA, σ is FlexAttention's `score_mod` (it is element-wise on the
scores), so the fused kernel never stores the score matrix. On the CPU, without causal masking or dropout,
MultiMax's own fused kernel (`multimax_cpu.py`) runs eager and compiled: inference with a bias and a mask too,
training (forward and backward) without them. With causal masking, or a window mask where the kernel is not built,
CPU inference inside `torch.compile` (float32, float16 or bfloat16) takes FlexAttention too, for which inductor
generates a fused CPU kernel (it has no CPU backward pass). Elsewhere, small score matrices, and any with
attention dropout, take the plain path, whose σ keeps only its input for the backward pass instead of four
score-sized intermediates. Larger ones run a block of query rows at a time: in inference beyond a few MiB of
scores, in training beyond 64 MiB, where the forward pass keeps one log-sum-exp per row and the backward pass
recomputes each block's scores, so memory grows with the score matrix only through one block.

Training on CUDA is FlexAttention's forward and backward passes, fused. Its backward pass differentiates a tensor
the `score_mod` captures only where it is read once per score, so σ's eight scalars travel as eight tensors with one
copy per query row: each is read once, and the gradient's atomic adds spread over rows instead of meeting at eight
addresses. Forced FlexAttention on the CPU (`use_flex=True`), which has no backward pass there, trains with its
forward pass's log-sum-exp and the backward pass in row blocks.

Causal form (`causal=True`): on every path, key j > i gets −inf in query i's logits after σ, like the mask.
"""
import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import trunc_normal_

from .causal import later_tokens
from .layout import Grid, merge_heads
from .mixer import MixContext, autocast_off, differentiable_grads, is_exporting, needs_grad
from .multimax_cpu import (KernelAttention, cpu_kernel_available, modulation_by_parts, multimax_cpu,
                           multimax_modulation)
from .registry import register_attention
from .softmax import SoftmaxMixer

try:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention
except ImportError:  # older torch: the plain path everywhere
    AuxRequest = flex_attention = None

# What inductor's CPU FlexAttention kernel takes (every torch with `AuxRequest` has it): inference only, without
# the log-sum-exp, in these dtypes.
_CPU_FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ['multimax_modulation', 'multimax_attention', 'regions_apart', 'MultiMaxMixer']


def _modulated(x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
    """`multimax_modulation` into a fresh tensor, one score-sized temporary at a time instead of four. Compiled,
    the formula as it stands: the compiler plans the buffers itself, and torch 2.11's tracer (not 2.14's) gives
    wrong gradients for an autograd function whose forward pass works in place on a tensor of its own."""
    if torch.compiler.is_compiling():
        return multimax_modulation(x, ranges, ts)
    out = (ranges[0] - x).clamp_(min=0).mul_(ts[0]).add_(x)
    out.add_((x - ranges[1]).clamp_(min=0).mul_(ts[1]))
    out.add_((ranges[2] - x).clamp_(min=0).square_().mul_(ts[2]))
    return out.add_((x - ranges[3]).clamp_(min=0).square_().mul_(ts[3]))


def _modulation_backward(x: Tensor, grad: Tensor, ranges: Tensor, ts: Tensor, needs_params: bool
                         ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of Σ grad·σ(x) with respect to x, and to `ranges` and `ts` where `needs_params`."""
    below0 = (ranges[0] - x).clamp_(min=0)
    above1 = (x - ranges[1]).clamp_(min=0)
    below2 = (ranges[2] - x).clamp_(min=0)
    above3 = (x - ranges[3]).clamp_(min=0)
    # relu's derivative is 0 at 0, as autograd takes it
    inside0, inside1 = below0.sign(), above1.sign()
    grad_ranges = grad_ts = None
    if needs_params:
        flat = grad.reshape(-1)

        def total(part: Tensor) -> Tensor:
            return torch.dot(flat, part.reshape(-1))

        grad_ranges = torch.stack([ts[0] * total(inside0), -ts[1] * total(inside1),
                                   2 * ts[2] * total(below2), -2 * ts[3] * total(above3)])
        grad_ts = torch.stack([total(below0), total(above1), total(below2.square()), total(above3.square())])
    # dσ/dx = 1 − t₀·[x < b₀] + t₁·[x > b₁] − 2t₂·max(b₂ − x, 0) + 2t₃·max(x − b₃, 0)
    slope = above3.mul_(2 * ts[3]).addcmul_(below2, -2 * ts[2]).addcmul_(inside0, -ts[0])
    return slope.addcmul_(inside1, ts[1]).add_(1).mul_(grad), grad_ranges, grad_ts


class _Modulation(torch.autograd.Function):
    """`multimax_modulation` with a backward pass that needs only x (autograd of the formula keeps four
    score-sized intermediates)."""

    @staticmethod
    def forward(ctx, x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
        ctx.save_for_backward(x, ranges, ts)
        return _modulated(x, ranges, ts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, ranges, ts = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the formula's own backward is differentiable
            return differentiable_grads(ctx, multimax_modulation(x, ranges, ts), (x, ranges, ts), grad)
        grad_x, grad_ranges, grad_ts = _modulation_backward(x, grad, ranges, ts, any(ctx.needs_input_grad[1:]))
        return grad_x, grad_ranges, grad_ts


class _MultiMaxInRowBlocks(torch.autograd.Function):
    """The plain path a block of query rows at a time, forward and backward, for score matrices too large to
    keep (σ and the softmax are row-wise, so this is exact).

    Forward keeps the output and each row's log-sum-exp, computed in row blocks or by FlexAttention; backward
    recomputes a block's scores and probabilities from them, the way fused softmax kernels do, so training holds
    one block of scores instead of several n×m tensors per head.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                mask: Optional[Tensor], causal: bool, rows: int, use_flex: bool) -> Tensor:
        """The forward pass in blocks of `rows` query rows, or, with `use_flex`, by FlexAttention."""
        if use_flex:  # detached: this function, not FlexAttention, differentiates them
            detached = (None if t is None else t.detach() for t in (q, k, v, ranges, ts, bias))
            out, lse = _multimax_flex(*detached, mask, causal, keep_lse=True)
        else:
            out, lse = _row_blocks_forward(q, k, v, ranges, ts, bias, mask, causal, rows, keep_lse=True)
        ctx.save_for_backward(q, k, v, ranges, ts, bias, mask, out, lse)
        ctx.rows = rows
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, ranges, ts, bias, mask, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            plain = _multimax_plain(q, k, v, ranges, ts, bias, mask, 0., ctx.causal)
            return differentiable_grads(ctx, plain, (q, k, v, ranges, ts, bias), grad_out) + (None,) * 4
        need_q, need_k, need_v, need_ranges, need_ts, need_bias = ctx.needs_input_grad[:6]
        work = torch.promote_types(q.dtype, torch.float32)
        scale = q.shape[-1] ** -0.5
        with autocast_off(q.device):
            q_scaled, keys, values = q.to(work) * scale, k.to(work), v.to(work)
            b, t = ranges.to(work), ts.to(work)
            grad_out = grad_out.to(work)
            # dL/dlogits = p ∘ (dL/dp − Σ_j p_j·dL/dp_j), and Σ_j p_j·dL/dp_j is row i of grad_out · out
            row_dots = (grad_out * out.to(work)).sum(dim=-1, keepdim=True)
            grad_q = torch.empty_like(q_scaled) if need_q else None
            grad_k = torch.zeros_like(keys) if need_k else None
            grad_v = torch.zeros_like(values) if need_v else None
            grad_bias = torch.zeros(bias.shape, dtype=work, device=bias.device) if need_bias else None
            grad_b = grad_t = None
            for block in _row_slices(q.shape[-2], ctx.rows):
                scores, logits = _block_logits(q_scaled, keys, b, t, bias, mask, ctx.causal, block)
                probs = logits.sub_(lse[..., block, :]).exp_()
                grad_block = grad_out[..., block, :]
                if need_v:
                    grad_v.add_(probs.transpose(-2, -1) @ grad_block)
                grad_logits = probs.mul_((grad_block @ values.transpose(-2, -1)).sub_(row_dots[..., block, :]))
                grad_scores, block_b, block_t = _modulation_backward(scores, grad_logits, b, t,
                                                                     need_ranges or need_ts)
                if block_b is not None:
                    grad_b = block_b if grad_b is None else grad_b.add_(block_b)
                    grad_t = block_t if grad_t is None else grad_t.add_(block_t)
                if need_bias:
                    grad_bias_block = grad_bias[..., _bias_rows(bias, block), :]
                    grad_bias_block.add_(grad_scores.sum_to_size(grad_bias_block.shape))
                if need_k:
                    grad_k.add_(grad_scores.transpose(-2, -1) @ q_scaled[..., block, :])
                if need_q:
                    grad_q[..., block, :] = (grad_scores @ keys).mul_(scale)
        return (_cast(grad_q, q), _cast(grad_k, k), _cast(grad_v, v), _cast(grad_b if need_ranges else None, ranges),
                _cast(grad_t if need_ts else None, ts), _cast(grad_bias, bias), None, None, None, None)


def _cast(grad: Optional[Tensor], like: Optional[Tensor]) -> Optional[Tensor]:
    return None if grad is None else grad.to(like.dtype)


_compiled_flex: Optional[Callable[..., Tensor]] = None
# Compiled without dynamic shapes, FlexAttention is compiled anew for each shape, dtype and gradient requirement of
# its inputs, and torch's default limit of 8 graphs per function is less than one model needs (Swin: four stages,
# windows shifted and not, a validation batch and a smaller last one): past it, torch runs FlexAttention unfused,
# forming every score matrix. torch.compile takes no limit of its own for one function, and setting the global one
# around each call would cost more than a small attention's kernels, so the first use raises the global limit.
_FLEX_GRAPHS = 256


def _fused_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled once, with room for `_FLEX_GRAPHS` graphs; without compilation it would form the score
    matrix."""
    global _compiled_flex
    if _compiled_flex is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _FLEX_GRAPHS)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def multimax_attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ranges: Tensor,
        ts: Tensor,
        bias: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        dropout_p: float = 0.,
        use_flex: Optional[bool] = None,
        causal: bool = False,
        use_kernel: Optional[bool] = None,
        onednn: bool = False,
) -> Tensor:
    """q: (B, h, n, d), k, v: (B, h, m, d) -> (B, h, n, d).

    `bias` (added before σ) broadcasts to the (B, h, n, m) scores; `mask` (nW, n, m) is added after σ, batch
    entry b taking mask[b % nW] (windows of an image are consecutive); `causal` masks key j > i out of query
    i's logits after σ. `use_flex`: None takes FlexAttention without dropout on CUDA (for heads of 16 channels or
    more), and, where the kernel is not taken, in CPU inference inside `torch.compile` (not export) in float32,
    float16 or bfloat16 without bias; the plain path otherwise.
    True forces FlexAttention (compiled on CUDA, its unfused reference elsewhere): for both passes on CUDA, for the
    forward pass elsewhere, with the backward pass in row blocks. `use_kernel`: None takes the fused CPU kernel
    (`multimax_cpu.py`) on the CPU without causal masking or dropout, in inference and in training without bias or
    mask, eager or compiled (not export), where it builds; True forces it there. `onednn`: the kernel's large
    float32 products through oneDNN (`models.convert_to_onednn`), where this torch has them.
    """
    if torch.jit.is_scripting():  # the plain path without the custom autograd functions
        return _multimax_plain(q, k, v, ranges, ts, bias, mask, dropout_p, causal)
    if ranges.shape != (4,) or ts.shape != (4,):
        raise ValueError(f"MultiMax takes four ranges (b0..b3) and four ts (t0..t3), got shapes "
                         f"{tuple(ranges.shape)} and {tuple(ts.shape)}")
    if _under_func_transforms(q, k, v, ranges, ts, bias):
        return _multimax_plain(q, k, v, ranges, ts, bias, mask, dropout_p, causal)
    B, h, n, _ = q.shape
    if bias is not None and bias.dim() < 2:  # a bias per key, or one number: the paths below index its rows
        bias = bias.reshape(1, -1)
    # torch.export keeps the batch symbolic: the path and the block size then follow one image's scores, which
    # are static, so that one graph serves every batch size
    images = 1 if is_exporting() else B
    row_bytes = max(1, images * h * k.shape[-2] * 4)  # an empty batch takes the plain path
    training = needs_grad(q, k, v, ranges, ts, bias)
    kernel_scores = not causal and not dropout_p and not (training and (bias is not None or mask is not None))
    if use_kernel is None:
        use_kernel = (q.device.type == 'cpu' and kernel_scores and not use_flex and not is_exporting()
                      and cpu_kernel_available())
    if use_kernel:
        _check_kernel_inputs(q, training, bias, mask, causal, dropout_p)
        out_dtype, work = v.dtype, torch.promote_types(q.dtype, torch.float32)
        with autocast_off(q.device):
            q, k, v, ranges, ts = (t.to(work) for t in (q, k, v, ranges, ts))
            if training:
                out = KernelAttention.apply(q, k, v, ranges, ts, onednn)
            else:
                out = multimax_cpu(q, k, v, ranges, ts, bias, mask, onednn)[0]
        return out.to(out_dtype)
    cuda_flex_fits = min(q.shape[-1], v.shape[-1]) >= _CUDA_FLEX_MIN_HEAD_DIM
    if use_flex is None:
        use_flex = (flex_attention is not None and not dropout_p
                    and (q.is_cuda and cuda_flex_fits or _cpu_flex_compiles(q, training, bias)))
    if use_flex:
        if dropout_p:
            raise ValueError(f"the FlexAttention path of MultiMax has no attention dropout, got dropout_p={dropout_p}")
        if q.is_cuda and not cuda_flex_fits:
            raise ValueError(f"the FlexAttention path of MultiMax on CUDA takes heads of at least "
                             f"{_CUDA_FLEX_MIN_HEAD_DIM} channels, got {q.shape[-1]} (q, k) and {v.shape[-1]} (v)")
        if training and q.is_cuda:
            return _multimax_flex(q, k, v, ranges, ts, bias, mask, causal, per_row_parameters=True)[0]
        if training:
            rows = max(1, _FLEX_BACKWARD_BLOCK_BYTES // row_bytes)
            return _MultiMaxInRowBlocks.apply(q, k, v, ranges, ts, bias, mask, causal, rows, True)
        return _multimax_flex(q, k, v, ranges, ts, bias, mask, causal)[0]
    rows = max(1, _ROW_BLOCK_BYTES // row_bytes)
    blocks_trace = _ROW_BLOCKS_TRACE or not torch.compiler.is_compiling() or is_exporting()
    if dropout_p or rows >= n or (training and (n * row_bytes <= _PLAIN_TRAINING_BYTES or not blocks_trace)):
        return _multimax_plain(q, k, v, ranges, ts, bias, mask, dropout_p, causal)
    if training:
        return _MultiMaxInRowBlocks.apply(q, k, v, ranges, ts, bias, mask, causal, rows, False)
    return _row_blocks_forward(q, k, v, ranges, ts, bias, mask, causal, rows, keep_lse=False)[0]


def _check_kernel_inputs(q: Tensor, training: bool, bias: Optional[Tensor], mask: Optional[Tensor], causal: bool,
                         dropout_p: float) -> None:
    """What forcing the CPU kernel (`use_kernel=True`) needs, checked before any work."""
    given = [what for what, present in (('causal=True', causal), (f'dropout_p={dropout_p}', bool(dropout_p)))
             if present]
    if given:
        raise ValueError(f"MultiMax's CPU kernel takes no causal masking or dropout, got {', '.join(given)}")
    given = [what for what, present in (('bias', bias is not None), ('mask', mask is not None)) if present]
    if training and given:
        raise ValueError(f"MultiMax's CPU kernel takes a bias and a mask in inference only, got {' and '.join(given)} "
                         "with gradients required")
    if q.device.type != 'cpu':
        raise ValueError(f"MultiMax's CPU kernel takes CPU tensors, got device {q.device}")
    if not cpu_kernel_available():
        raise RuntimeError("MultiMax's CPU kernel could not be built or loaded (see the warning above); expected a "
                           "C++ compiler and ninja, or use_kernel=None for the unfused path")


def _cpu_flex_compiles(q: Tensor, training: bool, bias: Optional[Tensor]) -> bool:
    """Whether inductor compiles FlexAttention for `q` here: CPU inference inside `torch.compile`, in one of
    `_CPU_FLEX_DTYPES`, without a bias. Inductor's CPU template (torch 2.14) fails to lower a `score_mod` that
    reads a tensor computed in the same graph, which a position bias gathered from its table is; the plain path,
    which inductor fuses, takes those. Under export the plain path stays, which every exporter takes."""
    return (q.device.type == 'cpu' and not training and bias is None and q.dtype in _CPU_FLEX_DTYPES
            and torch.compiler.is_compiling() and not is_exporting())


def _under_func_transforms(*tensors: Optional[Tensor]) -> bool:
    """Whether `torch.func` transforms (grad, vmap, jacrev, ...) hold any of `tensors`: the formula, in plain
    differentiable operations, serves them; the custom autograd functions and the CPU kernel have no rules for them.
    Inside `torch.compile` none are checked (the compiler traces the transforms itself)."""
    if torch.compiler.is_compiling():
        return False
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _multimax_plain(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                    mask: Optional[Tensor], dropout_p: float, causal: bool = False) -> Tensor:
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1)).to(work)
    if bias is not None:
        scores = scores + bias.to(work)
    if torch.jit.is_scripting():  # TorchScript compiles this branch alone
        modulated = multimax_modulation(scores, ranges.to(work), ts.to(work))
    elif _under_func_transforms(scores, ranges, ts):
        modulated = multimax_modulation(scores, ranges.to(work), ts.to(work))
    else:
        modulated = _Modulation.apply(scores, ranges.to(work), ts.to(work))
    # σ's backward needs its input only, so its output may take the mask in place
    logits = _masked(modulated, mask, causal)
    weights = logits.softmax(dim=-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights.to(v.dtype), v)


# Scores of this many bytes per block of query rows stay in cache between the passes over them.
_ROW_BLOCK_BYTES = 4 << 20
# Compiled by torch 2.11 (not 2.14 or 2.15), training in row blocks without FlexAttention returns zero gradients;
# there compiled training takes the plain path, which the compiler fuses (export, which has no backward, keeps it).
_ROW_BLOCKS_TRACE = torch.__version__ >= '2.14'
# Inductor's CUDA FlexAttention kernel (torch 2.11 to 2.14 at least) takes heads of at least this many channels;
# smaller ones (tiny test models) take the paths without it.
_CUDA_FLEX_MIN_HEAD_DIM = 16
# The backward pass after FlexAttention's unfused forward pass (forced on the CPU) takes blocks this large.
_FLEX_BACKWARD_BLOCK_BYTES = 256 << 20
# Training takes the plain path up to this many bytes of scores: its backward pass keeps about three score
# matrices, but it does not recompute them, and blocks of few rows (large batches of short sequences) multiply
# small matrices slowly. Beyond it, `_MultiMaxInRowBlocks` keeps memory linear in the rows.
_PLAIN_TRAINING_BYTES = 64 << 20


def _row_blocks_forward(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                        mask: Optional[Tensor], causal: bool, rows: int,
                        keep_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The output in v's dtype and, with `keep_lse`, the (B, h, n, 1) log-sum-exp of each row's logits, a block
    of `rows` query rows at a time, in float32 at least."""
    work = torch.promote_types(q.dtype, torch.float32)
    with autocast_off(q.device):
        q_scaled = q.to(work) * q.shape[-1] ** -0.5
        keys, values = k.to(work), v.to(work)
        ranges, ts = ranges.to(work), ts.to(work)
        out = values.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = values.new_empty(q.shape[:-1] + (1,)) if keep_lse else None
        for block in _row_slices(q.shape[-2], rows):
            logits = _block_logits(q_scaled, keys, ranges, ts, bias, mask, causal, block)[1]
            if keep_lse:
                lse[..., block, :] = block_lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                probs = logits.sub_(block_lse).exp_()
            else:
                probs = logits.softmax(dim=-1)
            out[..., block, :] = probs @ values
    return out.to(v.dtype), lse


def _row_slices(n: int, rows: int) -> List[slice]:
    return [slice(start, start + rows) for start in range(0, n, rows)]


def _bias_rows(bias: Tensor, block: slice) -> slice:
    return slice(None) if bias.shape[-2] == 1 else block


def _row_block(scores_like: Optional[Tensor], block: slice) -> Optional[Tensor]:
    """The rows `block` of a tensor that broadcasts to the scores, unless it broadcasts along the rows."""
    return None if scores_like is None else scores_like[..., _bias_rows(scores_like, block), :]


def _block_logits(q_scaled: Tensor, k: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                  mask: Optional[Tensor], causal: bool, block: slice) -> Tuple[Tensor, Tensor]:
    """The scores q·kᵀ/√d + bias of the query rows `block` and their logits σ(scores) + mask (and the causal
    mask), computed the same way by the forward pass and by the backward pass that recomputes them."""
    scores = q_scaled[..., block, :] @ k.transpose(-2, -1)
    if bias is not None:
        scores.add_(_row_block(bias, block).to(scores.dtype))
    return scores, _masked(_modulated(scores, ranges, ts), _row_block(mask, block), causal, block.start)


def _masked(logits: Tensor, mask: Optional[Tensor], causal: bool = False, first_row: int = 0) -> Tensor:
    """Add the (nW, n, m) window mask in place, batch entry b taking mask[b % nW]; with `causal`, −inf where key
    j comes after query `first_row` + i (row i of `logits`)."""
    if mask is not None:
        B, h, n, m = logits.shape
        windows = logits.view(B // mask.shape[0], mask.shape[0], h, n, m)
        if torch.jit.is_scripting() or not is_exporting():
            windows.add_(mask.to(logits.dtype).unsqueeze(1))
        else:  # the TorchScript-based ONNX exporter drops an in-place update through a view
            logits = (windows + mask.to(logits.dtype).unsqueeze(1)).view(B, h, n, m)
    if causal:
        logits.masked_fill_(later_tokens(logits.shape[-2], logits.shape[-1], logits.device, first_row), -math.inf)
    return logits


def _multimax_flex(q: Tensor, k: Tensor, v: Tensor, ranges: Tensor, ts: Tensor, bias: Optional[Tensor],
                   mask: Optional[Tensor], causal: bool = False, keep_lse: bool = False,
                   per_row_parameters: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """FlexAttention with σ as `score_mod`: the output and, with `keep_lse`, the (B, h, n, 1) float32
    log-sum-exp of each row's logits. `per_row_parameters`: σ's scalars as eight (B, h, n) tensors, each read once
    per score, so that FlexAttention's backward pass differentiates them."""
    work = torch.promote_types(q.dtype, torch.float32)
    ranges, ts = ranges.to(work), ts.to(work)
    row_parameters = [p.expand(q.shape[:3]).contiguous() for p in torch.cat([ranges, ts]).unbind()] \
        if per_row_parameters else []
    per_image = per_head = False
    if bias is not None:  # (B or 1, h or 1, n, m), read at the score's image and head where it has them
        bias = bias.to(work)
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(-1, -1, q.shape[-2], k.shape[-2])
        per_image, per_head = bias.shape[0] > 1, bias.shape[1] > 1
        # the dimensions it lacks are dropped here: torch 2.10 cannot trace a constant index in a score_mod
        bias = bias[slice(None) if per_image else 0, slice(None) if per_head else 0]
    mask = None if mask is None else mask.to(work)
    num_windows = 1 if mask is None else mask.shape[0]

    def modulate(score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        score = score.to(work)
        if bias is not None:
            leading = (batch,) * per_image + (head,) * per_head
            score = score + bias[leading + (q_idx, kv_idx)]
        if per_row_parameters:
            score = modulation_by_parts(score, *[p[batch, head, q_idx] for p in row_parameters])
        else:
            score = multimax_modulation(score, ranges, ts)
        if mask is not None:
            score = score + mask[batch % num_windows, q_idx, kv_idx]
        if causal:
            score = torch.where(kv_idx > q_idx, -math.inf, score)
        return score

    # inside a compiled model the surrounding compilation fuses FlexAttention itself
    fused = q.is_cuda and not torch.compiler.is_compiling()
    attend = _fused_flex() if fused else flex_attention
    if not keep_lse:
        return attend(q, k, v, score_mod=modulate), None
    out, aux = attend(q, k, v, score_mod=modulate, return_aux=AuxRequest(lse=True))
    return out, aux.lse.unsqueeze(-1)


def regions_apart(mask: Optional[Tensor]) -> Optional[Tensor]:
    """The (nW, n, m) shifted-window mask with −inf wherever it masks. σ is unbounded, so Swin's −100 between
    regions of a window may not outweigh σ's squares; MultiMax's own masks are −inf after σ. Every query keeps the
    keys of its own region, so no row is all −inf."""
    if mask is None:
        return None
    return mask.masked_fill(mask != 0, -math.inf)


@register_attention('multimax')
class MultiMaxMixer(SoftmaxMixer):
    """Softmax attention whose scores pass through the learned MultiMax modulation first (`ranges`, `ts`). Option:
    `causal` (query i sees keys j ≤ i)."""

    def __init__(self, dim: int, num_heads: int, group_grid: Optional[Grid] = None, attn_drop: float = 0., *,
                 causal: bool = False):
        super().__init__(dim, num_heads, group_grid, attn_drop, causal=causal)
        self.ranges = nn.Parameter(torch.zeros(4))
        self.ts = nn.Parameter(torch.zeros(4))
        trunc_normal_(self.ranges, std=.02)
        trunc_normal_(self.ts, std=.02)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: MixContext) -> Tensor:
        q, k, v = self.heads(q, k, v)
        out = multimax_attention(q, k, v, self.ranges, self.ts, ctx.pos_bias, regions_apart(ctx.mask),
                                 self.attn_drop if self.training else 0., causal=self.causal, onednn=self.onednn)
        return merge_heads(out)
