"""Disaggregated prefill and decode's arguments: `--kv-transfer-config`, `--prefill-workers`,
`--decode-workers` on `spillway serve` (and the first on `spillway worker`), and `LLM`'s
kv_transfer_config, prefill_workers, decode_workers. Honoured ones reach the settings (and the
workers' configurations through the placement); refused ones exit with status 2 naming the flag,
or raise ValueError naming the argument, before any worker starts."""

from __future__ import annotations

import pytest

from spillway import LLM
from spillway.gateway.cli.main import _server_settings, build_parser, main, refusals
from spillway.gateway.replicas.placement import place_prefill_decode
from spillway.protocol.config import WorkerConfig
from spillway.protocol.kv_transfer import KvTransferConfig

ARTICLE = '{"kv_connector":"PyNcclConnector"}'  # the command vLLM's older articles give: no role
PRODUCER = '{"kv_connector":"PyNcclConnector","kv_role":"kv_producer"}'
BOTH = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute"}'


def settings_of(*flags: str):
    args = build_parser().parse_args(["serve", "--load-format", "dummy", *flags])
    assert refusals(args) == []
    return _server_settings(args)


def test_the_articles_command_with_a_role_gives_the_worker_its_role():
    settings = settings_of("--kv-transfer-config", PRODUCER)
    assert settings.worker.kv_transfer == KvTransferConfig(kv_connector="PyNcclConnector", kv_role="kv_producer")
    assert (settings.prefill_workers, settings.decode_workers, settings.num_engines) == (0, 0, 1)


def test_prefill_and_decode_workers_reach_the_settings_with_the_connector_chosen():
    settings = settings_of("--prefill-workers", "2", "--decode-workers", "3", "--kv-transfer-config", BOTH)
    assert (settings.prefill_workers, settings.decode_workers, settings.num_engines) == (2, 3, 5)
    assert settings.worker.kv_transfer.kv_load_failure_policy == "recompute"
    plain = settings_of("--prefill-workers", "1", "--decode-workers", "1")
    assert plain.worker.kv_transfer is None and plain.num_engines == 2


def test_the_workers_are_placed_producers_first_each_in_its_role():
    config = WorkerConfig(model="m", kv_transfer=KvTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                                                                  kv_load_failure_policy="recompute"))
    placement = place_prefill_decode(config, 2, 1, gpus=[], num_cores=6)
    assert [launch.name for launch in placement.launches] == ["prefill 0", "prefill 1", "decode 0"]
    assert [launch.config.kv_transfer.kv_role for launch in placement.launches] == \
        ["kv_producer", "kv_producer", "kv_consumer"]
    assert {launch.config.kv_transfer.kv_connector for launch in placement.launches} == {"NixlConnector"}
    assert {launch.config.kv_transfer.kv_load_failure_policy for launch in placement.launches} == {"recompute"}
    assert [launch.config.kv_events for launch in placement.launches] == [True, True, False]
    assert [launch.env for launch in placement.launches] == [{"OMP_NUM_THREADS": "2"}] * 3
    assert placement.describe == "2 prefill and 1 decode workers on the CPU, 2 threads each"
    default = place_prefill_decode(WorkerConfig(model="m"), 1, 1, gpus=[], num_cores=2)
    assert {launch.config.kv_transfer.kv_connector for launch in default.launches} == {"HostConnector"}


def test_on_one_gpu_the_workers_share_it_one_after_another_and_on_enough_gpus_each_has_its_own():
    shared = place_prefill_decode(WorkerConfig(model="m", gpu_memory_utilization=0.8), 1, 1, gpus=["0"])
    assert shared.sequential and [launch.env for launch in shared.launches] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2
    assert [launch.config.gpu_memory_utilization for launch in shared.launches] == [0.4, 0.8]
    apart = place_prefill_decode(WorkerConfig(model="m"), 1, 1, gpus=["0", "1"])
    assert not apart.sequential
    assert [launch.env["CUDA_VISIBLE_DEVICES"] for launch in apart.launches] == ["0", "1"]


