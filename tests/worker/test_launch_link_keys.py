"""A worker started with a launch on its stdin keys its link as `spillway worker --connect` does
when the link is tcp:// (a Ray replica's actor started it on a node of the cluster): by
SPILLWAY_WORKER_KEY, refused off loopback without one; an ipc:// link never, whatever the
environment holds."""

from __future__ import annotations

import pytest

from spillway.protocol.local.link_auth import LinkKeyError, LinkKeys
from spillway.worker.main import link_keys

SECRET = "a secret of at least sixteen bytes"


def test_a_tcp_link_takes_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPILLWAY_WORKER_KEY", SECRET)
    assert link_keys("tcp://192.0.2.7:6100") == LinkKeys.from_secret(SECRET.encode())


def test_a_tcp_link_off_loopback_without_a_key_is_refused(monkeypatch):
    monkeypatch.delenv("SPILLWAY_WORKER_KEY", raising=False)
    with pytest.raises(LinkKeyError, match="SPILLWAY_WORKER_KEY"):
        link_keys("tcp://192.0.2.7:6100")
    assert link_keys("tcp://127.0.0.1:6100") is None


def test_an_ipc_link_is_never_keyed(monkeypatch):
    monkeypatch.setenv("SPILLWAY_WORKER_KEY", SECRET)
    assert link_keys("ipc:///tmp/spillway-x/in") is None
