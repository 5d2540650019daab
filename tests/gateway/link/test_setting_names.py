"""Messages that name a setting name it as the caller wrote it: `--cpu-offload-gb` to a user of
`spillway serve`, `cpu_offload_gb` to a user of `LLM`, whether the gateway or the worker
writes the message."""

from __future__ import annotations

import pytest

from spillway.gateway import LLM
from spillway.gateway.cli.main import _flag, build_parser, main, refusals, worker_config
from spillway.gateway.link.engine_args import engine_config

TOO_MUCH_HOST_MEMORY = 1_000_000  # GiB: more than any host has available
HOST_MEMORY_REFUSAL = (r"the CPU KV tier asks for 1000000\.00 GiB of host memory and [0-9.]+ GiB is available; "
                       r"lower {setting}$")


def test_the_worker_names_the_cpu_tiers_size_as_llm_and_serve_users_gave_it(capsys):
    # The worker refuses it before the model loads, with the host's numbers.
    with pytest.raises(ValueError, match=HOST_MEMORY_REFUSAL.format(setting="cpu_offload_gb")):
        LLM(device="cpu", cpu_offload_gb=TOO_MUCH_HOST_MEMORY)
    assert main(["serve", "--device", "cpu", "--cpu-offload-gb", str(TOO_MUCH_HOST_MEMORY)]) == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("spillway serve: the CPU KV tier asks for")
    assert last_line.endswith("is available; lower --cpu-offload-gb")


def test_a_refused_feature_names_the_other_setting_as_its_caller_spells_it():
    with pytest.raises(ValueError) as refused:
        LLM(swap_space=4)
    assert str(refused.value) == ("LLM(swap_space=4) needs a swap space apart from the CPU KV tier (cpu_offload_gb), "
                                  "which Spillway does not have yet")
    with pytest.raises(ValueError) as refused:
        LLM(enable_chunked_prefill=False)
    assert str(refused.value) == (
        "LLM(enable_chunked_prefill=False) cannot be honoured: prompts are always prefilled in chunks of the step's "
        "token budget (max_num_batched_tokens): the scheduler has no whole-prompt prefill")
    assert refusals(build_parser().parse_args(["serve", "--swap-space", "4"])) == [
        "--swap-space 4.0 needs a swap space apart from the CPU KV tier (--cpu-offload-gb), which Spillway does not "
        "have yet"]


@pytest.mark.parametrize("name, value, message", [
    ("max_num_seqs", 0, "{} must be a positive integer, got 0"),
    ("gpu_memory_utilization", 1.5, "{} must be in (0, 1], got 1.5"),
    ("max_model_len", 1, "{} must be an integer of at least 2, got 1"),
    ("quantization", "awq", "{} must be one of fp8 (or none), got 'awq'"),
])
def test_a_value_out_of_range_is_named_as_a_flag_or_an_argument(name, value, message):
    # The command line's own types refuse most of these first; a --config file's values too.
    with pytest.raises(ValueError) as refused:
        engine_config(None, spell=_flag, settings_spelling="flags", **{name: value})
    assert str(refused.value) == message.format("--" + name.replace("_", "-"))
    with pytest.raises(ValueError) as refused:
        LLM(**{name: value})
    assert str(refused.value) == message.format(name)


def test_two_sizes_of_the_cpu_tier_are_named_as_given():
    with pytest.raises(ValueError) as refused:
        worker_config(build_parser().parse_args(["serve", "--cpu-offload-gb", "4", "--kv-offloading-size", "5"]))
    assert str(refused.value) == ("--cpu-offload-gb 4.0 and --kv-offloading-size 5.0 name the same CPU KV tier "
                                  "with two sizes")
    with pytest.raises(ValueError) as refused:
        LLM(cpu_offload_gb=4, kv_offloading_size=5)
    assert str(refused.value) == ("LLM(cpu_offload_gb=4) and LLM(kv_offloading_size=5) name the same CPU KV tier "
                                  "with two sizes")
