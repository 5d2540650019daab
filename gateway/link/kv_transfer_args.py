"""Disaggregated prefill and decode's arguments, checked once for `spillway serve | worker` and
`LLM`: `--kv-transfer-config` (vLLM's; `LLM(kv_transfer_config=dict|str)`), `--prefill-workers`
and `--decode-workers` (`LLM(prefill_workers=, decode_workers=)`).

    --kv-transfer-config, role given    one worker in that role: vLLM's two-server form. A
                                        kv_producer server prefills for decodes elsewhere (its
                                        answers name its KV server), a kv_consumer server decodes
                                        what another prefilled, a kv_both server does either;
                                        requests say which with kv_transfer_params
    --prefill-workers N                 N producer and M consumer workers behind this server,
      --decode-workers M                each prompt prefilled by a producer and decoded by a
                                        consumer; --kv-transfer-config may come along to choose
                                        the connector and policy (its kv_role then kv_both: the
                                        server gives each worker its role)

Refused, naming the argument: a configuration without kv_role (vLLM's older examples leave it
out), one of the worker counts without the other, either with `--data-parallel-size` > 1 (they
are the server's workers), a kv_port shared by several producers, prefix caching off (the blocks
move through the prefix cache). A problem is a `RefusedArgument` (exit status 2 on the command
line, ValueError for `LLM`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from spillway.gateway.link.engine_args import RefusedArgument
from spillway.protocol.config import setting_name
from spillway.protocol.kv_transfer import KV_ROLES, KvTransferConfig, parse_kv_transfer_config

ROLE_HELP = ("kv_producer (this server prefills, another decodes), kv_consumer (this server decodes what another "
             "prefilled) or kv_both (either, as each request's kv_transfer_params say)")


@dataclass(frozen=True, slots=True)
class KvTransferSettings:
    """The checked arguments: the configuration every worker starts from, and the worker counts
    of disaggregated serving behind this gateway (0 and 0: none)."""

    config: KvTransferConfig | None = None
    prefill_workers: int = 0
    decode_workers: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0


def kv_transfer_settings(kv_transfer_config: str | dict | None = None, prefill_workers: int | None = None,
                         decode_workers: int | None = None, *, data_parallel_size: int = 1,
                         enable_prefix_caching: bool = True, spell: Callable[[str, object], str],
                         settings_spelling: str = "arguments") -> KvTransferSettings:
    """The arguments checked together; RefusedArgument naming the first problem, each argument
    as `spell(name, value)` writes it and the others as `settings_spelling` names them."""
    name = lambda setting: setting_name(setting, settings_spelling)  # noqa: E731
    workers = _worker_counts(prefill_workers, decode_workers, spell, name)
    config = _parse(kv_transfer_config, spell, name) if kv_transfer_config is not None else None
    if config is None and not workers:
        return KvTransferSettings()
    asked = f"{spell('prefill_workers', prefill_workers)} with {spell('decode_workers', decode_workers)}" \
        if workers else spell("kv_transfer_config", kv_transfer_config)
    if data_parallel_size > 1:
        instead = "" if workers else (f"; for several workers of each role use {name('prefill_workers')} and "
                                      f"{name('decode_workers')}")
        raise RefusedArgument(f"{asked} with {spell('data_parallel_size', data_parallel_size)}: not available yet "
                              f"(disaggregated serving places its own workers){instead}")
    if not enable_prefix_caching:
        raise RefusedArgument(f"{asked} needs prefix caching (the KV blocks move through the prefix cache, found by "
                              f"their hashes), which {spell('enable_prefix_caching', False)} turns off")
    if workers:
        _check_disaggregated_config(config, workers[0], spell, name, kv_transfer_config)
        return KvTransferSettings(config, *workers)
    return KvTransferSettings(config)


def _worker_counts(prefill_workers, decode_workers, spell, name) -> tuple[int, int] | None:
    if prefill_workers is None and decode_workers is None:
        return None
    if prefill_workers is None or decode_workers is None:
        given, missing = ("prefill_workers", "decode_workers") if decode_workers is None else \
            ("decode_workers", "prefill_workers")
        value = prefill_workers if given == "prefill_workers" else decode_workers
        raise RefusedArgument(f"{spell(given, value)} needs {name(missing)} too: disaggregated serving runs "
                              "producer workers for prompts and consumer workers for decoding, both")
    for setting, value in (("prefill_workers", prefill_workers), ("decode_workers", decode_workers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RefusedArgument(f"{spell(setting, value)}: must be a positive integer")
    return prefill_workers, decode_workers


def _parse(kv_transfer_config: str | dict, spell, name) -> KvTransferConfig:
    value = kv_transfer_config
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # parse_kv_transfer_config says so
    if isinstance(value, dict) and value.get("kv_role") is None:
        raise RefusedArgument(f"{spell('kv_transfer_config', kv_transfer_config)}: a kv_role is needed: "
                              f"{ROLE_HELP}; or, for prefill and decode workers behind this one server, "
                              f"{name('prefill_workers')} and {name('decode_workers')}")
    try:
        return parse_kv_transfer_config(value if isinstance(value, dict) else kv_transfer_config)
    except ValueError as exc:
        raise RefusedArgument(f"{spell('kv_transfer_config', kv_transfer_config)}: {exc}") from None


def _check_disaggregated_config(config: KvTransferConfig | None, num_prefill: int, spell, name,
                                kv_transfer_config) -> None:
    if config is None:
        return
    if config.kv_role != "kv_both":
        raise RefusedArgument(f"{spell('kv_transfer_config', kv_transfer_config)} with {name('prefill_workers')} "
                              f"and {name('decode_workers')}: this server gives each of its workers its role, so "
                              f"kv_role must be kv_both (the configuration then chooses the connector and the "
                              f"failure policy), not {config.kv_role}; for a server of one role ({', '.join(KV_ROLES)}), "
                              f"leave the worker counts out")
    if config.kv_port is not None and num_prefill > 1:
        raise RefusedArgument(f"{spell('kv_transfer_config', kv_transfer_config)}: one kv_port for "
                              f"{spell('prefill_workers', num_prefill)} producers, which cannot all listen on it; "
                              "leave kv_port out (they listen beside this server's link to them) or run one")
