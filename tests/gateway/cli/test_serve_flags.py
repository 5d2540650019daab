"""`spillway serve`'s flags as `vllm serve` has them: each one honoured (it reaches the
settings) or refused with exit status 2 and a message naming it; `--config FILE` as vLLM reads
it; defaults in `--help`."""

from __future__ import annotations

import pytest

from spillway.gateway.cli.main import _server_settings, build_parser, main, refusals
from spillway.protocol.local import model_files

# (flags, what the parsed settings show) for flags that are honoured
HONOURED = [
    (["--enable-chunked-prefill"], lambda s: True),  # accepted: prefill is always chunked
    (["--disable-log-stats"], lambda s: s.log_stats is False),
    ([], lambda s: s.log_stats is True),
    (["--max-logprobs", "5"], lambda s: s.request_defaults.max_logprobs == 5),
    ([], lambda s: s.request_defaults.max_logprobs == 20),
    (["--max-n", "8"], lambda s: s.max_n == 8),
    ([], lambda s: s.max_n == 128),
    (["--generation-config", "vllm"], lambda s: s.request_defaults.overridden == {}),
    (["--max-model-len", "300"], lambda s: s.worker.max_model_len == 300),
    (["--served-model-name", "a", "b"], lambda s: s.served_model_names == ["a", "b"]),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], lambda s: s.tool_call_parser == "hermes"),
    (["--tool-call-parser", "hermes"], lambda s: s.tool_call_parser is None),  # "auto" still needs the switch
    ([], lambda s: s.tool_call_parser is None),
    (["-dp", "2", "--routing", "load"], lambda s: (s.data_parallel_size, s.routing) == (2, "load")),
    ([], lambda s: (s.data_parallel_size, s.routing) == (1, "prefix")),
    (["--quantization", "fp8"], lambda s: s.worker.quantization == "fp8"),
    (["-q", "fp8"], lambda s: s.worker.quantization == "fp8"),
    ([], lambda s: s.worker.quantization is None),
]

# (flags, the flag the message must name) for flags that are refused with exit status 2
REFUSED = [
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "--tool-call-parser nope"),
    (["--kv-transfer-config", '{"kv_connector": "X"}'], "--kv-transfer-config"),
    (["--additional-config", '{"ascend_scheduler_config": {}}'], "--additional-config"),
    (["--max-logprobs", "21"], "--max-logprobs"),
    (["--max-logprobs", "-1"], "--max-logprobs"),
    (["--max-n", "0"], "--max-n"),
    (["--max-n", "129"], "--max-n"),
    (["--swap-space", "4"], "--swap-space"),
    (["--quantization", "awq"], "--quantization"),  # fp8 only
    (["--enable-lora"], "--enable-lora"),
    (["-tp", "2"], "--tensor-parallel-size"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    (["-dp", "2", "--api-server-count", "2"], "--data-parallel-size 2 with --api-server-count"),
    (["-dp", "2", "--worker-address", "tcp://127.0.0.1:5999"], "--data-parallel-size 2 with --worker-address"),
    (["-dp", "0"], "--data-parallel-size"),
    (["--distributed-executor-backend", "ray", "--api-server-count", "2"],
     "--distributed-executor-backend ray with --api-server-count"),
    (["-dp", "2", "--distributed-executor-backend", "ray", "--worker-address", "tcp://127.0.0.1:5999"],
     "--distributed-executor-backend ray with --worker-address"),
    (["--distributed-executor-backend", "external_launcher"], "--distributed-executor-backend"),
    (["--routing", "random"], "--routing"),
    (["--disable-log"], "--disable-log"),  # no abbreviation passes for another flag
]


@pytest.mark.parametrize("flags, check", HONOURED, ids=[" ".join(f) or "defaults" for f, _ in HONOURED])
def test_honoured_flags_reach_the_settings(flags, check):
    args = build_parser().parse_args(["serve", "--load-format", "dummy", *flags])
    assert refusals(args) == []
    assert check(_server_settings(args))


def test_models_root_is_the_model_as_named_under_any_served_name():
    """`/v1/models` reports the model as given as `root` (vLLM's card), whatever name it is served
    under: benchmark clients such as GuideLLM load the tokenizer from there."""
    folder = str(model_files.resolve_model(None, "dummy").path)
    for model, root in (([], model_files.DEFAULT_MODEL_NAME), ([folder], folder)):
        args = build_parser().parse_args(["serve", *model, "--load-format", "dummy", "--served-model-name", "a"])
        settings = _server_settings(args)
        assert (settings.served_model_names, settings.model_root) == (["a"], root)


@pytest.mark.parametrize("flags, named", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_refused_flags_exit_2_naming_the_flag(capsys, flags, named):
    try:
        code = main(["serve", *flags])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    assert named in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--port PORT the port to listen on (default: 8000)", "--max-logprobs MAX_LOGPROBS",
                  "(default: 20)", "--seed SEED default: 0", "--generation-config auto|vllm|FOLDER",
                  "(default: auto)", "--max-num-seqs MAX_NUM_SEQS default: 256",
                  "--max-n N the most choices (n) one request may ask for", "(default: 128)"):
        assert shown in text


def test_config_file_flags_apply_and_the_command_line_wins(tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 300\nmax_num_seqs: 7\nenable-prefix-caching: false\n"
                      "disable-log-stats: true\nserved-model-name: [x, y]\nport: 9001\n")
    seen = {}
    monkeypatch.setattr("spillway.gateway.cli.main.serve_command", lambda args: seen.setdefault("args", args) and 0)
    assert main(["serve", "--config", str(config), "--max-model-len", "400", "--load-format", "dummy"]) == 0
    args = seen["args"]
    assert (args.max_model_len, args.max_num_seqs, args.enable_prefix_caching) == (400, 7, False)
    assert (args.disable_log_stats, args.served_model_name, args.port) == (True, ["x", "y"], 9001)


@pytest.mark.parametrize("text, named", [("max-model-len: [oops\n", "--config"),
                                         ("- a list\n", "mapping"),
                                         ("no-such-flag: 1\n", "--no-such-flag"),
                                         ("kv-transfer-config: {a: 1}\n", "--kv-transfer-config")])
def test_bad_config_files_exit_2_naming_the_problem(tmp_path, capsys, text, named):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    try:
        code = main(["serve", "--config", str(config)])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert named in capsys.readouterr().err


def test_a_missing_config_file_is_named(capsys):
    assert main(["serve", "--config", "/nonexistent/serve.yaml"]) == 2
    assert "/nonexistent/serve.yaml" in capsys.readouterr().err
