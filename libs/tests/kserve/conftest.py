"""Fixtures shared by the KServe tests."""

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from libs.tests.kserve.kserve_fakes import LoopThread


@pytest.fixture(scope="module")
def loop():
    """One event loop thread per test module, hosting the servers under test."""
    thread = LoopThread()
    yield thread
    thread.close()


# Clients of the module's `server` fixture (each test module that uses them defines one).
@pytest.fixture(scope="module")
def gc(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


@pytest.fixture(scope="module")
def hc(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield client
    client.close()
