"""Inference throughput, training-step time, efficiency and peak memory of every attention on every family.

For each family, size and resolution one child process builds timm's own model of the same architecture (the
reference, where timm has one) and ours with every attention, then times them in interleaved rounds (each round
runs every model once, in alternating order), so that a machine whose load drifts slows all of them alike; the
table gives the best (or median) round. Ratios are taken between models of the same process: `×timm` against
timm's model, `×softmax` against our softmax model. With `--compile` every model also runs as
`torch.compile(model, fullgraph=True)` in the same rounds, on rows of its own (`×eager`: against the same model
uncompiled).

Efficiency: the FLOPs of a forward pass (inference) and of a forward and backward pass (training step), counted by
`torch.utils.flop_counter.FlopCounterMode` on the eager model, off the CPU on a CPU model of the same spec (2 per
multiply-add of the matrix products and convolutions; the CPU kernel of `scaled_dot_product_attention` by its
formula 2·B·h·n·m·(d + d_v), twice that backward, under every torch: before 2.15 the counter sees it as 0, from 2.15
on it adds the backward's recomputed scores), divided by the time, as a share of the matrix-multiply rate: a square
matrix product in the models' precision, timed in every round beside them with the same threads. The share is the
median over the rounds of each round's ratio. `% mm` takes `torch.matmul`'s rate (the BLAS library on the CPU); on
the CPU `% best` takes the faster of it and oneDNN's, since the two libraries reach different rates on some CPUs
(MKL runs a narrower vector path on AMD's AVX-512 CPUs). `--onednn` runs the models' linear layers, softmax's and
MultiMax's fused CPU kernel and the linear attentions' batched products through oneDNN, inference and training,
eager and compiled, and in inference the GELU of timm's `Mlp` and of PVT v2's MLP inside the product or convolution
before it (`models.convert_to_onednn`).

Ceiling (`--ceiling`): the ops whose FLOPs are counted (matrix products, convolutions, fused attention kernels),
recorded with their inputs in one pass of the eager model and replayed alone in the same rounds, give the share
the model would reach if everything else it does (normalisations, element-wise work, copies) took no time: a
model below the target because its products themselves run below the square product's rate cannot be brought to
it by removing other work. The replayed products read inputs that earlier ones wrote long before, so they miss
the caches the model's own products hit: the ceiling is a slight underestimate.

Peak memory is what a forward pass (inference) or a training step (forward, backward, AdamW) allocates above
what the model already holds: on CUDA the allocator's peak, on CPU the peak of live tensor bytes recorded by the
profiler. A training step's peak includes the gradients (constant in the resolution).

    python scripts/benchmark.py --device cpu --threads 1 --families deit swin --sizes tiny \
        --resolutions 224 512 1024 swin=224,448 --train-max-resolution 512 --out docs/benchmarks
    python scripts/benchmark.py --device cuda --compile --out docs/benchmarks
    python scripts/benchmark.py --imports my_attention --attentions softmax cosine --families deit swin

An attention of one's own registers when its module is imported (`--imports`, from the working directory); it has
no entrypoints, so it is timed in softmax's architecture with `attn_type` set to it.

Writes OUT.md (machine, command, date, table, target ratios) and OUT.csv. Text below a line `<!-- notes -->` in
an existing OUT.md (a hand-written reading of the results) is kept.
"""
import argparse
import csv
import datetime
import fnmatch
import io
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, flop_registry

    import timm

    import models  # noqa: F401  (registers the families)
    from engine.build import create_optimizer, import_modules
    from engine.checkpoint import atomic_write_text, files_taken_together, prepare_script_out, write_table_keeping_notes
    from engine.compile import compile_model
    from engine.config import load_config
    from engine.distributed import resolve_device
    from engine.errors import UsageError, refuse_below, run_cli
    from models.attention import forms_score_matrix, list_attentions
    from models.onednn import convert_to_onednn, onednn_available, onednn_linear

# The attention every `×softmax` ratio compares against.
BASELINE = 'softmax'
FAMILIES = ('deit', 'pvt', 'pvt_v2', 'swin', 'cswin')
# PVT v2's sizes under the PVT v1 size each is compared with in the PVT v2 paper (B1 with PVT-Tiny, ...).
FAMILY_SIZES = {'pvt_v2': {'tiny': 'b1', 'small': 'b2', 'medium': 'b3', 'large': 'b4'}}
# timm's own model of the same architecture as our softmax one, where timm has it.
TIMM_REFERENCE = {
    ('deit', 'tiny'): 'deit_tiny_patch16_224',
    ('deit', 'small'): 'deit_small_patch16_224',
    ('pvt_v2', 'tiny'): 'pvt_v2_b1',
    ('pvt_v2', 'small'): 'pvt_v2_b2',
    ('swin', 'tiny'): 'swin_tiny_patch4_window7_224',
}
REFERENCE = 'timm'
# The speed goals against our softmax model of the same family and size, by model-name pattern (goals for
# particular methods, not a list of attentions): the inference speed-up at the largest resolution run, on CUDA and
# elsewhere, and the slow-down of inference and of the training step at every resolution, eager and compiled.
SPEEDUP_GOALS = {'inline_deit_tiny': ('InLine-DeiT-T / softmax DeiT-T', 4.8, 3.0)}
# MultiMax's time against softmax's, by device: (inference, training step); None where the issue sets none.
SLOWDOWN_GOALS = {'multimax_*': ('MultiMax / softmax', {'cuda': (None, 1.05), 'cpu': (1.10, 1.15)})}
# glibc returns large freed blocks to the system and adapts that threshold as the process runs, so a model that
# allocates big fresh tensors page-faults on some calls and not on others: timings of one op vary tenfold
# between runs. These settings keep freed memory in the process, making every call pay the same.
STEADY_MALLOC = {'MALLOC_MMAP_THRESHOLD_': str(2 ** 32), 'MALLOC_TRIM_THRESHOLD_': str(2 ** 32)}
COMPILED = ' (compiled)'
# The side of the square product whose rate efficiencies are shares of, by device type: on a GPU, one long enough
# to fill the card (on an H200, 2048² bfloat16 products lasted about 70 µs and ran at 93-244 TFLOP/s in the
# benchmark's rounds, far below the card's rate, so the models' shares of it read several times too high).
MATMUL_SIZES = {'cpu': 2048, 'cuda': 8192}