REFUSED = [
    (["--kv-transfer-config", ARTICLE],
     ["--kv-transfer-config '" + ARTICLE + "': a kv_role is needed: kv_producer", "kv_consumer", "kv_both",
      "--prefill-workers and --decode-workers"]),
    (["--kv-transfer-config", "{not json"], ["--kv-transfer-config '{not json': is not JSON"]),
    (["--kv-transfer-config", '{"kv_connector":"X","kv_role":"kv_both"}'], ["kv_connector must be one of"]),
    (["--kv-transfer-config", '{"kv_connector":"HostConnector","kv_role":"decoder"}'],
     ["kv_role must be one of kv_producer, kv_consumer, kv_both"]),
    (["--prefill-workers", "1"], ["--prefill-workers 1 needs --decode-workers too"]),
    (["--decode-workers", "2"], ["--decode-workers 2 needs --prefill-workers too"]),
    (["--prefill-workers", "0", "--decode-workers", "1"], ["--prefill-workers"]),  # argparse's own
    (["--prefill-workers", "1", "--decode-workers", "1", "-dp", "2"],
     ["--prefill-workers 1 with --decode-workers 1 with --data-parallel-size 2: not available yet"]),
    (["--kv-transfer-config", PRODUCER, "-dp", "2"],
     ["with --data-parallel-size 2: not available yet", "use --prefill-workers and --decode-workers"]),
    (["--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer-config", PRODUCER],
     ["kv_role must be kv_both", "not kv_producer"]),
    (["--prefill-workers", "2", "--decode-workers", "1", "--kv-transfer-config",
      '{"kv_connector":"HostConnector","kv_role":"kv_both","kv_port":14579}'], ["one kv_port for --prefill-workers 2"]),
    (["--prefill-workers", "1", "--decode-workers", "1", "--no-enable-prefix-caching"],
     ["needs prefix caching", "--no-enable-prefix-caching"]),
    (["--prefill-workers", "1", "--decode-workers", "1", "--api-server-count", "2"],
     ["--prefill-workers 1 with --decode-workers 1 and --api-server-count: not available yet"]),
    (["--prefill-workers", "1", "--decode-workers", "1", "--worker-address", "tcp://127.0.0.1:5999"],
     ["and --worker-address: not available yet"]),
    (["--kv-transfer-config", PRODUCER, "--worker-address", "tcp://127.0.0.1:5999"],
     ["give --kv-transfer-config to `spillway worker`"]),
]


@pytest.mark.parametrize("flags, messages", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_refused_combinations_exit_2_with_a_message_naming_the_flag(capsys, flags, messages):
    try:
        code = main(["serve", *flags])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    for message in messages:
        assert message in err, err


def test_a_worker_takes_its_role_but_not_the_worker_counts(capsys):
    args = build_parser().parse_args(["worker", "--load-format", "dummy", "--connect", "tcp://127.0.0.1:5999",
                                      "--kv-transfer-config", PRODUCER])
    assert refusals(args) == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--connect", "tcp://127.0.0.1:5999", "--prefill-workers", "1"])
    assert main(["worker", "--connect", "tcp://127.0.0.1:5999", "--kv-transfer-config", ARTICLE]) == 2
    assert "a kv_role is needed" in capsys.readouterr().err


def test_help_documents_the_forms(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside flag names
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("disaggregated prefill and decode:", "--kv-transfer-config JSON", "kv_producer prefills",
                  "--prefill-workers N", "--decode-workers M", "not with -dp > 1",
                  "With --prefill-workers and --decode-workers its kv_role must be kv_both"):
        assert shown in text, shown


@pytest.mark.parametrize("arguments, message", [
    ({"kv_transfer_config": {"kv_connector": "PyNcclConnector"}},
     "LLM(kv_transfer_config={'kv_connector': 'PyNcclConnector'}): a kv_role is needed: kv_producer"),
    ({"kv_transfer_config": '{"kv_connector": "HostConnector", "kv_role": "kv_both", "kv_rol": 1}'},
     "has unknown key 'kv_rol'"),
    ({"prefill_workers": 1}, "LLM(prefill_workers=1) needs decode_workers too"),
    ({"prefill_workers": 0, "decode_workers": 1}, "LLM(prefill_workers=0): must be a positive integer"),
    ({"prefill_workers": 1, "decode_workers": 1, "data_parallel_size": 2},
     "with LLM(data_parallel_size=2): not available yet"),
    ({"prefill_workers": 1, "decode_workers": 1, "kv_transfer_config": {"kv_connector": "HostConnector",
                                                                        "kv_role": "kv_consumer"}},
     "kv_role must be kv_both"),
    ({"prefill_workers": 1, "decode_workers": 1, "enable_prefix_caching": False},
     "needs prefix caching"),
])
def test_llm_refuses_with_a_value_error_naming_the_argument(arguments, message):
    with pytest.raises(ValueError) as refused:
        LLM(load_format="dummy", **arguments)
    assert message in str(refused.value)
