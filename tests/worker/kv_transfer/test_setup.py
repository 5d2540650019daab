"""What a worker's KV role sets up at start: where its KV server listens, the settings it refuses,
the line its log gives, and keyed TCP between workers (CURVE with the worker link's secret)."""

from __future__ import annotations

import logging
import tempfile

import msgspec
import pytest
import zmq
from kv_transfer_pair import BLOCK, generate, run

from spillway.protocol.config import WorkerConfig
from spillway.protocol.kv_transfer import KvPull, KvTransferConfig
from spillway.protocol.local import model_files
from spillway.protocol.local.link_auth import LinkKeyError, LinkKeys
from spillway.worker.driver.engine import Engine
from spillway.worker.gateway_links import GatewayLinks
from spillway.worker.kv_transfer.links import KvLinks
from spillway.worker.kv_transfer.server import KvServer
from spillway.worker.kv_transfer.setup import kv_server_address, start_note
from spillway.worker.main import kv_links

PROMPT = [(13 * i + 50) % 3000 + 100 for i in range(50)]


def kv_config(role: str = "kv_producer", connector: str = "HostConnector", **where) -> KvTransferConfig:
    return KvTransferConfig(kv_connector=connector, kv_role=role, **where)


def test_a_local_producer_listens_beside_its_gateway_link_and_a_named_host_over_tcp():
    assert kv_server_address(kv_config(), "ipc:///tmp/spillway-x1/in") == "ipc:///tmp/spillway-x1/kv"
    assert kv_server_address(kv_config(kv_port=14579), "ipc:///tmp/a/in") == "tcp://127.0.0.1:14579"
    assert kv_server_address(kv_config(kv_ip="10.0.0.5"), "ipc:///tmp/a/in") == "tcp://10.0.0.5:*"
    assert kv_server_address(kv_config(kv_ip="fd00::5", kv_port=9000), "tcp://h:1") == "tcp://[fd00::5]:9000"
    with pytest.raises(ValueError, match="give kv_ip and kv_port"):
        kv_server_address(kv_config(), "tcp://10.0.0.1:5555")


def test_the_log_line_names_the_role_the_server_and_the_transport_that_runs():
    assert start_note(kv_config(), "ipc:///tmp/a/kv") == (
        "KV transfer: kv_producer, its KV server at ipc:///tmp/a/kv; blocks move through host memory over ZeroMQ")
    note = start_note(kv_config("kv_consumer", "NixlConnector"), "")
    assert note == ("KV transfer: kv_consumer, no KV server (it does not produce); blocks move through host memory "
                    "over ZeroMQ (the NixlConnector named runs over NIXL in vLLM; that transport is not built here, "
                    "so host memory is used)")


@pytest.mark.parametrize("settings, message", [
    (dict(enable_prefix_caching=False), "--kv-transfer-config: kv_producer needs prefix caching; turn "
                                        "--enable-prefix-caching on"),
])
def test_settings_a_kv_role_cannot_run_with_are_refused_before_the_model_loads(settings, message):
    config = WorkerConfig(model="/nonexistent/model", device="cpu", settings_spelling="flags",
                          kv_transfer=kv_config(), **settings)
    with pytest.raises(ValueError) as refused:
        Engine(config)
    assert str(refused.value) == message


def test_the_worker_binds_its_server_and_logs_its_role_once(ctx, producer, caplog):
    engine, _ = producer
    with tempfile.TemporaryDirectory(prefix="spillway-kv-") as folder:
        links = GatewayLinks(ctx, [("inproc://kvx-setup-in", "inproc://kvx-setup-out")])
        with caplog.at_level(logging.INFO, logger="spillway.worker"):
            kv = kv_links(ctx, engine, engine.config, f"ipc://{folder}/in", None, links)
        try:
            assert kv.address == f"ipc://{folder}/kv"
            assert engine.ready(kv.address).kv_address == kv.address and engine.ready().kv_role == "kv_producer"
            notes = [record.getMessage() for record in caplog.records if "KV transfer:" in record.getMessage()]
            assert notes == [start_note(engine.config.kv_transfer, kv.address)]
        finally:
            kv.close()


def test_a_server_off_loopback_needs_the_key(ctx):
    with pytest.raises(LinkKeyError, match="reachable from other hosts"):
        KvServer(ctx, "tcp://0.0.0.0:*", None)


def test_over_tcp_a_keyed_server_answers_a_consumer_with_the_secret_and_no_other(ctx, producer, consumer):
    (producer_engine, _), (engine, _) = producer, consumer
    keys = LinkKeys.from_secret(b"a secret of at least sixteen bytes")
    server = KvLinks(ctx, producer_engine, "tcp://127.0.0.1:*", keys)
    pulls = KvLinks(ctx, engine, None, keys)
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    try:
        assert server.address.startswith("tcp://127.0.0.1:")
        assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
        run(producer_engine, generate(producer_engine, "prefill", PROMPT, 1))
        deltas = run(engine, generate(engine, "decode", PROMPT, 2, server.address), pulls, server)
        assert deltas[0].num_cached_tokens == (len(PROMPT) - 1) // BLOCK * BLOCK
        stranger.connect(server.address)  # no CURVE: its handshake never completes
        stranger.send(msgspec.msgpack.encode(KvPull(transfer_id="stranger", block_hashes=[])))
        assert not server.handle(300)
    finally:
        stranger.close(linger=0)
        pulls.close()
        server.close()
