"""Disaggregated prefill and decode: the KV transfer settings (vLLM's `--kv-transfer-config`) and
the messages by which one worker pulls another's KV blocks.

A producer (`kv_producer`, or `kv_both`) prefills; its finished request's blocks stay in its
prefix cache, found by their chained hashes (protocol/hashing.py). A consumer (`kv_consumer`,
or `kv_both`) receives a `Generate` whose `kv_source` names the producer's KV server: it holds
the request apart, pulls the prompt's blocks it does not hold yet, in order, by hash, takes the
ones that arrive into its own prefix cache, and then runs the request as any other, its prefix
lookup finding them. So a block can only ever be used for the tokens its hash was computed
from: a late, partial or foreign answer costs recomputation at worst (`kv_load_failure_policy`
"recompute"), or the request's clear error ("fail", vLLM's default), never a wrong answer.

    consumer                                   producer (its KV server: a ROUTER socket)
      KvPull(transfer_id, block_hashes) ──────▶  looks the hashes up in its prefix cache
      ◀────── KvBlocks(transfer_id, the longest run of them it holds, layout) + one payload frame

The payload is the blocks' bytes, one after another, each in the layout the CPU tier keeps
(`[num_layers, kv_sides, block_size, kv_heads, head_dim]`, contiguous): the transfer unit is the
KV block. The consumer checks the model, the layout and the byte count before taking any.

Every connector name vLLM users pass is taken; the blocks travel through host memory over
ZeroMQ whatever the name (the NCCL and NIXL transports are not built), and the worker's log
says so once. This module imports only msgspec, the standard library and the wire's messages.
"""

from __future__ import annotations

import json

import msgspec

from spillway.protocol.messages import WORKER_SILENCE_TIMEOUT_S

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# How long a consumer waits for a pull's answer before `kv_load_failure_policy` applies. A producer
# answers between two of its steps, and beats meanwhile; one that has not answered for as long as
# a gateway waits on a silent worker before it takes it for lost is taken for gone the same way.
KV_PULL_TIMEOUT_S = WORKER_SILENCE_TIMEOUT_S
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")

# vLLM's connector names that move KV between instances, and the transport each names there.
HOST_CONNECTOR = "HostConnector"  # Spillway's own: pinned host blocks over the worker's link
KV_CONNECTORS = {
    HOST_CONNECTOR: "host memory",
    "PyNcclConnector": "NCCL",
    "P2pNcclConnector": "NCCL",
    "NixlConnector": "NIXL",
}


class KvTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`--kv-transfer-config`, checked (`parse_kv_transfer_config`). vLLM's other keys
    (kv_rank, kv_parallel_size, kv_buffer_size, kv_buffer_device, engine_id,
    kv_connector_extra_config) are taken and have no effect here."""

    kv_connector: str
    kv_role: str
    kv_load_failure_policy: str = "fail"
    # Where a producer's KV server listens for consumers on other hosts (tcp://kv_ip:kv_port);
    # None: beside its gateway's link (ipc:// in the gateway's 0700 folder, this host only).
    kv_ip: str | None = None
    kv_port: int | None = None

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transport(self) -> str:
        """The transport vLLM runs under this connector name."""
        return KV_CONNECTORS[self.kv_connector]


# Keys of vLLM's KVTransferConfig that are taken and have no effect here.
_IGNORED_KEYS = ("kv_rank", "kv_parallel_size", "kv_buffer_size", "kv_buffer_device", "engine_id",
                 "kv_connector_extra_config", "enable_permute_local_kv")


def parse_kv_transfer_config(text: str | dict) -> KvTransferConfig:
    """The JSON object of `--kv-transfer-config` (or the dict `LLM(kv_transfer_config=...)`
    takes), checked: ValueError naming the key and what it takes."""
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not JSON ({exc.msg}): {text!r}") from None
    else:
        value = text
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {type(value).__name__}")
    known = {"kv_connector", "kv_role", "kv_load_failure_policy", "kv_ip", "kv_port", "kv_connector_module_path",
             *_IGNORED_KEYS}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(sorted(known))}")
    connector = value.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {connector!r}")
    if value.get("kv_connector_module_path") is not None:
        raise ValueError("kv_connector_module_path is not taken: connectors are built in, "
                         f"one of {', '.join(KV_CONNECTORS)}")
    role = value.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
    policy = value.get("kv_load_failure_policy", "fail")
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, got {policy!r}")
    ip, port = value.get("kv_ip"), value.get("kv_port")
    if ip is not None and (not isinstance(ip, str) or not ip):
        raise ValueError(f"kv_ip must be a host name or address, got {ip!r}")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ValueError(f"kv_port must be a port number (1-65535), got {port!r}")
    return KvTransferConfig(kv_connector=connector, kv_role=role, kv_load_failure_policy=policy, kv_ip=ip,
                            kv_port=port)


# ---- between workers ------------------------------------------------------------------------


class KvPull(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A consumer asks a producer for blocks, by their chained hashes, in prompt order."""

    transfer_id: str  # the consumer's request id: the answer names it
    block_hashes: list[bytes]


class KvBlocks(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A producer's answer; its payload, the frame after it, holds `len(block_hashes)` blocks."""

    transfer_id: str
    # The longest run of the hashes asked, from the first, that the producer holds; empty when none.
    block_hashes: list[bytes]
    model: str  # the producer's model (Ready.model): blocks of another model are refused
    dtype: str  # the KV cache's element type, as torch names it ("bfloat16", "float8_e4m3fn")
    block_shape: list[int]  # one block's shape, the CPU tier's layout
    error: str = ""  # why the producer answered with no blocks (a malformed pull)


KvLinkMessage = KvPull | KvBlocks


def kv_link_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(KvLinkMessage)
