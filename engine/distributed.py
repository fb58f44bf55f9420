"""Process-group set-up from torchrun's environment and the few collectives the loops need."""
import datetime
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.checkpoint import CheckpointError

from .errors import UsageError

__all__ = ['DistInfo', 'init_distributed', 'cleanup_distributed', 'all_reduce_sum', 'all_gather_objects', 'barrier',
           'any_rank', 'average_batchnorm_statistics', 'main_process_first', 'each_node_first', 'resolve_device',
           'match_gradient_strides']

T = TypeVar('T')


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(device: str = 'auto', backend: str = '', timeout_min: int = 30) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK), or run alone without them.

    `device` 'auto' picks cuda:LOCAL_RANK when CUDA is available, else the CPU; the backend defaults to NCCL on
    CUDA and gloo on the CPU. Multi-node runs need nothing more: torchrun's rendezvous sets the same variables.
    """
    rank, world_size = _env_int('RANK', 0), _env_int('WORLD_SIZE', 1)
    local_rank = _env_int('LOCAL_RANK', 0)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"environment RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}: expected "
                         f"WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0 (torchrun sets them)")
    use_cuda = torch.cuda.is_available() if device == 'auto' else device == 'cuda'
    if use_cuda:
        if not torch.cuda.is_available():
            raise UsageError("DEVICE is 'cuda' but no CUDA device is available; expected DEVICE 'cpu' or 'auto'")
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} CUDA device(s); "
                             f"expected at most one process per device (--nproc_per_node)")
        torch.cuda.set_device(local_rank)
        torch_device = torch.device('cuda', local_rank)
    else:
        torch_device = torch.device('cpu')
    if world_size > 1 and backend == 'nccl' and not use_cuda:
        raise UsageError("DIST.BACKEND is 'nccl', which joins CUDA devices, but this run is on the CPU; expected "
                         "DIST.BACKEND 'gloo' or '' (gloo on the CPU)")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend or ('nccl' if use_cuda else 'gloo'),
            timeout=datetime.timedelta(minutes=timeout_min),
            device_id=torch_device if use_cuda else None,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device)


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' as a device this machine has; a UsageError naming `name` otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ('cpu', 'cuda'):
        raise UsageError(f"device {name!r} is not supported; expected 'cpu', 'cuda' or 'cuda:N'")
    if device.type == 'cuda':
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise UsageError(f"device {name!r}: no CUDA device is available on this machine; expected 'cpu'")
        if device.index is not None and device.index >= count:
            raise UsageError(f"device {name!r}: this machine has {count} CUDA device(s); expected an index below "
                             f"{count}")
    return device


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: List[float], device: torch.device) -> List[float]:
    """Element-wise sums over all processes, in float64 (exact for counts)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every process when `flag` is true on any of them."""
    return all_reduce_sum([float(flag)], device)[0] > 0


def match_gradient_strides(module: nn.Module) -> None:
    """Restride each gradient of `module`'s parameters to its parameter's strides where the two differ only in
    dimensions of size 1: the same memory order, so a view, no copy.

    DistributedDataParallel compares a gradient's strides with its parameter's exactly and otherwise warns at the
    first backward of every process that performance may suffer ("Grad strides do not match bucket view strides").
    A channels-last convolution's weight gradient ([C, 1, 3, 3] depthwise, [C_out, C_in, 1, 1] pointwise) and a class
    token's at one image per process come so, and the autograd engine accepts them as they are. Call before DDP
    wraps the module.
    """
    for param in module.parameters():
        if param.requires_grad:
            param.register_hook(functools.partial(_restride, shape=param.shape, strides=param.stride()))


def _restride(grad: Tensor, shape: torch.Size, strides: Tuple[int, ...]) -> Tensor:
    if grad.stride() == strides or grad.shape != shape or grad.layout != torch.strided or any(
            got != want for size, got, want in zip(shape, grad.stride(), strides) if size != 1):
        return grad
    return grad.as_strided(shape, strides, grad.storage_offset())


def average_batchnorm_statistics(module: nn.Module, info: DistInfo) -> None:
    """Average the BatchNorm running statistics of `module` over all processes, as timm's train.py does before it
    validates (`distribute_bn`, reduce). Each process keeps those of its own batches (DDP hands rank 0's to the
    others only at the next forward), so each validated a different model, none of them the one saved. Unlike
    `distribute_bn` this also averages statistics kept off the process's device (an EMA on the CPU under NCCL)."""
    if not info.distributed:
        return
    for layer in module.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.track_running_stats:
            for statistic in (layer.running_mean, layer.running_var):
                if statistic is not None:
                    total = statistic.to(info.device)
                    dist.all_reduce(total, op=dist.ReduceOp.SUM)
                    statistic.copy_(total / info.world_size)


def main_process_first(info: DistInfo, action: Callable[[], T], what: str, per_node: bool = False) -> Optional[T]:
    """`action()` on the main process while the others wait: its result there, None elsewhere. With `per_node`
    the first process of every node runs it (LOCAL_RANK 0), for what each machine needs on its own disk: a
    download into its cache.

    A `UsageError` or `CheckpointError` it raises stops every process (status 2): those that ran it with that error,
    the others with "another process could not <what>", where they would otherwise wait at their next collective
    until torchrun ended them.
    """
    result, failure = None, None
    if (info.local_rank == 0) if per_node else info.is_main:
        try:
            result = action()
        except (UsageError, CheckpointError) as e:
            failure = e
    if any_rank(failure is not None, info.device):
        raise failure or UsageError(f"another process could not {what}")
    return result


def each_node_first(info: DistInfo, action: Callable[[], T], what: str) -> T:
    """`action()` on every process, the first process of each node first while the others of its node wait: for what
    each machine keeps on its own disk (a download, a cache), which the others then find there. Errors as
    `main_process_first`."""
    result = main_process_first(info, action, what, per_node=True)
    return result if info.local_rank == 0 else action()


def all_gather_objects(obj: Any) -> List[Any]:
    """`obj` from every process, indexed by rank."""
    if not dist.is_initialized():
        return [obj]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