def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU attention kernel: q·kᵀ and p·v, 2·B·h·n·m·(d + d_v) (a causal mask's skipped half included)."""
    *batch, n, d = query_shape
    return 2 * math.prod(batch) * n * key_shape[-2] * (d + value_shape[-1])


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                         _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's gradients of input and weight, each as many FLOPs as the forward pass. torch's own
    formula counts the weight gradient of a grouped convolution as if it were dense: a depthwise one's by a
    factor of the channels."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def _cpu_attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                                  **kwargs) -> int:
    """Gradients of q, k, v and p: twice the forward pass's products."""
    return 2 * _cpu_attention_flops(query_shape, key_shape, value_shape)


# Passed to each counter rather than registered globally: torch 2.15 registers its own formulas for the CPU
# attention kernel (a second registration raises) and counts the backward's recomputed scores, which would make
# the same run's efficiency depend on the installed torch.
FLOP_FORMULAS: Dict[Any, Callable[..., int]] = {
    torch.ops.aten.convolution_backward: _conv_backward_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def flop_counter() -> FlopCounterMode:
    """The FLOP counter of the efficiency: torch's, with `FLOP_FORMULAS` for the CPU attention kernel and the
    gradients of a grouped convolution."""
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)


def count_flops(model: torch.nn.Module, x: torch.Tensor, train: bool) -> int:
    """FLOPs of one forward pass of `model` on `x` (`train`: forward and backward of the sum of the outputs)."""
    counter = flop_counter()
    model.train(train)
    with counter, torch.set_grad_enabled(train):
        out = model(x)
        if train:
            out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def model_flops(spec: Dict, model: torch.nn.Module, x: torch.Tensor, train: bool) -> Dict[str, Optional[int]]:
    """FLOPs of the inference pass and, with `train`, of the training step, counted on the CPU: they do not
    depend on the device, and on CUDA the compiled FlexAttention that MultiMax calls raises under torch's FLOP
    counter. Off the CPU, a CPU model of `spec` counts them on one image of `x`'s size, times the batch: every
    counted op works on each image alone, and the CPU would take longer over a GPU batch than the timing itself.
    (MultiMax's training count can differ slightly from the batch's own: its backward pass recomputes the scores
    once they pass a size the batch helps set.)"""
    if x.device.type == 'cpu':
        return dict(infer=count_flops(model, x, train=False),
                    train=count_flops(model, x, train=True) if train else None)
    one = model_flops(spec, timm.create_model(spec['model'], **spec['kwargs']),
                      torch.zeros((1, *x.shape[1:]), dtype=x.dtype), train)
    return {mode: None if flops is None else flops * len(x) for mode, flops in one.items()}


def efficiency(flops: float, seconds: Sequence[float], matmul_flops: float, matmul_seconds: Sequence[float]) -> float:
    """The median over rounds of a model's FLOP rate as a share (%) of the matrix product's rate in the same round."""
    return 100 * statistics.median(flops / t / (matmul_flops / m) for t, m in zip(seconds, matmul_seconds))


class CountedOpsRecorder(TorchDispatchMode):
    """Records the calls of the ops the FLOP counter counts (those with a FLOP formula), with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[Callable, tuple, Dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket in flop_registry or func._overloadpacket in FLOP_FORMULAS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def counted_ops_alone(step: Callable[[], None]) -> Callable[[], None]:
    """Runs `step` once and returns a step that replays only its counted ops, each on the inputs it had."""
    with CountedOpsRecorder() as recorder:
        step()
    calls = recorder.calls

    def replay() -> None:
        with torch.no_grad():
            for func, args, kwargs in calls:
                func(*args, **kwargs)

    return replay


def matmul_steps(device: torch.device, size: int) -> Tuple[Dict[str, Callable[[], None]], int]:
    """`size`² matrix products in the models' precision (float32; bfloat16 on CUDA) by library, and their FLOPs:
    `torch.matmul`, and on a CPU with oneDNN also oneDNN's product."""
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2))
    out = torch.empty_like(a)

    def matmul(a=a, b=b, out=out):
        torch.matmul(a, b, out=out)

    steps = {'matmul': matmul}
    if device.type == 'cpu' and onednn_available():
        def onednn(a=a, b=b):
            onednn_linear(a, b)  # a @ b.T

        steps['onednn'] = onednn
    return steps, 2 * size ** 3


