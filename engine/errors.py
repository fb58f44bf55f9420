"""Bad input and a diverged training run are reported on one line with exit status 2, an interruption on one
line with status 128 + the signal's number, a collective that failed because another process of the run ended on
one line with status 1; `--debug` shows the traceback instead (except for `exit_at_once`)."""
import argparse
import contextlib
import errno
import os
import re
import signal
import sys
import threading
from typing import Callable, Iterator, Mapping, NoReturn, Optional, Sequence, Tuple

import torch.distributed

from models._files import UNFINISHED_FILES
from models.attention.mixer import MixerContractError
from models.checkpoint import CheckpointError

__all__ = ['UsageError', 'BadImageError', 'NonFiniteLossError', 'Stopped', 'USAGE_EXIT_CODE', 'run_cli',
           'error_line', 'exit_at_once', 'refuse_below', 'exit_for_missing_extra', 'terminate_as_interrupt']

USAGE_EXIT_CODE = 2


class UsageError(ValueError):
    """Input the user can fix: a bad config, model name, data folder or checkpoint."""


class BadImageError(UsageError):
    """An image that could not be read during a pass over the data. Only the process that read it knows, so that
    process reports it, whatever its rank."""


class NonFiniteLossError(FloatingPointError):
    """The training loss stayed non-finite for more updates than `TRAIN.MAX_NONFINITE_STEPS` allows."""


class Stopped(KeyboardInterrupt):
    """A SIGTERM / SIGINT stopped training after it saved: the exit status still says the run did not finish."""

    def __init__(self, signum: int, checkpoint: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} after saving {checkpoint}; run the same command "
                         f"again to resume")
        self.signum = signum


