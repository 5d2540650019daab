"""The remote worker link's authentication and encryption: ZeroMQ CURVE, keyed by one secret.

Both ends hold the same secret (`SPILLWAY_WORKER_KEY`, or `--worker-key-file PATH`); each
derives the same two CURVE keypairs from it (HKDF-SHA256), so there is nothing to exchange:

    gateway: CURVE server on both of its bound sockets, with the "gateway" keypair
    worker:  CURVE client on both, with the "worker" keypair, trusting the gateway's public key

The gateway's public key is derived from the secret and never sent, in the clear or otherwise,
so a peer without the secret cannot complete the handshake: it sends nothing the gateway
reads and receives nothing the gateway sends. Every message after the handshake is encrypted
and authenticated (CurveZMQ: Curve25519, XSalsa20, Poly1305).

A local worker, over ipc:// in a 0700 folder of the gateway's user, is not keyed: only that
user (who can read the gateway's memory anyway) reaches its sockets, and it pays nothing.
This module imports only pyzmq and the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

MIN_SECRET_BYTES = 16
_SALT = b"spillway worker link v1"


class LinkKeyError(ValueError):
    """A missing, unreadable or too short worker key, or a public address without one."""


@dataclass(slots=True, frozen=True)
class LinkKeys:
    """Both keypairs, Z85-encoded as pyzmq's socket options take them."""

    gateway_public: bytes
    gateway_secret: bytes
    worker_public: bytes
    worker_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> LinkKeys:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise LinkKeyError(f"the worker key is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES} "
                               "(e.g. `openssl rand -hex 32`)")
        prk = hmac.new(_SALT, secret, hashlib.sha256).digest()  # HKDF-extract
        gateway_secret = z85.encode(_expand(prk, b"gateway"))
        worker_secret = z85.encode(_expand(prk, b"worker"))
        return cls(gateway_public=zmq.curve_public(gateway_secret), gateway_secret=gateway_secret,
                   worker_public=zmq.curve_public(worker_secret), worker_secret=worker_secret)

    def secure_gateway_socket(self, sock: zmq.Socket) -> None:
        """Before bind: this socket accepts only peers that know the gateway's public key."""
        sock.curve_server = True
        sock.curve_secretkey = self.gateway_secret
        sock.curve_publickey = self.gateway_public

    def secure_worker_socket(self, sock: zmq.Socket) -> None:
        """Before connect: this socket talks only to the gateway holding the same secret."""
        sock.curve_serverkey = self.gateway_public
        sock.curve_publickey = self.worker_public
        sock.curve_secretkey = self.worker_secret


def _expand(prk: bytes, info: bytes) -> bytes:
    """HKDF-expand to one 32-byte block: a Curve25519 secret key."""
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def read_worker_key(key_file: str | None, env_value: str | None) -> LinkKeys | None:
    """The link's keys from `--worker-key-file` (wins) or `SPILLWAY_WORKER_KEY`; None if neither."""
    if key_file is not None:
        try:
            with open(key_file, "rb") as f:
                secret = f.read()
        except OSError as exc:
            raise LinkKeyError(f"cannot read the worker key file: {exc}") from None
        return LinkKeys.from_secret(secret)
    if env_value:
        return LinkKeys.from_secret(env_value.encode())
    return None


def is_loopback(address: str) -> bool:
    """tcp://HOST:PORT whose HOST only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_key_off_loopback(address: str, keys: LinkKeys | None) -> None:
    """Refuse to serve or join a link that other hosts can reach without a key: anyone reaching
    it would read the prompts and could answer them."""
    if keys is None and not is_loopback(address):
        raise LinkKeyError(f"{address} is reachable from other hosts: give the same secret to both ends as "
                           "SPILLWAY_WORKER_KEY or --worker-key-file PATH (e.g. `openssl rand -hex 32 > key`)")


def connect_sockets(ctx: zmq.Context, inbox: str, outbox: str, keys: LinkKeys | None) -> tuple[zmq.Socket, zmq.Socket]:
    """A worker's (inbox PULL, outbox PUSH), connected to its gateway; CURVE clients with `keys`."""
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    for sock, address in ((out, outbox), (inp, inbox)):
        if keys is not None:
            keys.secure_worker_socket(sock)
        sock.connect(address)
    return inp, out
