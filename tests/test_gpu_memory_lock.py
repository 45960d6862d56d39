"""The lock that lets one `gpu_memory` test at a time hold a large share of a GPU (tests/conftest.py's
`_gpu_memory`, whose file this names again): held while such a test runs. flock locks belong to an open file, so
a second open of the file in this process is refused the lock while the fixture's open holds it."""

import fcntl
import os
import tempfile

import pytest

LOCK = os.path.join(tempfile.gettempdir(), f"mtpfactory-gpu-memory-{os.getuid()}.lock")


def _held() -> bool:
    with open(LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


@pytest.mark.gpu_memory
def test_a_gpu_memory_test_holds_the_lock():
    assert _held()