def model_spec(attention: str, family: str, size: str, resolution: int) -> Tuple[str, Dict]:
    """Our model name and its keyword arguments: the registered `{attention}_{family}_{size}`, which every family
    has for every built-in attention (a paper's official model keeps its own configuration; PVT v2 names its sizes
    b0-b5, see `FAMILY_SIZES`); an attention registered outside the package has no entrypoints and runs in
    softmax's architecture with `attn_type`."""
    architecture = f'{family}_{FAMILY_SIZES.get(family, {}).get(size, size)}'
    kwargs: Dict = dict(img_size=resolution)
    if timm.list_models(f'{attention}_{family}_*'):
        name = f'{attention}_{architecture}'
    else:
        name, kwargs['attn_type'] = f'{BASELINE}_{architecture}', attention
    if family == 'swin' and 'attn_type' not in kwargs and not forms_score_matrix(attention) and _from_paper(name):
        # A paper's linear-attention Swin takes `window_size` as the window of its linear blocks (its softmax
        # window derives from it); the stage-0 grid keeps them global at every resolution, as at the trained one.
        kwargs['window_size'] = resolution // 4
    return name, kwargs


def _from_paper(name: str) -> bool:
    """Whether model `name` is a paper's release: its pretrained cfg names the paper (False for an unknown name,
    which the measuring process reports)."""
    cfg = timm.models.get_pretrained_cfg(name)
    return cfg is not None and bool(cfg.paper_ids)


def group_specs(family: str, size: str, resolution: int, attentions: Sequence[str], reference: bool) -> List[Dict]:
    """The models timed together for one family, size and resolution: timm's own model first (where it has one
    and `reference`), then ours with each of `attentions`."""
    specs = []
    timm_name = TIMM_REFERENCE.get((family, size)) if reference else None
    if timm_name:
        # timm's PVT v2 takes any input size and has no img_size argument
        kwargs = {} if family == 'pvt_v2' else dict(img_size=resolution)
        specs.append(dict(label=REFERENCE, model=timm_name, kwargs=kwargs))
    for attention in attentions:
        name, kwargs = model_spec(attention, family, size, resolution)
        specs.append(dict(label=attention, model=name, kwargs=kwargs))
    return specs


def peak_memory_mib(fn: Callable[[], None], device: torch.device) -> float:
    """Peak of the memory `fn` allocates above what is allocated when it starts (MiB)."""
    if device.type == 'cuda':
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2 ** 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == '[memory]')
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2 ** 20


def interleaved_seconds(steps: Sequence[Callable[[], None]], rounds: int, warmup: int,
                        device: torch.device) -> List[List[float]]:
    """Seconds of each step in each of `rounds` rounds, after `warmup` untimed calls of each. A round runs every step
    once, in an order reversed from one round to the next, so that every step runs as often right after each
    neighbour and a machine whose speed drifts slows every step alike."""
    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize(device)

    for step in steps:
        for _ in range(warmup):
            step()
    sync()
    times: List[List[float]] = [[] for _ in steps]
    order = list(range(len(steps)))
    for _ in range(rounds):
        order.reverse()
        for i in order:
            start = time.perf_counter()
            steps[i]()
            sync()
            times[i].append(time.perf_counter() - start)
    return times


class Runner(NamedTuple):
    """A model timed in a child process: its steps, its result (filled in) and FLOPs by mode."""
    model: torch.nn.Module
    infer: Callable[[], None]
    train_step: Callable[[], None]
    result: Dict
    flops: Dict[str, Optional[int]]
    eager: bool


