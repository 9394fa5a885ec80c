"""Fixtures shared by the KServe tests."""

import pytest

from libs.tests.kserve.kserve_fakes import LoopThread


@pytest.fixture(scope="module")
def loop():
    """One event loop thread per test module, hosting the servers under test."""
    thread = LoopThread()
    yield thread
    thread.close()
