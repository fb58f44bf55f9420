"""Causal linear attention: the zoo's against the Triton kernels of flash-linear-attention (fla-core).

Both compute the normalised causal linear attention out_i = Σ_{j≤i} (φqᵢ·φkⱼ) vⱼ / (Σ_{j≤i} φqᵢ·φkⱼ + ε) with
φ(x) = elu(x) + 1: the zoo as its `linear` mixer with `causal=True` (prefix sums over chunks,
`models.attention.linear.causal_linear_attention`), fla-core as `chunk_linear_attn`, `fused_chunk_linear_attn` and
`fused_recurrent_linear_attn` with `normalize=True`, given φ(q) and φ(k) and `scale=1`. Only ε differs (the zoo's
1e-6, fla-core's 1e-10): a relative difference below 1e-6 / Σ_{j≤i} φqᵢ·φkⱼ, far under float32's rounding. This
is the one computation the two share: the zoo's vision attentions are not causal, and fla-core's kernels are.

Each token count runs in a process of its own. The mixer (eager, and compiled with `fullgraph=True`) and every
fla-core kernel take the same q, k, v as (B, n, C) with the heads in channel order, which is what the mixer receives
(fla-core reads them as (B, n, heads, d) views and returns (B, n, C) as the mixer does), and are timed in
interleaved rounds, forward alone and forward with backward. Each reports the largest error of its output and of
its gradients of q, k and v against the mixer in float64 (as a share of the largest value of each), its peak
memory above the inputs (as `scripts/benchmark.py` measures it), and the eager mixer's time over its own (> 1:
faster than the zoo's).

fla-core's kernels are Triton kernels for GPUs: the comparison needs a CUDA device and `pip install fla-core`.

    python scripts/compare_fla.py --out docs/fla_comparison
"""
import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # the repository's packages, and benchmark.py beside this file
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import torch
    from torch import Tensor

    from benchmark import child_results, error_result, interleaved_seconds, peak_memory_mib
    from engine.checkpoint import atomic_write_text, files_taken_together, prepare_script_out, write_table_keeping_notes
    from engine.distributed import resolve_device
    from engine.errors import UsageError, refuse_below, run_cli
    from models.attention import MixContext, get_mixer_class
    from models.attention.linear import elu_feature_map

FLA_KERNELS = ('chunk_linear_attn', 'fused_chunk_linear_attn', 'fused_recurrent_linear_attn')
ZOO = 'zoo'
ZOO_COMPILED = 'zoo (compiled)'
COLUMNS = ('tokens', 'kernel', 'out err', 'grad q err', 'grad k err', 'grad v err', 'forward ms', 'forward ×zoo',
           'forward MiB', 'fwd+bwd ms', 'fwd+bwd ×zoo', 'fwd+bwd MiB')
DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16, 'float32': torch.float32}

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]


def zoo_attention(dim: int, num_heads: int) -> Attention:
    """The zoo's causal linear mixer: (B, n, C) q, k, v -> (B, n, C)."""
    mixer = get_mixer_class('linear')(dim, num_heads, causal=True)

    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return mixer(q, k, v, MixContext(grid=(1, q.shape[1])))

    return attention


