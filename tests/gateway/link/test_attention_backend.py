"""vLLM's attention backend names, given as `--attention-backend NAME` or in
`--additional-config '{"mla_backend": "NAME"}'` (`LLM(attention_backend=..., additional_config=...)`):
a name that fits the model is taken and reaches the worker, which runs Spillway's own kernel and
says which, once, in its log (tests/worker/runner/test_requested_backend.py); an unknown name, one that does not fit the model, two that
disagree and an additional configuration Spillway cannot read are refused, each by name."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from spillway.gateway import LLM, SamplingParams
from spillway.gateway.cli.bench_offline import engine_kwargs
from spillway.gateway.cli.main import add_other_commands, build_parser, main, refusals, worker_config
from spillway.gateway.link.engine_args import RefusedArgument, engine_config
from spillway.protocol.config import WorkerConfig

sys.path.insert(0, str(Path(__file__).parents[2] / "worker"))
from tiny_models import save_tiny_deepseek_v3  # noqa: E402

DENSE = ("FLASH_ATTN, FLASH_ATTN_DIFFKV, TRITON_ATTN, FLASHINFER, FLEX_ATTENTION, TREE_ATTN, CPU_ATTN, ROCM_ATTN, "
         "ROCM_AITER_FA, ROCM_AITER_UNIFIED_ATTN")
LATENT = ("FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA, TRITON_MLA, CUTLASS_MLA, TOKENSPEED_MLA, FLASHMLA_SPARSE, "
          "FLASHINFER_MLA_SPARSE, TRITON_MLA_SPARSE, ROCM_AITER_MLA, ROCM_AITER_TRITON_MLA, ROCM_AITER_MLA_SPARSE, "
          "XPU_MLA_SPARSE")
TRITON_MLA_LINE = ("attention backend TRITON_MLA requested: Spillway's plain-torch latent attention runs (the CPU "
                   "runs plain torch; TRITON_MLA is vLLM's Triton latent-attention kernel)")


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3"))


def serve_config(*flags: str) -> WorkerConfig:
    args = build_parser().parse_args(["serve", *flags])
    assert refusals(args) == []
    return worker_config(args)[0]


def test_the_articles_command_line_is_taken_for_a_deepseek_v3(deepseek_v3):
    config = serve_config(deepseek_v3, "--additional-config", '{"mla_backend":"TOKENSPEED_MLA"}',
                          "--trust-remote-code")
    assert config.attention_backend == "TOKENSPEED_MLA"


@pytest.mark.parametrize("flags, backend", [
    (["--attention-backend", "FLASHMLA"], "FLASHMLA"),
    (["--attention-backend", "CUTLASS_MLA", "--additional-config", '{"mla_backend": "CUTLASS_MLA"}'], "CUTLASS_MLA"),
    (["--additional-config", "{}"], None),
    ([], None),
])
def test_a_latent_attention_backend_fits_a_deepseek_v3(deepseek_v3, flags, backend):
    assert serve_config(deepseek_v3, *flags).attention_backend == backend


def test_a_dense_backend_fits_a_dense_model_by_flag_or_argument():
    assert serve_config("--load-format", "dummy", "--attention-backend", "FLASH_ATTN").attention_backend == "FLASH_ATTN"
    config, _ = engine_config(None, load_format="dummy", attention_backend="TRITON_ATTN")
    assert config.attention_backend == "TRITON_ATTN"


@pytest.mark.parametrize("model, flags, message", [
    ("dense", ["--attention-backend", "FLASH_ATTENTION"],
     f"--attention-backend FLASH_ATTENTION: vLLM has no attention backend 'FLASH_ATTENTION'; the model takes {DENSE}"),
    ("dense", ["--attention-backend", "TRITON_MLA"],
     f"--attention-backend TRITON_MLA: TRITON_MLA is a latent-attention (MLA) kernel and the model has no latent "
     f"attention; it takes {DENSE}"),
    ("dense", ["--additional-config", '{"mla_backend": "FLASHMLA"}'],
     f'--additional-config {{"mla_backend": "FLASHMLA"}}: FLASHMLA is a latent-attention (MLA) kernel and the model '
     f"has no latent attention; it takes {DENSE}"),
    ("deepseek_v3", ["--attention-backend", "FLASH_ATTN"],
     f"--attention-backend FLASH_ATTN: FLASH_ATTN is a kernel for models without latent attention (MLA) and the "
     f"model uses multi-head latent attention; it takes {LATENT}"),
    ("deepseek_v3", ["--attention-backend", "FLASHMLA", "--additional-config", '{"mla_backend": "TOKENSPEED_MLA"}'],
     '--attention-backend FLASHMLA and --additional-config {"mla_backend": "TOKENSPEED_MLA"} ask for two attention '
     "backends; give one, or the same in both"),
    ("deepseek_v3", ["--additional-config", '{"mla_backend": "TRITON_MLA", "ascend_scheduler_config": {}}'],
     '--additional-config {"mla_backend": "TRITON_MLA", "ascend_scheduler_config": {}}: the key '
     "'ascend_scheduler_config' needs platform plugins' additional configuration, which Spillway does not have yet "
     "(it reads mla_backend only)"),
    ("deepseek_v3", ["--additional-config", "{mla_backend: TRITON_MLA}"],
     "--additional-config {mla_backend: TRITON_MLA}: not valid JSON (Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1))"),
    ("deepseek_v3", ["--additional-config", '["TRITON_MLA"]'],
     '--additional-config ["TRITON_MLA"]: must be a JSON object, such as {"mla_backend": "TRITON_MLA"}'),
    ("deepseek_v3", ["--additional-config", '{"mla_backend": 1}'],
     '--additional-config {"mla_backend": 1}: mla_backend must be a backend\'s name, got 1'),
])
@pytest.mark.parametrize("command", [["serve"], ["worker", "--connect", "tcp://127.0.0.1:1"]])
def test_the_command_line_refuses_with_the_flag_and_exit_status_2(deepseek_v3, capsys, command, model, flags,
                                                                   message):
    model_args = [deepseek_v3] if model == "deepseek_v3" else ["--load-format", "dummy"]
    assert main([*command, *model_args, *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"spillway {command[0]}: {message}"


def test_llm_refuses_with_its_arguments_before_a_worker_starts(deepseek_v3, monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("spillway.gateway.offline.llm.EngineThread", no_worker)
    with pytest.raises(RefusedArgument) as refused:
        LLM(deepseek_v3, additional_config={"mla_backend": "TRITON_MLA", "torchair_graph_config": {}})
    assert str(refused.value) == (
        "LLM(additional_config={'mla_backend': 'TRITON_MLA', 'torchair_graph_config': {}}): the key "
        "'torchair_graph_config' needs platform plugins' additional configuration, which Spillway does not have "
        "yet (it reads mla_backend only)")
    with pytest.raises(RefusedArgument) as refused:
        LLM(deepseek_v3, attention_backend="TRITON_ATTN")
    assert str(refused.value).startswith("LLM(attention_backend='TRITON_ATTN'): TRITON_ATTN is a kernel for models "
                                         "without latent attention (MLA)")


def test_the_bench_commands_hand_the_backend_to_llm():
    parser = build_parser()  # the bench commands share serve's engine flags
    add_other_commands(parser)
    args = parser.parse_args(["bench", "latency", "--attention-backend", "TRITON_MLA",
                              "--additional-config", '{"mla_backend": "TRITON_MLA"}'])
    kwargs = engine_kwargs(args)
    assert (kwargs["attention_backend"], kwargs["additional_config"]) == ("TRITON_MLA", '{"mla_backend": "TRITON_MLA"}')


def test_a_worker_config_without_the_field_names_no_backend():
    older = msgspec.msgpack.encode({"model": "m", "block_size": 16})
    assert msgspec.msgpack.decode(older, type=WorkerConfig).attention_backend is None


def test_llm_on_a_deepseek_v3_logs_the_kernel_that_runs_once(deepseek_v3, capfd):
    with LLM(deepseek_v3, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2,
             attention_backend="TRITON_MLA") as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert capfd.readouterr().err.count(TRITON_MLA_LINE) == 1


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["bench", "latency"], ["bench", "throughput"]])
def test_help_shows_both_flags_among_the_engine_flags(capsys, command):
    parser = build_parser()
    add_other_commands(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    engine_help = capsys.readouterr().out.split("\nengine:\n")[1].split("\n\n")[0]
    assert "--attention-backend NAME" in engine_help and "--additional-config JSON" in engine_help
    assert "TOKENSPEED_MLA" in engine_help and '{"mla_backend": NAME}' in engine_help
