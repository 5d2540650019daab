"""The link's keys: derived alike on both ends, refused when short or missing off loopback,
and a CURVE handshake that only the holder of the same secret completes."""

from __future__ import annotations

import pytest
import zmq

from spillway.gateway.link.worker_process import describe_exit
from spillway.protocol.local.link_auth import (
    LinkKeyError,
    LinkKeys,
    is_loopback,
    read_worker_key,
    require_key_off_loopback,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def test_both_ends_derive_the_same_distinct_keypairs():
    one, two = LinkKeys.from_secret(SECRET), LinkKeys.from_secret(SECRET + b"\n")  # a key file's newline
    assert one == two
    assert len({one.gateway_public, one.gateway_secret, one.worker_public, one.worker_secret}) == 4
    assert one.gateway_public == zmq.curve_public(one.gateway_secret) and len(one.gateway_public) == 40
    assert LinkKeys.from_secret(SECRET[:-1] + b"0").gateway_public != one.gateway_public


def test_a_short_secret_is_refused():
    with pytest.raises(LinkKeyError, match="the worker key is 15 bytes; it needs at least 16"):
        LinkKeys.from_secret(b"x" * 15)


def test_the_key_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(SECRET + b"\n")
    assert read_worker_key(str(path), "another secret, long enough") == LinkKeys.from_secret(SECRET)
    assert read_worker_key(None, SECRET.decode()) == LinkKeys.from_secret(SECRET)
    assert read_worker_key(None, None) is None
    with pytest.raises(LinkKeyError, match="cannot read the worker key file"):
        read_worker_key(str(tmp_path / "missing"), None)


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.4.5:5555", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://0.0.0.0:5555", False), ("tcp://10.1.2.3:5555", False),
    ("tcp://[::]:5555", False), ("tcp://gateway.example:5555", False),
])
def test_only_loopback_addresses_go_without_a_key(address, loopback):
    assert is_loopback(address) is loopback
    require_key_off_loopback(address, LinkKeys.from_secret(SECRET))
    if loopback:
        require_key_off_loopback(address, None)
    else:
        with pytest.raises(LinkKeyError, match="reachable from other hosts"):
            require_key_off_loopback(address, None)


def _pair(ctx: zmq.Context, worker_secret: bytes | None) -> tuple[zmq.Socket, zmq.Socket]:
    server = ctx.socket(zmq.PUSH)
    server.setsockopt(zmq.LINGER, 0)
    LinkKeys.from_secret(SECRET).secure_gateway_socket(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.PULL)
    client.setsockopt(zmq.LINGER, 0)
    if worker_secret is not None:
        LinkKeys.from_secret(worker_secret).secure_worker_socket(client)
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


@pytest.mark.parametrize("worker_secret, delivered", [
    (SECRET, True), (b"not the secret but long enough", False), (None, False),
])
def test_only_the_same_secret_completes_the_handshake(worker_secret, delivered):
    ctx = zmq.Context()
    try:
        server, client = _pair(ctx, worker_secret)
        if server.poll(2000, zmq.POLLOUT):  # a peer has completed the handshake
            server.send(b"a prompt")
        assert bool(client.poll(1000)) is delivered
        if delivered:
            assert client.recv() == b"a prompt"
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("code, text", [
    (0, "exited with code 0"), (1, "exited with code 1"), (-9, "was killed by SIGKILL"),
    (-11, "was killed by SIGSEGV"), (None, "ended (its exit status is not known yet)"),
])
def test_an_exit_is_described_by_its_code_or_signal(code, text):
    assert describe_exit(code) == text