def fla_attention(kernel: Callable, num_heads: int) -> Attention:
    """An fla-core linear-attention kernel computing what the zoo's causal linear mixer computes: (B, n, C) q, k,
    v -> (B, n, C), the feature map applied before the kernel, scale 1, normalised."""
    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, n, C = q.shape
        q, k, v = (x.view(B, n, num_heads, C // num_heads) for x in (q, k, v))
        out, _ = kernel(elu_feature_map(q), elu_feature_map(k), v, scale=1.0, normalize=True)
        return out.reshape(B, n, C)

    return attention


def output_and_grads(attention: Attention, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor,
                     dtype: torch.dtype) -> Tuple[Tensor, ...]:
    """`attention`'s output on q, k, v in `dtype` and its gradients of q, k and v for the output gradient
    `grad_out`."""
    inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = attention(*inputs)
    out.backward(grad_out.to(out.dtype))
    return (out.detach(),) + tuple(x.grad for x in inputs)


def relative_errors(found: Sequence[Tensor], expected: Sequence[Tensor]) -> Dict[str, float]:
    """The largest error of the output and of the gradients of q, k and v, each as a share of the largest value of
    the expected one."""
    return {name: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            for name, a, b in zip(('out', 'grad_q', 'grad_k', 'grad_v'), found, expected)}


def measure(args: argparse.Namespace, attentions: Dict[str, Attention]) -> List[Dict]:
    """Errors, memory and times of every attention in `attentions` at `args.tokens` tokens (one process)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    generator = torch.Generator(device=device).manual_seed(0)
    dim = args.heads * args.head_dim
    q, k, v, grad_out = (torch.randn(args.batch_size, args.tokens, dim, device=device, dtype=dtype,
                                     generator=generator) for _ in range(4))
    expected = output_and_grads(attentions[ZOO], q, k, v, grad_out, torch.float64)
    rows, steps = [], {}
    for name, attention in attentions.items():
        row: Dict = dict(tokens=args.tokens, kernel=name)
        try:
            row.update(relative_errors(output_and_grads(attention, q, k, v, grad_out, dtype), expected))
            trainable = [x.detach().requires_grad_() for x in (q, k, v)]

            def forward(attention=attention):
                with torch.no_grad():
                    attention(q, k, v)

            def forward_backward(attention=attention, trainable=trainable):
                for x in trainable:
                    x.grad = None
                attention(*trainable).backward(grad_out)

            forward(), forward_backward()  # compiles, outside the memory measurement
            row['forward_mib'] = peak_memory_mib(forward, device)
            row['train_mib'] = peak_memory_mib(forward_backward, device)
            steps[name] = dict(forward=forward, train=forward_backward)
        except Exception as e:  # a kernel that cannot take this size (or memory) is reported, not fatal
            row = dict(tokens=args.tokens, kernel=name, **error_result(e, device))
        rows.append(row)
    timed = [row for row in rows if row['kernel'] in steps]
    for mode in ('forward', 'train'):
        seconds = interleaved_seconds([steps[row['kernel']][mode] for row in timed], args.rounds, args.warmup, device)
        for row, row_seconds in zip(timed, seconds):
            row[f'{mode}_ms'] = 1000 * statistics.median(row_seconds)
    zoo = next((row for row in timed if row['kernel'] == ZOO), None)
    for row in timed:
        for mode in ('forward', 'train'):
            row[f'{mode}_vs_zoo'] = zoo[f'{mode}_ms'] / row[f'{mode}_ms'] if zoo else None
    return rows


def fla_kernels(names: Sequence[str]) -> Dict[str, Callable]:
    """fla-core's linear-attention kernels by name; a UsageError where fla-core cannot be imported."""
    try:
        module = importlib.import_module('fla.ops.linear_attn')
    except Exception as e:  # not installed, or its Triton runtime finds no GPU driver
        raise UsageError(f'fla-core cannot be imported ({type(e).__name__}: {e}); expected it installed '
                         f'(pip install fla-core) on a machine with a CUDA device') from None
    return {name: getattr(module, name) for name in names}


def build_attentions(dim: int, num_heads: int, kernels: Dict[str, Callable]) -> Dict[str, Attention]:
    """The zoo's mixer, eager (the reference of the errors and times) and compiled, and the fla-core kernels."""
    attentions: Dict[str, Attention] = {ZOO: zoo_attention(dim, num_heads)}
    attentions[ZOO_COMPILED] = torch.compile(zoo_attention(dim, num_heads), fullgraph=True, dynamic=False)
    attentions.update({f'fla {name}': fla_attention(kernel, num_heads) for name, kernel in kernels.items()})
    return attentions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--tokens', nargs='+', type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--head-dim', type=int, default=64)
    parser.add_argument('--dtype', default='bfloat16', choices=list(DTYPES))
    parser.add_argument('--kernels', nargs='+', default=list(FLA_KERNELS), choices=FLA_KERNELS)
    parser.add_argument('--rounds', type=int, default=20, help='timed rounds')
    parser.add_argument('--warmup', type=int, default=3, help='untimed calls of each step before the rounds')
    parser.add_argument('--timeout', type=int, default=1800, help='seconds for the process of one token count')
    parser.add_argument('--out', default='fla_comparison', help='writes OUT.md and OUT.json')
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every refusal in one line, exit status 2, before a process starts."""
    refuse_below(parser, {'--batch-size': (args.batch_size, 1), '--heads': (args.heads, 1),
                          '--head-dim': (args.head_dim, 1), '--rounds': (args.rounds, 1),
                          '--warmup': (args.warmup, 0), '--timeout': (args.timeout, 1),
                          '--tokens': (min(args.tokens), 1)})
    if args.device.split(':')[0] != 'cuda':
        parser.error(f"--device {args.device}: fla-core's kernels are Triton kernels for GPUs; expected 'cuda' or "
                     f"'cuda:N'")
    if not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device, and fla-core's kernels are Triton "
                     f"kernels for GPUs; expected a machine with one")
    prepare_script_out(parser, args.out, prefix=True, suffixes=('.json', '.md'), example='fla_comparison')
    try:
        resolve_device(args.device)
        fla_kernels(args.kernels)
    except UsageError as e:
        parser.error(str(e))


def run_child(args: argparse.Namespace, tokens: int) -> List[Dict]:
    """One token count, measured in a process of its own (a fresh allocator and compile cache)."""
    cmd = [sys.executable, os.path.abspath(__file__), '--child', '--tokens', str(tokens), '--device', args.device,
           '--batch-size', str(args.batch_size), '--heads', str(args.heads), '--head-dim', str(args.head_dim),
           '--dtype', args.dtype, '--rounds', str(args.rounds), '--warmup', str(args.warmup),
           '--kernels', *args.kernels]
    rows = child_results(cmd, args.timeout)
    return [dict(tokens=tokens, kernel='all', error=rows)] if isinstance(rows, str) else rows


def table(args: argparse.Namespace, rows: List[Dict], minutes: float, device_name: str,
          fla_version: str) -> List[str]:
    """The Markdown report: setting, then a row per token count and kernel."""
    lines = [
        '# Causal linear attention: the zoo against fla-core', '',
        f'- date: {datetime.date.today().isoformat()}',
        f'- device: {device_name}',
        f'- versions: torch {torch.__version__}, fla-core {fla_version}, Python {platform.python_version()}',
        f'- command: `python {" ".join(shlex.quote(a) for a in sys.argv)}` ({minutes:.0f} min)',
        f'- batch {args.batch_size}, {args.heads} heads of {args.head_dim} channels, {args.dtype} inputs; median of '
        f'{args.rounds} interleaved rounds after {args.warmup} warm-up calls', '',
        'Errors: the largest absolute error of the output and of the gradients of q, k and v against the zoo\'s '
        'mixer in float64, as a share of the largest absolute value. Memory: peak allocated above the inputs. '
        '`×zoo`: the eager zoo mixer\'s time over this kernel\'s (> 1: faster than the zoo).', '',
        '| ' + ' | '.join(COLUMNS) + ' |', '|---' * len(COLUMNS) + '|',
    ]
    for row in rows:
        if 'error' in row:
            lines.append(f"| {row['tokens']} | {row['kernel']} | {row['error']} |" + ' |' * (len(COLUMNS) - 3))
            continue
        cells = [f"{row[key]:.1e}" for key in ('out', 'grad_q', 'grad_k', 'grad_v')]
        for mode in ('forward', 'train'):
            ratio = row[f'{mode}_vs_zoo']
            cells += [f"{row[f'{mode}_ms']:.3f}", '–' if ratio is None else f'{ratio:.2f}',
                      f"{row[f'{mode}_mib']:.0f}"]
        lines.append(f"| {row['tokens']} | {row['kernel']} | " + ' | '.join(cells) + ' |')
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        (args.tokens,) = args.tokens
        attentions = build_attentions(args.heads * args.head_dim, args.heads, fla_kernels(args.kernels))
        print(json.dumps(measure(args, attentions)))
        return
    check_arguments(parser, args)
    started, rows = time.time(), []
    for tokens in args.tokens:
        print(f'{tokens} tokens ({time.time() - started:.0f} s)', file=sys.stderr, flush=True)
        rows += run_child(args, tokens)
    measured = [row for row in rows if 'error' not in row]
    if not measured:  # a table of errors alone would replace the last run's
        raise UsageError(f"no kernel was measured at any token count (the first: {rows[0]['tokens']} tokens, "
                         f"{rows[0]['error']}); {args.out}.json and .md are unchanged")
    lines = table(args, rows, (time.time() - started) / 60, torch.cuda.get_device_name(torch.device(args.device)),
                  importlib.metadata.version('fla-core'))
    with files_taken_together():  # never a new JSON beside the previous run's table
        atomic_write_text(args.out + '.json', json.dumps(rows, indent=1))
        write_table_keeping_notes(args.out + '.md', '\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
