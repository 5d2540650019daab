"""Compile the MLA decode and prefill launches for sm_90, on any machine; print a JSON line a launch.

    python tests/kernels/mla_sm90.py HEADS CACHE_DTYPE      # CACHE_DTYPE: bf16 or fp8

DeepSeek V2/V3's latent rows (512 + 64 values), bf16 queries, blocks of 16 tokens: a decode of
64 requests over 4,096 tokens a table (one query each; then 1 + 3 speculative, over 4 splits
and their reduction), and a ragged
prefill of 4 sequences of up to 512 new tokens. The launches are recorded (tests/kernels/sm90.py)
on CPU tensors; nothing is read back. Run in its own process without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys

from sm90 import Recorder, launch_report  # first: it keeps triton from interpreting

import torch  # noqa: E402
from spillway.kernels import mla_decode, mla_prefill  # noqa: E402

LATENT, ROPE, BLOCK = 512, 64, 16


def main() -> None:
    num_heads, cache_dtype = int(sys.argv[1]), {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[sys.argv[2]]
    for module in (mla_decode, mla_prefill):
        module.for_device = Recorder
    cache = torch.empty(4096 * 64 // BLOCK, 1, 1, BLOCK, 1, LATENT + ROPE, dtype=cache_dtype)
    scale = (128 + ROPE) ** -0.5
    for queries, num_splits in ((1, None), (4, 4)):  # the second also reduces its splits
        q = torch.empty(64, queries, num_heads, LATENT + ROPE, dtype=torch.bfloat16)
        tables = torch.zeros(64, 4096 // BLOCK, dtype=torch.int32)
        mla_decode.paged_mla_decode(q, cache, 0, tables, torch.full((64,), 4096, dtype=torch.int32),
                                    kv_lora_rank=LATENT, scale=scale, num_splits=num_splits)
    q = torch.empty(2048, num_heads, LATENT + ROPE, dtype=torch.bfloat16)
    starts = torch.tensor([0, 512, 1024, 1536, 2048], dtype=torch.int32)
    mla_prefill.paged_mla_prefill(q, cache, 0, starts, torch.full((4,), 1024, dtype=torch.int32),
                                  torch.zeros(4, 1024 // BLOCK, dtype=torch.int32), kv_lora_rank=LATENT, scale=scale,
                                  max_query_len=512)
    for launch in Recorder.launches:
        print(json.dumps(launch_report(*launch)))


if __name__ == "__main__":
    main()
