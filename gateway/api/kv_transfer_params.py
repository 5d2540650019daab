"""vLLM's `kv_transfer_params` in a request body: the two-server form of disaggregated prefill and
decode, a prefill server and a decode server (each `spillway serve --kv-transfer-config` with
its role) and a proxy between them that copies the first answer's `kv_transfer_params` into the
second request.

    proxy ── body + {"do_remote_decode": true}, max_tokens 1 ──▶ prefill server (kv_producer, kv_both)
          ◀── its answer + "kv_transfer_params": {"remote_address": <its worker's KV server>,
                                                  "do_remote_prefill": true}
    proxy ── body + {"do_remote_prefill": true, "remote_address": ...} ──▶ decode server (kv_consumer,
             kv_both): its Generates carry kv_source, so its worker pulls the prompt's blocks
             from that KV server before it computes the rest and decodes

A server whose worker has not the role a request asks for refuses it (400), as it refuses any
malformed `kv_transfer_params`; vLLM's other keys (the NIXL connector's block ids and engine
address) are taken and have no effect: here the blocks are found by their hashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spillway.gateway.api.openai import bad_request
from spillway.protocol.messages import Ready

PARAM = "kv_transfer_params"
# vLLM's keys that name the NIXL connector's blocks and peer: the blocks travel by hash here.
IGNORED_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "tp_size")
KEYS = ("do_remote_decode", "do_remote_prefill", "remote_address", *IGNORED_KEYS)
ADDRESS_SCHEMES = ("tcp://", "ipc://")
PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


@dataclass(frozen=True, slots=True)
class KvTransferAsk:
    """What a request's kv_transfer_params ask of this server, checked against its worker."""

    # Prefill for a decode elsewhere: the answer names this worker's KV server (Ready.kv_address).
    answer_address: str | None = None
    # Decode here: pull the prompt's blocks from this KV server first.
    remote_address: str | None = None

    def answer_params(self) -> dict[str, Any] | None:
        """The answer's kv_transfer_params, which the proxy copies into the decode request."""
        if self.answer_address is None:
            return None
        return {"remote_address": self.answer_address, "do_remote_prefill": True}


def kv_transfer_ask(params: dict[str, Any] | None, ready: Ready) -> KvTransferAsk | None:
    """The request's `kv_transfer_params` as an ask of this server's worker (its `ready`); None
    when they ask for no transfer; a 400 naming the field when malformed or when the worker
    has not the role."""
    if params is None:
        return None
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise bad_request(f"{PARAM}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                          f"it takes {', '.join(KEYS)}", param=PARAM)
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = _flag(params, "do_remote_prefill")
    address = params.get("remote_address")
    if remote_decode and remote_prefill:
        raise bad_request(f"{PARAM}: do_remote_decode (prefill here, decode elsewhere) and do_remote_prefill "
                          "(decode here what was prefilled elsewhere) exclude each other", param=PARAM)
    if address is not None and not remote_prefill:
        raise bad_request(f"{PARAM}: remote_address names the prefill server's KV server for a decode; it needs "
                          '"do_remote_prefill": true', param=PARAM)
    if remote_decode:
        return KvTransferAsk(answer_address=_own_address(ready))
    if remote_prefill:
        return KvTransferAsk(remote_address=_remote_address(address, ready))
    return None


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{PARAM}: {key} must be true or false, got {value!r}", param=PARAM)
    return bool(value)


def _own_address(ready: Ready) -> str:
    if ready.kv_role not in PRODUCER_ROLES or not ready.kv_address:
        raise bad_request(f"{PARAM}: do_remote_decode asks this server to prefill for another's decode, and its "
                          f"worker {_role_phrase(ready)}: start it with --kv-transfer-config "
                          '\'{"kv_connector":"HostConnector","kv_role":"kv_producer"}\' (or kv_both)', param=PARAM)
    return ready.kv_address


def _remote_address(address, ready: Ready) -> str:
    if not isinstance(address, str) or not address.startswith(ADDRESS_SCHEMES) \
            or len(address) == len("tcp://") or any(c.isspace() for c in address):
        raise bad_request(f"{PARAM}: do_remote_prefill needs remote_address, the prefill server's KV server as its "
                          f"answer's kv_transfer_params gave it (tcp://HOST:PORT or ipc://PATH), got {address!r}",
                          param=PARAM)
    if ready.kv_role not in CONSUMER_ROLES:
        raise bad_request(f"{PARAM}: do_remote_prefill asks this server to decode what another prefilled, and its "
                          f"worker {_role_phrase(ready)}: start it with --kv-transfer-config "
                          '\'{"kv_connector":"HostConnector","kv_role":"kv_consumer"}\' (or kv_both)', param=PARAM)
    return address


def _role_phrase(ready: Ready) -> str:
    return f"has the role {ready.kv_role}" if ready.kv_role else "has no KV transfer role"
