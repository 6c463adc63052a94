"""Fixtures of the storage tests: a real ``redis-server`` per test."""

from __future__ import annotations

import pytest
from redis_server import RedisServer


@pytest.fixture
def server():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()
