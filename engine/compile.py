"""`torch.compile` of the whole model (`TRAIN.COMPILE`, `--compile`): one graph per mode and batch shape, no
graph break allowed, compilation time logged once, and a model that does not compile named on one line.

The compiled module only runs the model: checkpoints, the EMA and the optimizer hold the plain module, whose
state-dict keys carry no `_orig_mod.` prefix, so a checkpoint resumes with or without compilation.
"""
import logging
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import UsageError

__all__ = ['compile_model', 'plain_module', 'compile_errors_reported', 'CompileTimer']

logger = logging.getLogger('engine')


def compile_model(model: nn.Module, mode: str = 'default', backend: str = 'inductor') -> nn.Module:
    """`torch.compile(model, fullgraph=True, dynamic=False)`.

    Static shapes: each batch shape gets its own graph, so an evaluation's last, smaller batch costs one more
    compilation (once per mode, reused every epoch) and every full batch runs the graph specialised to it.
    Under DDP, compile the model and wrap the compiled module: DDP's own forward (its logging and hooks) cannot
    be traced into one graph, and since DDP marks itself active around the call, the compiler still splits
    the model's graph at DDP's gradient buckets, so that their all-reduce overlaps the backward pass.
    """
    return torch.compile(model, fullgraph=True, dynamic=False, backend=backend,
                         mode=None if mode == 'default' else mode)


def plain_module(model: nn.Module) -> nn.Module:
    """The model without its DDP and compiled wrappers: the module the EMA follows and checkpoints save."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return getattr(model, '_orig_mod', model)  # what torch.compile wrapped


@contextmanager
def compile_errors_reported(model_name: str) -> Iterator[None]:
    """A model that `torch.compile(fullgraph=True)` cannot trace as one graph fails with one line naming it,
    instead of the compiler's pages of explanation."""
    import torch._dynamo.exc as dynamo_exc
    try:
        yield
    except (dynamo_exc.Unsupported, dynamo_exc.UserError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        why = next((line.split(':', 1)[1].strip() for line in lines if line.startswith('Explanation:')), '')
        reason = f"{lines[0]}: {why}" if why else lines[0]
        raise UsageError(f"model {model_name!r} cannot be compiled as one graph ({reason}); expected a model "
                         f"without graph breaks: run without TRAIN.COMPILE / --compile") from e  # --debug shows why


class CompileTimer:
    """Logs once how long `what` spent compiling: its first call's time minus its second's, a steady call."""

    def __init__(self, what: str, enabled: bool = True):
        self.what, self.enabled = what, enabled
        self.first: Optional[float] = None

    def record(self, seconds: float) -> None:
        """Give the time of each call, in order; after the second, the estimate is logged and recording stops."""
        if not self.enabled:
            return
        if self.first is None:
            self.first = seconds
            return
        self.enabled = False
        logger.info(f"torch.compile: {self.what} compiled in about {max(self.first - seconds, 0.0):.1f} s (first "
                    f"call {self.first:.2f} s, a steady one {seconds:.2f} s)")
