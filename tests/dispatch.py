"""Recording what a call dispatches: every op, and the shapes of the tensors each returns."""
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class DispatchRecorder(TorchDispatchMode):
    """Records the ops run inside it, in order, and the shapes of the tensors they return."""

    def __init__(self):
        super().__init__()
        self.ops: List[torch._ops.OpOverload] = []
        self.output_shapes: List[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        self.output_shapes += [t.shape for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def largest(self, trailing: Optional[Sequence[int]] = None) -> int:
        """Elements of the largest tensor returned (among those whose last dimensions are `trailing`), 0 if none."""
        return max((shape.numel() for shape in self.output_shapes
                    if trailing is None or tuple(shape[-len(trailing):]) == tuple(trailing)), default=0)


def recorded_ops(fn: Callable[..., Any], *args) -> Tuple[Any, List[torch._ops.OpOverload]]:
    """fn(*args) and the ops it ran."""
    with DispatchRecorder() as recorder:
        out = fn(*args)
    return out, recorder.ops