class _Terminated(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM unwinds as Ctrl-C does (exit status 143 through `run_cli`), so that
    `subprocess.run` ends the child process it waits for and temporary folders are removed: by default SIGTERM
    ends only this process, and a measuring child or a `train.py` run went on alone. Outside the main thread,
    where no handler can be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_for_missing_extra(error: ModuleNotFoundError, extra: str) -> NoReturn:
    """Exit (status 2) with one line naming the module a script imported and did not find, and the optional
    dependencies of the project (`extra`) that install it: the scripts call it before any work."""
    print(f"error: {error.name} is not installed; expected the {extra!r} extra: pip install "
          f"'swappable-attention-zoo[{extra}]' (pip install -e '.[{extra}]' in a clone)", file=sys.stderr)
    raise SystemExit(USAGE_EXIT_CODE)


def exit_at_once(signum: int, message: str) -> NoReturn:
    """End the process now with status 128 + `signum`, after `error: <message>` from the reporting rank.

    For a second signal: an exception raised from a signal handler can land in a clean-up (a DataLoader's
    `__del__`, where Python prints and ignores it) or chain onto the first stop's, while an exit at once cannot.
    Nothing half-written stays: checkpoints are replaced atomically, the temporary file of a write in progress is
    removed first (`models._files.UNFINISHED_FILES`), and the next run takes over the lock of a process
    that ended.
    """
    for path in list(UNFINISHED_FILES):
        try:
            os.remove(path)
        except OSError:
            pass  # renamed already, or never created
    if _reports():
        os.write(sys.stderr.fileno(), f"\nerror: {message}\n".encode())  # a handler must not re-enter buffered io
    os._exit(128 + signum)


# reported on one line with exit status 2
_REPORTED = (UsageError, CheckpointError, MixerContractError, NonFiniteLossError)


def run_cli(main: Callable[[Sequence[str]], int], argv: Optional[Sequence[str]] = None, *,
            terminate_unwinds: bool = False) -> int:
    """Run `main(argv)`; a `UsageError`, `CheckpointError`, `MixerContractError` (an attention of one's own) or
    `NonFiniteLossError` becomes `error: <message>` on stderr and exit status 2. With `terminate_unwinds` (the
    scripts, which have no signal handling of their own) SIGTERM is reported and cleaned up after as Ctrl-C is
    (`terminate_as_interrupt`).

    With `--debug` in `argv` the exception propagates with its traceback. Only rank 0 prints, since every rank
    meets the same bad input and all ranks agree on a non-finite loss. An interruption (Ctrl-C outside the
    training loop, or a signal that stopped training after saving) exits with 128 + the signal's number, as a shell
    reports it, so `train.py ... && eval.py ...` does not go on after a stopped run; so does a second signal,
    through `exit_at_once`. Under torchrun, a collective that fails because another process ended (after its own
    one-line error) or stopped answering exits with status 1, rank 0 saying so on one line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with terminate_as_interrupt() if terminate_unwinds else contextlib.nullcontext():
            code = main(argv)
        sys.stdout.flush()  # here, where a reader that stopped reading is caught below
        return code
    except _REPORTED as e:
        if '--debug' in argv:
            raise
        if _reports() or isinstance(e, BadImageError):
            print(error_line(e), file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt as e:
        if '--debug' in argv:
            raise
        signum = getattr(e, 'signum', signal.SIGINT)
        if _reports():
            print(f"error: {str(e) or f'interrupted by {signal.Signals(signum).name}'}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # the reader of the output stopped reading (`| head`): end quietly, as a process that SIGPIPE ends, with
        # the standard output pointed at nothing, or the interpreter's last flush would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as e:
        if '--debug' in argv or e.errno not in _STORAGE_PROBLEMS:
            raise
        if _reports():
            target = 'to the standard output or error' if e.filename is None else repr(e.filename)
            print(f"error: cannot write {target} ({e.strerror}); expected {_STORAGE_PROBLEMS[e.errno]}",
                  file=sys.stderr)
        return USAGE_EXIT_CODE
    except RuntimeError as e:
        if '--debug' in argv or not _peer_gone(e):
            raise
        if _reports():
            print(error_line(e), file=sys.stderr)
        return 1


def error_line(error: Exception) -> str:
    """The line that reports `error`: `run_cli`'s for bad input, a diverged run or a collective failed by another
    process; for any other error (a traceback on the console), its type and first sentence."""
    if isinstance(error, _REPORTED):
        return f"error: {error}"
    if isinstance(error, RuntimeError) and _peer_gone(error):
        return (f"error: a collective with the other processes failed ({_first_sentence(error)}): another process "
                f"ended or stopped answering; its own output says why")
    return f"error: {type(error).__name__}: {_first_sentence(error)}"


def refuse_below(parser: argparse.ArgumentParser, minimums: Mapping[str, Tuple[Optional[float], float]]) -> None:
    """`parser.error` (one line, exit status 2) for the first flag whose value is below its least, as
    `{'--iters': (args.iters, 1)}` gives them: "--iters 0: expected 1 or more". A value of None (an optional flag
    not given) passes."""
    for flag, (value, least) in minimums.items():
        if value is not None and value < least:
            parser.error(f'{flag} {value}: expected {least} or more')


# Writes that fail for a reason the user sets right outside the program, and what they need instead.
_STORAGE_PROBLEMS = {errno.ENOSPC: 'free space on its disk', errno.EDQUOT: 'room in the disk quota',
                     errno.EROFS: 'a disk that is not read-only', errno.EACCES: 'a folder this user can write',
                     errno.EPERM: 'a folder this user can write', errno.EISDIR: 'a file name that no folder has'}
# What gloo says when the process at the other end of a collective has gone (exited, killed) or hangs.
_GLOO_PEER_GONE = ('Connection reset by peer', 'Connection closed by peer', 'Broken pipe', 'Timed out waiting')


def _peer_gone(error: RuntimeError) -> bool:
    """Whether `error` is a collective that failed in a run of several processes: another process ended (after its
    own error, which it reports) or stopped answering, so a traceback here would only bury that report."""
    try:
        several = int(os.environ.get('WORLD_SIZE', '1')) > 1
    except ValueError:
        return False
    backend_error = getattr(torch.distributed, 'DistBackendError', ())
    return several and (isinstance(error, backend_error) or any(words in str(error) for words in _GLOO_PEER_GONE))


def _first_sentence(error: Exception) -> str:
    """The first sentence of `error`'s message, without the source location gloo starts it with."""
    text = re.sub(r'^\[[^\]]*\]\s*', '', (str(error).splitlines() or [''])[0])
    return text.split('. ', 1)[0].rstrip('.') or type(error).__name__


def _reports() -> bool:
    """Rank 0 reports; so does any process whose RANK / WORLD_SIZE make no valid rank, which no rank 0 would report."""
    try:
        rank, world_size = int(os.environ.get('RANK', '0')), int(os.environ.get('WORLD_SIZE', '1'))
    except ValueError:
        return True
    return rank == 0 or not 0 <= rank < world_size
