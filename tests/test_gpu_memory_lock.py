"""The lock that lets one `gpu_memory` test at a time hold a large share of a GPU (tests/conftest.py's
`_gpu_memory`): held while such a test runs. flock locks belong to an open file, so a second open of the file in
this process is refused the lock while the fixture's open holds it."""

import fcntl

import pytest


def _held(path: str) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


@pytest.mark.gpu_memory
def test_a_gpu_memory_test_holds_the_lock(gpu_memory_lock):
    assert _held(gpu_memory_lock)
