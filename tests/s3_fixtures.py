"""The S3 fixtures as a pytest plugin: ``pytest_plugins = ["s3_fixtures"]`` in a test module.

One moto_server for the whole run (whichever module asks first), and an empty bucket of each test's own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from remote_fixtures import Bucket, FaultyProxy, MotoServer, use_endpoint

from jitwarm.cache import reset_remote_health
from jitwarm.cache.remote import s3


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """The S3 endpoint the tests share: $JITWARM_TEST_S3_URL, else a moto_server of our own for the session."""
    url = os.environ.get("JITWARM_TEST_S3_URL")
    if url:
        yield url
        return
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    yield server.url
    server.stop()


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """An empty bucket of this test's own; boto3 (in this process and in the nodes) points at the endpoint."""
    use_endpoint(monkeypatch, s3_endpoint)
    reset_remote_health()
    yield Bucket(s3_endpoint)
    reset_remote_health()


def faulty_store(bucket: Bucket, monkeypatch, only: str) -> Iterator[FaultyProxy]:
    """Body of a fixture: a proxy in front of the store breaking requests under ``only``, with short timeouts."""
    proxy = FaultyProxy(bucket.endpoint, only=only)
    reset_remote_health()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr(s3, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(s3, "MAX_ATTEMPTS", 2)
    yield proxy
    proxy.stop()
