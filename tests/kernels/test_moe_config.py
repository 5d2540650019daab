"""The MoE kernel's tile tables: file names, the nearest bucket, a table read once per shape, the
untuned default and its one log line."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from spillway.kernels import moe_config
from spillway.kernels.moe_config import (
    MoeConfig,
    config_file_name,
    config_for,
    default_config,
    device_name,
    nearest_bucket,
    read_buckets,
)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@pytest.fixture(autouse=True)
def fresh_tables():
    moe_config.tuned_buckets.cache_clear()
    yield
    moe_config.tuned_buckets.cache_clear()


def test_file_names_carry_experts_width_device_and_dtype():
    assert config_file_name(128, 768, "NVIDIA H200", torch.bfloat16) == "experts128-width768-NVIDIA_H200-bf16.json"
    assert config_file_name(8, 14336, "NVIDIA H100 80GB HBM3", torch.float16) == \
        "experts8-width14336-NVIDIA_H100_80GB_HBM3-fp16.json"
    assert config_file_name(4, 40, "cpu", torch.float32) == "experts4-width40-cpu-fp32.json"
    with pytest.raises(ValueError, match="no MoE config naming"):
        config_file_name(4, 40, "cpu", torch.int8)


@pytest.mark.parametrize("num_tokens, bucket", [
    (0, 1), (1, 1), (3, 4), (5, 4), (6, 8), (7, 8), (24, 32), (200, 256), (3000, 4096), (2890, 2048), (100000, 4096),
])
def test_the_nearest_bucket_by_ratio(num_tokens, bucket):
    assert nearest_bucket(BUCKETS, num_tokens) == bucket


def test_a_tie_goes_to_the_smaller_bucket():
    assert nearest_bucket([8, 2], 4) == 2


def test_configs_round_trip_through_json_and_bad_entries_are_refused():
    config = MoeConfig("grouped", block_size_m=32, block_size_n=128, block_size_k=64, group_size_m=8, num_warps=8,
                       num_stages=4)
    assert config.to_json() == {"path": "grouped", "BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64,
                                "GROUP_SIZE_M": 8, "num_warps": 8, "num_stages": 4}
    assert MoeConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match=r"unknown keys in a MoE config: \['BLOCK_M'\]"):
        MoeConfig.from_json({"BLOCK_M": 16})
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        MoeConfig.from_json({"path": "pairs", "num_warps": 3})


def write_table(directory, buckets: dict[int, MoeConfig], name=None) -> None:
    name = name or config_file_name(128, 768, "NVIDIA H200", torch.bfloat16)
    table = {"shape": {"experts": 128},
             "buckets": {str(tokens): config.to_json() for tokens, config in buckets.items()}}
    (directory / name).write_text(json.dumps(table))


PAIRS = MoeConfig("pairs", block_size_n=16, block_size_k=512, num_stages=2)
GROUPED = MoeConfig("grouped", block_size_m=64, block_size_n=128, block_size_k=64, group_size_m=16, num_warps=8)


def test_a_tuned_table_gives_each_token_count_its_nearest_bucket_and_is_read_once(tmp_path, monkeypatch):
    write_table(tmp_path, {1: PAIRS, 64: GROUPED})
    reads = []
    real_read = moe_config.read_buckets
    monkeypatch.setattr(moe_config, "read_buckets", lambda path: reads.append(path) or real_read(path))

    def config(num_tokens):
        return config_for(128, 768, 8, "NVIDIA H200", torch.bfloat16, num_tokens, directory=tmp_path)

    assert config(1) == PAIRS and config(7) == PAIRS
    assert config(9) == GROUPED and config(4096) == GROUPED
    assert config(33) is config(64)  # one object a bucket: the kernels see the same constants
    assert len(reads) == 1
    assert config_for(128, 768, 8, "NVIDIA H200", torch.float16, 1, directory=tmp_path) == \
        default_config(1, 128, 8, torch.float16)  # another dtype, another table: none here


def test_fp8_weights_have_tables_of_their_own(tmp_path):
    fp8 = torch.float8_e4m3fn
    assert config_file_name(128, 768, "NVIDIA H200", torch.bfloat16, fp8) == \
        "experts128-width768-NVIDIA_H200-bf16-fp8weights.json"
    assert config_file_name(128, 768, "NVIDIA H200", torch.bfloat16, torch.bfloat16) == \
        "experts128-width768-NVIDIA_H200-bf16.json"
    with pytest.raises(ValueError, match="no MoE config naming for torch.int8 weights under torch.bfloat16"):
        config_file_name(128, 768, "NVIDIA H200", torch.bfloat16, torch.int8)

    def config(weight_dtype):
        return config_for(128, 768, 8, "NVIDIA H200", torch.bfloat16, 1, directory=tmp_path, weight_dtype=weight_dtype)

    write_table(tmp_path, {1: PAIRS})  # the bf16 weights' table
    assert config(torch.bfloat16) == PAIRS and config(fp8) == default_config(1, 128, 8, torch.bfloat16)
    moe_config.tuned_buckets.cache_clear()
    write_table(tmp_path, {1: GROUPED}, name=config_file_name(128, 768, "NVIDIA H200", torch.bfloat16, fp8))
    assert config(fp8) == GROUPED and config(None) == PAIRS


def test_a_table_without_buckets_is_refused(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"buckets": {}}))
    with pytest.raises(ValueError, match="buckets must be positive token counts"):
        read_buckets(path)


def test_an_untuned_shape_gets_the_default_and_one_log_line(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="spillway.kernels.moe_config")
    for num_tokens in (1, 5, 300, 1):
        assert config_for(64, 512, 6, "NVIDIA H200", torch.bfloat16, num_tokens, directory=tmp_path) == \
            default_config(num_tokens, 64, 6, torch.bfloat16)
    config_for(8, 14336, 2, "NVIDIA H200", torch.bfloat16, 1, directory=tmp_path)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "no tuned MoE config experts64-width512-NVIDIA_H200-bf16.json" in lines[0]
    assert "experts8-width14336-NVIDIA_H200-bf16.json" in lines[1]


def test_the_default_takes_the_pairs_path_while_experts_get_one_pair_or_fewer():
    assert default_config(16, 128, 8, torch.bfloat16).path == "pairs"  # one pair an expert
    assert default_config(4, 8, 2, torch.bfloat16).path == "pairs"
    grouped = default_config(17, 128, 8, torch.bfloat16)
    assert (grouped.path, grouped.block_size_m, grouped.block_size_n) == ("grouped", 16, 64)
    large = default_config(4096, 128, 8, torch.bfloat16)  # 256 pairs an expert
    assert (large.block_size_m, large.block_size_n, large.num_warps, large.num_stages) == (128, 128, 8, 3)
    large_fp32 = default_config(4096, 128, 8, torch.float32)  # half the rows a stage in shared memory
    assert (large_fp32.block_size_m, large_fp32.block_size_n, large_fp32.num_stages) == (64, 64, 2)


def test_the_cpu_files_its_configs_under_its_type():
    assert device_name(torch.device("cpu")) == "cpu"


def test_every_shipped_table_reads_and_is_filed_under_its_own_shape():
    import json

    from spillway.kernels.moe_config import CONFIG_DIR, config_file_name, read_buckets

    tables = sorted(CONFIG_DIR.glob("*.json"))
    assert tables, f"no tuned tables in {CONFIG_DIR}"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
    for path in tables:
        shape = json.loads(path.read_text())["shape"]
        dtype = dtypes[shape["dtype"]]
        assert path.name == config_file_name(shape["experts"], shape["intermediate"], shape["device"], dtype,
                                             dtypes[shape.get("weights", shape["dtype"])])
        buckets = read_buckets(path)
        assert 1 in buckets, f"{path.name}: no batch-1 entry, the decode step's"
