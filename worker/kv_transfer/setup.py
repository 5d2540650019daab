"""What a worker's KV role sets up at start: where its KV server listens, and the one line its
log gives about it."""

from __future__ import annotations

import os

from spillway.protocol.kv_transfer import HOST_CONNECTOR, KvTransferConfig

# Where vLLM's KV connectors listen when no host is named (its KVTransferConfig's kv_ip).
DEFAULT_KV_IP = "127.0.0.1"


def kv_server_address(kv: KvTransferConfig, inbox: str) -> str:
    """The address a producer's KV server binds: `tcp://kv_ip:kv_port` when either is set (the
    loopback address without kv_ip, a port the system picks without kv_port), else `kv` beside
    its gateway link's ipc:// socket, in the gateway's 0700 folder (this host's consumers, this
    user's only). ValueError for a link that is not ipc:// without them."""
    if kv.kv_ip is not None or kv.kv_port is not None:
        host = kv.kv_ip or DEFAULT_KV_IP
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6
        return f"tcp://{host}:{kv.kv_port or '*'}"
    if not inbox.startswith("ipc://"):
        raise ValueError(f"a KV producer linked to its gateway at {inbox} serves its blocks over TCP: give "
                         "kv_ip and kv_port in the KV transfer config")
    return f"ipc://{os.path.dirname(inbox.removeprefix('ipc://'))}/kv"


def start_note(kv: KvTransferConfig, server_address: str) -> str:
    """The worker's INFO line about its KV role: the role, its server, the transport that runs."""
    server = f"its KV server at {server_address}" if server_address else "no KV server (it does not produce)"
    note = f"KV transfer: {kv.kv_role}, {server}; blocks move through host memory over ZeroMQ"
    if kv.kv_connector != HOST_CONNECTOR:
        note += (f" (the {kv.kv_connector} named runs over {kv.transport} in vLLM; that transport is not built "
                 "here, so host memory is used)")
    return note
