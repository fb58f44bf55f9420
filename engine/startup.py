"""What a command does before torch, timm and the models load (the first seconds on two cores): Ctrl-C there ends
it at once, with status 130 and nothing printed. Only the standard library is imported here."""
import contextlib
import os
import signal
import threading
from typing import Iterator

__all__ = ['quit_on_interrupt']


@contextlib.contextmanager
def quit_on_interrupt() -> Iterator[None]:
    """Within the block, SIGINT ends the process at once (status 130): a KeyboardInterrupt raised inside a
    library's import can be caught there, or turned into another error (numpy's imports give a RecursionError), so
    the handler exits rather than raising. SIGINT handled otherwise (ignored in a background job, a handler of the
    caller's) is left as it is, and Python's handler comes back after the block."""
    takes_over = (threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if takes_over:
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))
    try:
        yield
    finally:
        if takes_over:
            signal.signal(signal.SIGINT, signal.default_int_handler)
