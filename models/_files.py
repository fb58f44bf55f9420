"""Files written whole or not at all: the training checkpoints, the scripts' tables and the analysis figures go into
a temporary file beside their target, which replaces the target only once complete."""
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from typing import Any, BinaryIO, Callable, Iterator, List, Optional, Pattern, Set

__all__ = ['atomic_write', 'temporary_path', 'removed_by_an_exit_at_once', 'file_in_the_way', 'named_on_error',
           'process_alive', 'remove_left_by_dead_processes', 'TEMP_NAME', 'UNFINISHED_FILES']

# the names `temporary_path` gives: .<name>.<pid>.<8 hex digits>.tmp
TEMP_NAME = re.compile(r'^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$')
# files this process is writing under temporary names, which an exit at once (`engine.errors.exit_at_once`) removes
UNFINISHED_FILES: Set[str] = set()


@contextmanager
def removed_by_an_exit_at_once(path: str) -> Iterator[None]:
    """While the block runs, an exit at once removes `path`: a file written under a temporary name, which no
    `finally` would remove after `os._exit`."""
    UNFINISHED_FILES.add(path)  # before the file exists, so that no exit at once can miss it
    try:
        yield
    finally:
        UNFINISHED_FILES.discard(path)


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


def atomic_write(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """`write(f)` into a temporary file in the target's folder, fsync, then rename over `path`.

    A crash or signal at any point leaves either the previous file or the new one, never a partial file.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = temporary_path(os.path.abspath(path))
    with removed_by_an_exit_at_once(tmp), named_on_error(path):
        try:  # opened inside, so that an interruption just after the file appears still removes it
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # permissions from the umask, like open()
            with os.fdopen(fd, 'wb') as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    _fsync_folder(folder)


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


def remove_left_by_dead_processes(folder: str, pattern: Pattern[str]) -> List[str]:
    """Remove the files and folders in `folder` whose names match `pattern`, its first group the PID of the process
    of this host that was writing them, where that process no longer runs: killed outright (SIGKILL, or SIGTERM,
    whose default action runs no clean-up) before it finished. Return their names, sorted; those of live
    processes stay."""
    removed = []
    for name in sorted(os.listdir(folder)):
        match = pattern.match(name)
        if not match or process_alive(int(match.group(1))):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                continue  # removed by another process at the same time
        removed.append(name)
    return removed
