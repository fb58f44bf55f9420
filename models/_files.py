"""Files written whole or not at all: the training checkpoints, the scripts' tables and the analysis figures go into
a temporary file beside their target, which replaces the target only once complete."""
import errno
import os
import re
import shutil
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, BinaryIO, Callable, Iterator, List, Optional, Pattern, Set, Tuple

__all__ = ['atomic_write', 'files_taken_together', 'temporary_path', 'file_in_the_way', 'named_on_error',
           'process_alive', 'remove_left_by_dead_processes', 'TEMP_NAME', 'UNFINISHED_FILES']

# the names `temporary_path` gives: .<name>.<pid>.<8 hex digits>.tmp
TEMP_NAME = re.compile(r'^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$')
# files this process is writing under temporary names (`atomic_write`), which an exit at once
# (`engine.errors.exit_at_once`) removes
UNFINISHED_FILES: Set[str] = set()


@contextmanager
def named_on_error(path: str) -> Iterator[None]:
    """An OSError raised in the block without a file name (a write, flush or fsync that failed: a full disk) names
    `path`, the file being written, so that its one-line report says where."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from None
        raise


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def temporary_path(path: str) -> str:
    """A name beside `path` for a file this process writes before it takes `path`'s place (or is removed); one
    left by a killed process matches `TEMP_NAME`, whose PID tells who wrote it."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f'.{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp')


# the (temporary file, target) pairs of the outermost `files_taken_together` block running, while one runs
_GROUPS: List[List[Tuple[str, str]]] = []


def atomic_write(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """`write(f)` into a temporary file in the target's folder, fsync, then rename over `path` (inside
    `files_taken_together`, when its block ends).

    A crash or signal at any point leaves either the previous file or the new one, never a partial file. A folder
    of that name is refused before anything is written (inside `files_taken_together`: before any file of the
    block takes its name).
    """
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = temporary_path(os.path.abspath(path))
    group = _GROUPS[-1] if _GROUPS else None
    UNFINISHED_FILES.add(tmp)  # before the file exists, so that no exit at once can miss it
    try:
        with named_on_error(path):
            # opened inside, so that an interruption just after the file appears still removes it
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # permissions from the umask, like open()
            with os.fdopen(fd, 'wb') as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            if group is not None:
                group.append((tmp, path))
                return  # still unfinished: the group's end renames it, or removes it
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        if group is None or (tmp, path) not in group:
            UNFINISHED_FILES.discard(tmp)
    _fsync_folder(folder)


@contextmanager
def files_taken_together() -> Iterator[None]:
    """The files `atomic_write` writes in the block take their names when it ends, together: an error, a crash or a
    signal leaves all the previous files or all the new ones (a table, its Markdown and its figure from one run).
    SIGINT and SIGTERM wait while the names change; an error in the block removes the new files. A block inside
    another joins it: its files take their names with the outer block's."""
    if _GROUPS:
        yield
        return
    group: List[Tuple[str, str]] = []
    _GROUPS.append(group)
    try:
        yield
        with _signals_held():
            for tmp, path in group:
                with named_on_error(path):
                    os.replace(tmp, path)
    finally:
        _GROUPS.pop()
        for tmp, _ in group:  # those not renamed: the block failed, or a rename did
            if os.path.exists(tmp):
                os.remove(tmp)
            UNFINISHED_FILES.discard(tmp)
    for folder in {os.path.dirname(os.path.abspath(path)) for _, path in group}:
        _fsync_folder(folder)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that come during the block are raised after it, to the handlers they had (Python runs
    signal handlers in its main thread, where a thread's signal mask would not help: another thread takes them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: List[int] = []
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    previous = {signum: handler for signum, handler in previous.items() if handler is not None}  # None: set in C
    for signum in previous:
        signal.signal(signum, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)


def file_in_the_way(path: str) -> Optional[str]:
    """The deepest existing part of `path` when it is not a folder (what keeps a folder from being made there), else
    None."""
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path if os.path.lexists(path) and not os.path.isdir(path) else None


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process of another user
    return True


def remove_left_by_dead_processes(folder: str, pattern: Pattern[str], unchanged_s: float = 0.) -> List[str]:
    """Remove the files and folders in `folder` whose names match `pattern`, its first group the PID of the process
    of this host that was writing them, where that process no longer runs: killed outright (SIGKILL, or SIGTERM,
    whose default action runs no clean-up) before it finished. With `unchanged_s`, only those not modified for that
    many seconds: a PID names a process in one PID namespace only, and containers that share a host name and a
    folder (`--network host`) see each other's writers as dead. Return their names, sorted; the others stay."""
    removed = []
    for name in sorted(os.listdir(folder)):
        match = pattern.match(name)
        if not match or process_alive(int(match.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            if unchanged_s and time.time() - os.path.getmtime(path) < unchanged_s:
                continue
        except FileNotFoundError:
            continue  # removed by another process at the same time
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                continue  # removed by another process at the same time
        removed.append(name)
    return removed
