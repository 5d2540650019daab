"""The port helpers of the server tests hold their ports against everyone but the server."""

from __future__ import annotations

import errno
import socket

import pytest
import zmq

from ports import HOST, listening_socket, reserve_ports


def test_reserved_ports_are_consecutive_and_refused_to_a_plain_bind():
    with reserve_ports(2) as (port, next_port):
        assert next_port == port + 1
        for reserved in (port, next_port):
            with socket.socket() as other, pytest.raises(OSError) as refused:
                other.bind((HOST, reserved))
            assert refused.value.errno == errno.EADDRINUSE


def test_a_zeromq_listener_binds_reserved_ports_and_is_reached():
    ctx = zmq.Context()
    with reserve_ports(2) as (port, next_port):
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(f"tcp://{HOST}:{port}")
        pull.bind(f"tcp://{HOST}:{next_port}")
        peer = ctx.socket(zmq.PULL)
        peer.connect(f"tcp://{HOST}:{port}")
        push.send(b"over the reserved port")
        assert peer.poll(5000) and peer.recv() == b"over the reserved port"
        for sock in (push, pull, peer):
            sock.close(linger=0)
    ctx.term()


def test_a_listening_socket_is_bound_and_accepts():
    with listening_socket() as server, socket.create_connection(server.getsockname(), timeout=5):
        accepted, _ = server.accept()
        accepted.close()