def measure(args: argparse.Namespace) -> List[Dict]:
    """Child process: build every model of one configuration (and its compiled twin with `--compile`), count its
    FLOPs, measure memory, then time it in interleaved rounds beside a matrix product."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == 'cuda')
    results: List[Dict] = []
    runners: List[Runner] = []
    specs = json.loads(args.specs)
    recipe = load_config(None)  # the training step updates as train.py does: the recipe's AdamW, fused
    if args.compile:
        # The models of a process share their modules' code, so each compiled model recompiles that code; the
        # default limit (8 graphs per code object) would stop the later models under `fullgraph=True`.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(specs))
    for spec in specs:
        try:
            torch.manual_seed(0)
            model = timm.create_model(spec['model'], **spec['kwargs']).to(device)
            if args.channels_last:
                model = model.to(memory_format=torch.channels_last)
            x = torch.randn(args.batch_size, 3, args.resolution, args.resolution, device=device)
            y = torch.randint(0, model.num_classes, (args.batch_size,), device=device)
            optimizer = create_optimizer(recipe, model, lr=1e-4)
            if args.onednn:
                convert_to_onednn(model)
            flops = model_flops(spec, model, x, args.train)
            variants = [model] + ([compile_model(model)] if args.compile else [])
        except Exception as e:  # a configuration a model cannot take (or memory) is reported, not fatal
            results += [error_result(e, device)] * (2 if args.compile else 1)
            continue
        for run in variants:
            def infer(run=run, x=x):
                with torch.no_grad(), torch.autocast(**amp):
                    run(x)

            def train_step(run=run, x=x, y=y, optimizer=optimizer):
                with torch.autocast(**amp):
                    loss = torch.nn.functional.cross_entropy(run(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            try:
                result = dict(params_m=sum(p.numel() for p in model.parameters()) / 1e6,
                              gflops=flops['infer'] / args.batch_size / 1e9)
                model.eval()
                infer()  # compiles the inference graph, outside the memory measurement
                result['infer_mem_mib'] = peak_memory_mib(infer, device)
                if args.train:
                    model.train()
                    train_step()  # creates the optimizer state (and compiles), so the measured step is a steady one
                    result['train_mem_mib'] = peak_memory_mib(train_step, device)
                runners.append(Runner(model, infer, train_step, result, flops, eager=run is model))
            except Exception as e:
                result = error_result(e, device)
            results.append(result)

    matmuls, matmul_flops = matmul_steps(device, args.matmul_size)

    pick = min if args.stat == 'min' else statistics.median
    modes = [('infer', 'infer_img_s', lambda r: r.infer, args.iters)]
    if args.train:
        modes.append(('train', 'train_step_ms', lambda r: r.train_step, args.train_iters))
    for mode, key, step_of, iters in modes:
        for runner in runners:
            runner.model.train(mode == 'train')
        # the ceiling of an eager model; a compiled one calls the same products and shares it
        alone = [(r, counted_ops_alone(step_of(r))) for r in runners if args.ceiling and r.eager]
        steps = [step_of(r) for r in runners] + [replay for _, replay in alone] + list(matmuls.values())
        times = interleaved_seconds(steps, iters, args.warmup, device)
        alone_times = times[len(runners):len(runners) + len(alone)]
        times, matmul_times = times[:len(runners)], dict(zip(matmuls, times[len(runners) + len(alone):]))
        # each round's faster library
        best_times = [min(round_times) for round_times in zip(*matmul_times.values())]
        rates = {f'{library}_gflop_s': matmul_flops / statistics.median(library_times) / 1e9
                 for library, library_times in matmul_times.items()}
        for model_times, runner in zip(times, runners):
            seconds, result, flops = pick(model_times), runner.result, runner.flops[mode]
            result[key] = args.batch_size / seconds if mode == 'infer' else 1000 * seconds
            result[f'{mode}_mm_pct'] = efficiency(flops, model_times, matmul_flops, matmul_times['matmul'])
            result[f'{mode}_best_pct'] = efficiency(flops, model_times, matmul_flops, best_times)
            result.update({f'{mode}_{name}': rate for name, rate in rates.items()})
        for replay_times, (runner, _) in zip(alone_times, alone):
            runner.result[f'{mode}_ceiling_pct'] = efficiency(runner.flops[mode], replay_times, matmul_flops,
                                                              best_times)
    return results


def error_result(e: Exception, device: torch.device) -> Dict:
    """A measurement that failed (a model or kernel that cannot take this size, or memory), as a result of one line;
    on CUDA the allocator's cache is emptied for the next one."""
    if device.type == 'cuda':
        torch.cuda.empty_cache()
    return dict(error=f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'[:200])


def child_results(cmd: List[str], timeout: int, env: Optional[Dict[str, str]] = None) -> Union[List[Dict], str]:
    """The results a measuring process prints as JSON on its last line, or why there are none: the timeout, or the
    last line of its error output."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return f'timeout after {timeout} s'
        except BaseException:
            # subprocess.run kills the process on an interruption but does not wait for it, leaving it to init
            proc.kill()
            proc.wait()
            raise
    if proc.returncode != 0:
        return (stderr.strip().splitlines() or [f'exit status {proc.returncode}'])[-1][:200]
    return json.loads(stdout.strip().splitlines()[-1])


def run_group(args: argparse.Namespace, specs: List[Dict], resolution: int, train: bool) -> List[Dict]:
    cmd = [sys.executable, os.path.abspath(__file__), '--child', '--specs', json.dumps(specs),
           '--resolution', str(resolution), '--device', args.device, '--batch-size', str(args.batch_size),
           '--iters', str(args.iters), '--train-iters', str(args.train_iters), '--warmup', str(args.warmup),
           '--threads', str(args.threads), '--stat', args.stat, '--matmul-size', str(args.matmul_size)]
    cmd += ['--imports', *args.imports] if args.imports else []
    cmd += ['--compile'] * args.compile + ['--channels-last'] * args.channels_last
    cmd += ['--onednn'] * args.onednn + ['--ceiling'] * args.ceiling
    cmd += ['--train' if train else '--no-train']
    env = dict(os.environ, **STEADY_MALLOC) if args.steady_malloc else None
    results = child_results(cmd, args.timeout, env)
    if isinstance(results, str):
        return [dict(error=results)] * len(specs) * (2 if args.compile else 1)
    return results


def import_requested(argv: Sequence[str]) -> None:
    """Import the modules of `--imports` before the parser offers the registry's attentions (not for --help, which a
    module failing on import would hide)."""
    if '-h' in argv or '--help' in argv:
        return
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument('--imports', nargs='+', default=[])
    import_modules(early.parse_known_args(argv)[0].imports, '--imports')


def build_parser() -> argparse.ArgumentParser:
    """The command line; the attentions to choose from are the registry's (those of `--imports` included)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--imports', nargs='+', default=[], metavar='MODULE',
                        help='modules to import first (from the working directory), which register attentions of '
                             'your own')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--families', nargs='+', default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument('--sizes', nargs='+', default=['tiny', 'small'])
    parser.add_argument('--attentions', nargs='+', default=list_attentions(), choices=list_attentions())
    parser.add_argument('--resolutions', nargs='+', default=['224', '384', '512', '768', '1024'],
                        help='input sizes, as numbers for every family or FAMILY=R1,R2 for one (swin=224,448); a '
                             'size a model cannot take (DeiT: multiples of its 16-pixel patches) is reported and '
                             'skipped')
    parser.add_argument('--no-reference', dest='reference', action='store_false',
                        help="do not time timm's own models")
    parser.add_argument('--batch-size', type=int, default=1)
    parser.add_argument('--iters', type=int, default=10, help='timed inference rounds')
    parser.add_argument('--train-iters', type=int, default=5, help='timed training-step rounds')
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls of each model before the rounds')
    parser.add_argument('--stat', choices=('min', 'median'), default='min',
                        help='time of a model over the rounds: best (robust on a shared machine) or median')
    parser.add_argument('--train', action=argparse.BooleanOptionalAction, default=True,
                        help='also time a training step (forward, backward, AdamW)')
    parser.add_argument('--train-max-resolution', type=int, default=None,
                        help='time training steps only up to this resolution (inference above it)')
    parser.add_argument('--threads', type=int, default=0, help='CPU threads per process (0: torch default)')
    parser.add_argument('--compile', action='store_true',
                        help='also time every model compiled (fullgraph), on rows of its own')
    parser.add_argument('--matmul-size', type=int, default=None,
                        help='side of the square matrix product whose rate the efficiency is a share of (default: '
                             f'{MATMUL_SIZES["cpu"]} on the CPU, {MATMUL_SIZES["cuda"]} on CUDA, where a '
                             f'{MATMUL_SIZES["cpu"]}² product is too short to fill a large GPU)')
    parser.add_argument('--note', default='', help='a line for the header of OUT.md, e.g. what else ran')
    parser.add_argument('--channels-last', action='store_true')
    parser.add_argument('--onednn', action='store_true',
                        help="CPU: the models' linear layers, attention products and, in inference, their MLPs' GELU "
                             "through oneDNN (models.convert_to_onednn)")
    parser.add_argument('--ceiling', action='store_true',
                        help="CPU: also time each model's counted ops (products, convolutions, fused attention "
                             "kernels) replayed alone: the share the model would reach if its other work took no time")
    parser.add_argument('--steady-malloc', action=argparse.BooleanOptionalAction, default=True,
                        help="keep freed memory in the measuring processes (glibc's MALLOC_MMAP_THRESHOLD_ and "
                             "MALLOC_TRIM_THRESHOLD_), so that timings do not depend on when the system allocator "
                             "returns memory")
    parser.add_argument('--timeout', type=int, default=3600, help='seconds per family, size and resolution')
    parser.add_argument('--out', default='benchmark', help='output prefix: writes OUT.md and OUT.csv')
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--specs', help=argparse.SUPPRESS)
    parser.add_argument('--resolution', type=int, help=argparse.SUPPRESS)
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Dict[str, List[int]]:
    """The resolutions of each family; or an exit through `parser.error` (one line, status 2) on a value no
    measurement could take, before any model is built: an unusable device, a count below its minimum, a bad
    resolution, `--onednn` off the CPU, a size some family lacks or an `--out` that cannot be written."""
    try:
        device = resolve_device(args.device)
    except UsageError as e:
        parser.error(f'--device: {e}')
    if args.matmul_size is None:
        args.matmul_size = MATMUL_SIZES[device.type]
    refuse_below(parser, {
        '--batch-size': (args.batch_size, 1), '--iters': (args.iters, 1), '--train-iters': (args.train_iters, 1),
        '--warmup': (args.warmup, 0), '--threads': (args.threads, 0), '--matmul-size': (args.matmul_size, 1),
        '--timeout': (args.timeout, 1), '--train-max-resolution': (args.train_max_resolution, 1)})
    if args.onednn and (device.type != 'cpu' or not onednn_available()):
        parser.error(f"--onednn runs on the CPU with oneDNN (torch.backends.mkldnn); got device {args.device!r}"
                     + ('' if onednn_available() else ' and no oneDNN in this torch'))
    # the ceiling records the ops it replays under a dispatch mode, which the compiled FlexAttention of MultiMax on
    # CUDA refuses (as it refuses the FLOP counter)
    if args.ceiling and device.type != 'cpu':
        parser.error(f"--ceiling runs on the CPU; got device {args.device!r}")
    for family in args.families:
        for size in args.sizes:
            for attention in args.attentions:
                name, kwargs = model_spec(attention, family, size, 224)
                if not timm.is_model(name):
                    built = BASELINE if 'attn_type' in kwargs else attention  # softmax's, for one of your own
                    parser.error(f"--sizes {size}: no model {name}; {built}_{family} has sizes "
                                 f"{', '.join(family_sizes(family, built))}")
    try:
        resolutions = parse_resolutions(args.resolutions, args.families)
    except ValueError as e:
        parser.error(f'--resolutions: {e}; expected positive numbers or FAMILY=R1,R2 with FAMILY one of '
                     f'{", ".join(args.families)}')
    prepare_script_out(parser, args.out, prefix=True, suffixes=('.csv', '.md'), example='benchmark')
    return resolutions


