"""Test-wide settings and fixtures."""
import logging
import random
import signal
from pathlib import Path
from typing import Any, Callable, Iterator, Tuple

import numpy as np
import pytest
import torch

from engine.data import prepare_digits

# The tests run many tiny models; on a small machine intra-op threads cost more than they save.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seeded_random_state() -> None:
    """Each test draws the same numbers whether it runs alone or after others, so a failure seen in the suite
    reproduces in a run of that one test."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def engine_logger_restored() -> Iterator[None]:
    """The command lines set up the process-wide 'engine' logger (handlers of their own, no propagation); each
    test leaves it as it found it, so that log capture does not depend on which tests ran before (pytest before
    9.2 captures only what propagates to the root logger)."""
    logger = logging.getLogger('engine')
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    for handler in logger.handlers:
        if handler not in handlers:
            handler.close()
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level


@pytest.fixture(scope='session')
def digits(tmp_path_factory) -> Path:
    """The digits demo's image folder, written once per test process for the tests that train or evaluate on it
    (they only read it)."""
    return Path(prepare_digits(str(tmp_path_factory.getbasetemp() / 'digits')))


@pytest.fixture(scope='session', autouse=True)
def child_temporaries(tmp_path_factory) -> Iterator[None]:
    """The processes the tests start write their temporary files under pytest's base folder, which pytest prunes:
    torchrun leaves a `torchelastic_*` log folder in the temporary directory at every launch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('TMPDIR', str(tmp_path_factory.mktemp('tmp')))
        yield


@pytest.fixture(scope='session', autouse=True)
def single_threaded_children() -> Iterator[None]:
    """The processes the tests start run one intra-op thread, as the tests' own process does: with a worker per
    core, children that each start a thread per core overcommit the machine (a one-epoch train.py took 52 s of CPU
    with two threads against 13 s with one, on two loaded cores). A test that needs another count sets its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('OMP_NUM_THREADS', '1')
        yield


@pytest.fixture(scope='session', autouse=True)
def ctrl_c_delivered() -> Iterator[None]:
    """The tests stop runs with Ctrl-C as a terminal delivers it. A suite started with SIGINT ignored (a background
    job of a shell script) would hand that on to the runs it starts, which keep an ignored signal ignored; for the
    session, SIGINT gets Python's own handler."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def onednn_matmuls(capfd) -> Callable[[Callable[[], Any]], Tuple[Any, int]]:
    """A function that runs fn() and returns its result and the number of matrix products oneDNN ran meanwhile,
    counted in oneDNN's verbose log (written to standard output)."""
    def run(fn: Callable[[], Any]) -> Tuple[Any, int]:
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            result = fn()
        log = capfd.readouterr().out.splitlines()
        return result, sum(line.startswith('onednn_verbose') and ',exec,cpu,matmul,' in line for line in log)
    return run


@pytest.fixture
def onednn_products() -> None:
    """Skip where oneDNN's matrix product cannot run: torch's `mkldnn_matmul` refuses, in float32 too, CPUs without
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, as a CUDA test skips without a GPU. There the zoo keeps the BLAS, which
    `test_onednn.py::test_a_cpu_that_refuses_onednn_products_keeps_the_blas` checks on every CPU."""
    from models.attention import multimax_cpu
    if not multimax_cpu.onednn_products_available():
        pytest.skip("oneDNN's matrix product does not run on this CPU (torch's mkldnn_matmul needs AVX-512 BW, VL "
                    "and DQ or AVX-NE-CONVERT)")
