"""Compile every launch of one fused_experts call for sm_90, on any machine; print a JSON line a launch.

    python tests/kernels/moe_sm90.py T K E H I [CONFIG_JSON] [--fp8-weights]

A call never reads its results on the host, so recording its launches (tests/kernels/sm90.py)
needs nothing else. Run in its own process without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys

from sm90 import Recorder, launch_report  # first: it keeps triton from interpreting

import torch  # noqa: E402
from spillway.kernels import moe_align, moe_grouped, moe_pairs  # noqa: E402
from spillway.kernels.fused_moe import fused_experts  # noqa: E402
from spillway.kernels.moe_config import MoeConfig  # noqa: E402


def main() -> None:
    arguments = [argument for argument in sys.argv[1:] if argument != "--fp8-weights"]
    num_tokens, top_k, num_experts, hidden, intermediate = map(int, arguments[:5])
    config = MoeConfig.from_json(json.loads(arguments[5])) if len(arguments) > 5 else None
    for module in (moe_align, moe_grouped, moe_pairs):
        module.for_device = Recorder
    dtype = torch.bfloat16
    weight_dtype = torch.float8_e4m3fn if "--fp8-weights" in sys.argv else dtype
    scales = {} if weight_dtype == dtype else dict(w13_scale=torch.ones(num_experts, 2 * intermediate),
                                                   w2_scale=torch.ones(num_experts, hidden))
    fused_experts(torch.empty(num_tokens, hidden, dtype=dtype),
                  torch.empty(num_experts, 2 * intermediate, hidden, dtype=weight_dtype),
                  torch.empty(num_experts, hidden, intermediate, dtype=weight_dtype),
                  torch.rand(num_tokens, top_k), torch.randint(0, num_experts, (num_tokens, top_k)), config=config,
                  **scales)
    for launch in Recorder.launches:
        print(json.dumps(launch_report(*launch)))


if __name__ == "__main__":
    main()