def family_sizes(family: str, attention: str) -> List[str]:
    """The sizes registered as `{attention}_{family}_{size}`, PVT v2's under the names `--sizes` takes too."""
    prefix = f'{attention}_{family}_'
    others = [f'{attention}_{f}_' for f in FAMILIES if f != family and f.startswith(family)]
    sizes = [name[len(prefix):] for name in timm.list_models(prefix + '*')
             if not any(name.startswith(other) for other in others)]
    aliases = [alias for alias, size in FAMILY_SIZES.get(family, {}).items() if size in sizes]
    return aliases + sizes


def main(argv: Optional[Sequence[str]] = None) -> None:
    import_requested(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return

    resolutions = check_arguments(parser, args)
    args.load_at_start = os.getloadavg()[0]
    started = time.time()
    rows: List[Dict] = []
    skipped: List[str] = []
    for family in args.families:
        for size in args.sizes:
            for resolution in resolutions[family]:
                specs = group_specs(family, size, resolution, args.attentions, args.reference)
                train = args.train and (args.train_max_resolution is None or resolution <= args.train_max_resolution)
                print(f'{family}-{size} @ {resolution} ({time.time() - started:.0f} s)', file=sys.stderr, flush=True)
                suffixes = ['', COMPILED] if args.compile else ['']
                labels = [spec['label'] + suffix for spec in specs for suffix in suffixes]
                results = dict(zip(labels, run_group(args, specs, resolution, train)))
                for spec in specs:
                    for suffix in suffixes:
                        res = results[spec['label'] + suffix]
                        if 'error' in res:
                            skipped.append(f"{spec['model']}{suffix} {_kwargs_text(spec['kwargs'])}: {res['error']}")
                            print(f'  skipped {skipped[-1]}', file=sys.stderr)
                            continue
                        rows.append(result_row(res, results, spec, suffix, family=family, size=size,
                                               resolution=resolution))
    if not rows:  # an empty table would replace the last run's
        first = f", the first: {skipped[0]}" if skipped else ''
        raise UsageError(f"no model was measured ({len(skipped)} skipped{first}); {args.out}.md and .csv are "
                         f"unchanged")
    write_outputs(args, rows, skipped, time.time() - started)


def result_row(res: Dict, results: Dict[str, Dict], spec: Dict, suffix: str, **where) -> Dict:
    """One row of the table: a model's measurements and its ratios to the models of the same process, compiled
    against compiled (`suffix` is COMPILED) and eager against eager; `×eager` compares a compiled model with
    itself uncompiled."""
    reference, baseline = results.get(REFERENCE + suffix), results.get(BASELINE + suffix)
    eager = results.get(spec['label']) if suffix else None
    ceilings = eager or res  # a compiled model's products are its eager twin's
    # an attention of one's own runs in softmax's architecture: the row names both
    attn_type = spec.get('kwargs', {}).get('attn_type')
    attn_type = f" (attn_type {attn_type})" if attn_type else ''
    return dict(
        **where, attention=spec['label'], model=spec['model'] + attn_type + suffix, compiled=bool(suffix),
        params_m=res['params_m'], gflops=res['gflops'], infer_img_s=res['infer_img_s'],
        infer_mm_pct=res['infer_mm_pct'], infer_best_pct=res['infer_best_pct'], train_step_ms=res.get('train_step_ms'),
        train_mm_pct=res.get('train_mm_pct'), train_best_pct=res.get('train_best_pct'),
        infer_ceiling_pct=ceilings.get('infer_ceiling_pct'), train_ceiling_pct=ceilings.get('train_ceiling_pct'),
        infer_matmul_gflop_s=res['infer_matmul_gflop_s'], infer_onednn_gflop_s=res.get('infer_onednn_gflop_s'),
        train_matmul_gflop_s=res.get('train_matmul_gflop_s'), train_onednn_gflop_s=res.get('train_onednn_gflop_s'),
        infer_mem_mib=res['infer_mem_mib'], train_mem_mib=res.get('train_mem_mib'),
        infer_vs_timm=_ratio(res, reference, 'infer_img_s'),
        train_vs_timm=_ratio(res, reference, 'train_step_ms', inverse=True),
        infer_vs_softmax=_ratio(res, baseline, 'infer_img_s'),
        train_vs_softmax=_ratio(res, baseline, 'train_step_ms', inverse=True),
        infer_vs_eager=_ratio(res, eager, 'infer_img_s'),
        train_vs_eager=_ratio(res, eager, 'train_step_ms', inverse=True),
    )


def parse_resolutions(items: Sequence[str], families: Sequence[str]) -> Dict[str, List[int]]:
    """['224', '512', 'swin=224,448'] -> {family: resolutions}; numbers apply to families without their own. A
    ValueError names an unknown family, one that `families` leaves out, a family left without a resolution, or a
    value that is not a positive integer."""
    common: List[int] = []
    own: Dict[str, List[int]] = {}
    for item in items:
        if '=' in item:
            family, values = item.split('=', 1)
            if family not in FAMILIES:
                raise ValueError(f'unknown family {family!r}')
            if family not in families:
                raise ValueError(f'{item} is for family {family!r}, which --families leaves out')
            own[family] = [_resolution(v) for v in values.split(',')]
        else:
            common.append(_resolution(item))
    unset = [family for family in families if family not in own and not common]
    if unset:
        raise ValueError(f"no resolution for family {', '.join(map(repr, unset))}")
    return {family: own.get(family, common) for family in families}


def _resolution(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f'resolution {value} is below 1')
    return value


def _kwargs_text(kwargs: Dict) -> str:
    return ', '.join(f'{k}={v}' for k, v in kwargs.items())


def _ratio(res: Dict, base: Optional[Dict], key: str, inverse: bool = False) -> Optional[float]:
    """res / base for a throughput, base / res for a time: above 1 means `res` is faster."""
    if not base or 'error' in base or res.get(key) is None or base.get(key) is None:
        return None
    return base[key] / res[key] if inverse else res[key] / base[key]


def fmt(value: Optional[float], digits: int = 2) -> str:
    return '–' if value is None else f'{value:.{digits}f}'


def target_lines(rows: List[Dict], device: str) -> List[str]:
    """The issue's targets as ratios from this run's rows; a target whose models were not run is left out."""
    def find(family, size, attention, resolution=None):
        found = [r for r in rows if (r['family'], r['size'], r['attention']) == (family, size, attention)
                 and (resolution is None or r['resolution'] == resolution)]
        return sorted(found, key=lambda r: r['resolution'])

    lines = ['| target | measured | goal | met |', '|---|---|---|---|']

    def add(what: str, value: Optional[float], goal: str, met: Optional[bool]) -> None:
        if value is not None:
            lines.append(f"| {what} | {value:.2f}× | {goal} | {'–' if met is None else 'yes' if met else 'no'} |")

    for family, size in TIMM_REFERENCE:
        for r in find(family, size, BASELINE):
            for key, kind in (('infer_vs_timm', 'inference'), ('train_vs_timm', 'training step')):
                add(f"our softmax {family}-{size} / timm `{TIMM_REFERENCE[family, size]}`, {kind} @ {r['resolution']}",
                    r[key], '≥ 0.95×', None if r[key] is None else r[key] >= 0.95)
    for pattern, (what, cuda_goal, other_goal) in SPEEDUP_GOALS.items():
        found = sorted((r for r in rows if fnmatch.fnmatchcase(r['model'], pattern)), key=lambda r: r['resolution'])
        if found:
            r, goal = found[-1], cuda_goal if device == 'cuda' else other_goal
            add(f"{what}, inference @ {r['resolution']}", r['infer_vs_softmax'],
                f'≥ {goal}× ({device})', None if r['infer_vs_softmax'] is None else r['infer_vs_softmax'] >= goal)
    for pattern, (what, goals) in SLOWDOWN_GOALS.items():
        for r in rows:
            if not fnmatch.fnmatchcase(r['model'], pattern):
                continue
            how = 'compiled' if r['compiled'] else 'eager'
            for kind, key, goal in zip(('inference', 'training-step'), ('infer_vs_softmax', 'train_vs_softmax'),
                                       goals.get(device, (None, None))):
                if r[key] and goal is not None:
                    slowdown = 1 / r[key]
                    add(f"{what} {kind} time, {r['family']}-{r['size']} @ {r['resolution']} ({how})", slowdown,
                        f'≤ {goal}× ({device})', slowdown <= goal)
    for family, size, attention in sorted({(r['family'], r['size'], r['attention']) for r in rows}):
        if attention == REFERENCE:
            continue
        series = find(family, size, attention)
        exponents = []
        for key, kind in (('infer_mem_mib', 'inference'), ('train_mem_mib', 'training')):
            points = [(r['resolution'], r[key]) for r in series if r[key]]
            if len(points) >= 2:
                (r0, m0), (r1, m1) = points[-2:]
                exponents.append((kind, r0, r1, math.log(m1 / m0) / math.log((r1 / r0) ** 2)))
        if not exponents:
            continue
        linear = not forms_score_matrix(attention)
        measured = ', '.join(f'{kind} k = {k:.2f} ({r0}→{r1})' for kind, r0, r1, k in exponents)
        met = ('yes' if all(k <= 1.1 for *_, k in exponents) else 'no') if linear else '–'
        lines.append(f"| {attention} {family}-{size}: peak memory ∝ tokens^k between the two largest resolutions "
                     f"| {measured} | {'k ≤ 1.1 (linear)' if linear else '–'} | {met} |")
    return lines if len(lines) > 2 else []


def write_outputs(args: argparse.Namespace, rows: List[Dict], skipped: List[str], seconds: float) -> None:
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(rows[0]) if rows else ['model'])
    writer.writeheader()
    writer.writerows(rows)
    device = torch.device(args.device)  # 'cuda:1' is CUDA too, as the measuring processes take it
    matmul_dtype = 'bfloat16' if device.type == 'cuda' else 'float32'
    if device.type == 'cuda':
        machine = f'cuda ({torch.cuda.get_device_name(device)})'
    else:
        threads = args.threads or torch.get_num_threads()
        machine = f'cpu ({_cpu_name()}), {os.cpu_count()} cores, {threads} thread(s) per process'
    lines = [
        '# Benchmarks', '',
        f'- date: {datetime.date.today().isoformat()}',
        f'- machine: {machine}' + (f' ({args.note})' if args.note else ''),
        f'- versions: torch {torch.__version__}, timm {timm.__version__}, Python {platform.python_version()}',
        f'- command: `python {" ".join(shlex.quote(a) for a in sys.argv)}` ({seconds / 60:.0f} min)',
        f'- batch {args.batch_size}, {args.stat} of {args.iters} inference'
        + (f' and {args.train_iters} training' if args.train else '')
        + f' rounds after {args.warmup} warm-up calls, models of a row group interleaved'
        + (', bfloat16 autocast' if device.type == 'cuda' else ', float32')
        + (', eager and torch.compile(fullgraph=True) rows' if args.compile else '')
        + (', steady allocator (freed memory kept in the process)' if args.steady_malloc else '')
        + (", the models' linear layers, attention products and, in inference, their MLPs' GELU through oneDNN"
           if args.onednn else ''),
        f'- matrix-multiply rate ({args.matmul_size}² product, {matmul_dtype}, median of each process\'s rounds), '
        f'which the `% mm` and `% best` of the same rounds divide by: '
        + '; '.join(_rates_text(rows, mode) for mode in ('infer', 'train')
                    if any(r[f'{mode}_matmul_gflop_s'] for r in rows)),
        f'- load average (1 min) of the machine at the start and end: {args.load_at_start:.1f}, '
        f'{os.getloadavg()[0]:.1f}', '',
        'Ratios are taken between models timed in the same process, above 1 meaning faster: `×timm` against '
        "timm's own model of the same architecture, `×softmax` against our softmax model (compiled rows against "
        'compiled ones), `×eager` against the same model uncompiled (throughput for inference, step time for '
        'training). GFLOPs: one image\'s forward pass (2 per multiply-add). `% mm`: the FLOP rate of inference and '
        'of a training step (forward and backward FLOPs) as a share of `torch.matmul`\'s rate in the same rounds, '
        '`% best` of the faster of `torch.matmul` and oneDNN, median over the rounds. Memory is the peak allocated '
        'above the built model.'
        + (" `ceiling %`: the model's FLOPs over the time of its counted ops (products, convolutions, fused "
           'attention kernels) replayed alone, as a share of the faster rate: what the model would reach if its '
           'other work took no time (a compiled row shows its eager twin\'s).' if args.ceiling else ''), '',
    ]
    columns = [('model', 'model', None), ('res', 'resolution', None), ('params (M)', 'params_m', 1),
               ('GFLOPs', 'gflops', 2)]  # (title, key, digits; None: as it is)
    for mode, rate_title, rate_key, rate_digits in (('infer', 'infer img/s', 'infer_img_s', 2),
                                                    ('train', 'train step ms', 'train_step_ms', 0)):
        columns += [(rate_title, rate_key, rate_digits), (f'{mode} % mm', f'{mode}_mm_pct', 1),
                    (f'{mode} % best', f'{mode}_best_pct', 1)]
        if args.ceiling:
            columns.append((f'{mode} ceiling %', f'{mode}_ceiling_pct', 1))
    ratios = (('MiB', 'mem_mib', 0), ('×timm', 'vs_timm', 2), ('×softmax', 'vs_softmax', 2))
    for title, key, digits in ratios + ((('×eager', 'vs_eager', 2),) if args.compile else ()):
        columns += [(f'{mode} {title}', f'{mode}_{key}', digits) for mode in ('infer', 'train')]
    lines += ['| ' + ' | '.join(title for title, *_ in columns) + ' |', '|---' * len(columns) + '|']
    lines += ['| ' + ' | '.join(str(r[key]) if digits is None else fmt(r[key], digits) for _, key, digits in columns)
              + ' |' for r in rows]
    targets = target_lines([r for r in rows if not r['compiled']], device.type)
    if targets:
        lines += ['', '## Targets', ''] + targets
    if skipped:
        lines += ['', '## Skipped', ''] + [f'- {line}' for line in skipped]
    with files_taken_together():  # a table that fails or is stopped leaves the previous CSV and Markdown
        atomic_write_text(args.out + '.csv', table.getvalue())
        write_table_keeping_notes(args.out + '.md', '\n'.join(lines) + '\n')
    print('\n'.join(lines))


def _rates_text(rows: List[Dict], mode: str) -> str:
    """The matrix-multiply rates measured in the `mode` rounds of the table's rows (rows past
    `--train-max-resolution` have no training rounds)."""
    onednn = [r[f'{mode}_onednn_gflop_s'] for r in rows if r[f'{mode}_onednn_gflop_s']]
    matmul = [r[f'{mode}_matmul_gflop_s'] for r in rows if r[f'{mode}_matmul_gflop_s']]
    return (f"{'inference' if mode == 'infer' else 'training'} rounds `torch.matmul` {_span(matmul)} GFLOP/s"
            + (f', oneDNN {_span(onednn)} GFLOP/s' if onednn else ''))


def _span(values) -> str:
    values = sorted(values)
    if not values:
        return '–'
    return f'{values[0]:.1f}' if values[0] == values[-1] else f'{values[0]:.1f} to {values[-1]:.1f}'


def _cpu_name() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
