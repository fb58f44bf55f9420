"""Bad input and a diverged training run are reported on one line with exit status 2; `--debug` shows the
traceback instead."""
import os
import sys
from typing import Callable, Optional, Sequence

from models._checkpoint import CheckpointError

__all__ = ['UsageError', 'NonFiniteLossError', 'USAGE_EXIT_CODE', 'run_cli']

USAGE_EXIT_CODE = 2


class UsageError(ValueError):
    """Input the user can fix: a bad config, model name, data folder or checkpoint."""


class NonFiniteLossError(FloatingPointError):
    """The training loss stayed non-finite for more updates than `TRAIN.MAX_NONFINITE_STEPS` allows."""


def run_cli(main: Callable[[Sequence[str]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run `main(argv)`; a `UsageError`, `CheckpointError` or `NonFiniteLossError` becomes `error: <message>` on
    stderr and exit status 2.

    With `--debug` in `argv` the exception propagates with its traceback. Only rank 0 prints, since every rank
    meets the same bad input and all ranks agree on a non-finite loss.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return main(argv)
    except (UsageError, CheckpointError, NonFiniteLossError) as e:
        if '--debug' in argv:
            raise
        if os.environ.get('RANK', '0') == '0':
            print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
