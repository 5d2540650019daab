"""The scheduler's steps under KV pressure, on the CPU, stepping synchronously and planning ahead.

    python tools/bench/engine/scheduling.py                       # 1,000 x (100 in, 100 out), a pool of 147 full requests
    python tools/bench/engine/scheduling.py --num-requests 300 --pool-requests 60 --json /tmp/rows.jsonl

The offline benchmark at a tenth of its lengths: a model whose every step reads all its weights
(a mixture of experts at a decode batch of a hundred or more) pays for each step, so the steps
a workload takes, and the batch each holds, are its throughput before any kernel. The engine
runs a tiny model (Qwen3-30B-A3B's built-in config cut to one layer of width 64, dummy weights,
float32) over a KV pool sized to hold `--pool-requests` requests at full length, as
1,000 x (1,000 in, 1,000 out) on an H100 holds 147. With asynchronous scheduling on the CPU
the step before is never reported done when the next is planned (worker/driver/pipeline.py), so
every step is planned ahead of its predecessor's tokens, as on a GPU that is always busy.

Each row: steps, decode rows a step on average, steps with fewer than a quarter of the pool's
full requests decoding, preemptions, and the tokens computed against the workload's own
(prompts once and each output once): the rest is recomputed after preemptions.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

TINY = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def tiny_folder(dest: Path) -> Path:
    """The built-in qwen3-30b-a3b config cut to TINY, with the default model's tokenizer."""
    from spillway.tools.bench.serve.server_process import build_model_folder, default_tokenizer_dir

    folder = build_model_folder("qwen3-30b-a3b", default_tokenizer_dir(), dest)
    config = json.loads((folder / "config.json").read_text())
    config.update(TINY)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run(folder: Path, args, async_scheduling: bool) -> dict:
    """One pass of the workload through an engine; its row."""
    from spillway.protocol.messages import Generate, SamplingParams
    from spillway.worker.driver.engine import Engine
    from spillway.worker.runner.device_settings import WorkerConfig

    full = args.input_len + args.output_len
    blocks = math.ceil(args.pool_requests * full / args.block_size)
    engine = Engine(WorkerConfig(model=str(folder), load_format="dummy", dtype="float32", device="cpu",
                                 max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                                 num_gpu_blocks_override=blocks, max_model_len=full + args.block_size,
                                 async_scheduling=async_scheduling))
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = [rng.randrange(256, engine.vocab_size) for _ in range(args.input_len)]
        engine.add_request(Generate(request_id=f"r{i}", prompt_token_ids=prompt, block_hashes=[], params=params))
    steps = computed = decode_rows = small = 0
    seen = None
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
        plan = engine.last_plan
        if plan is None or plan is seen or not plan.chunks:
            continue  # a call that planned nothing new
        seen = plan
        rows = sum(chunk.num_tokens == 1 and chunk.start >= chunk.request.num_prompt_tokens for chunk in plan.chunks)
        steps, computed, decode_rows = steps + 1, computed + plan.num_batched_tokens, decode_rows + rows
        small += rows < args.pool_requests / 4
    workload = args.num_requests * full
    return dict(scheduling="ahead" if async_scheduling else "synchronous", requests=args.num_requests,
                input_len=args.input_len, output_len=args.output_len, pool_blocks=blocks, steps=steps,
                decode_rows_per_step=round(decode_rows / max(steps, 1), 1), small_steps=small,
                preemptions=engine.stats().num_preemptions, tokens_computed=computed, workload_tokens=workload,
                recomputed=round(computed / workload - 1, 3), seconds=round(time.perf_counter() - started, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--pool-requests", type=float, default=147.0,
                        help="requests at full length the KV pool holds (default: what an H100 holds of 1000 x 1000/1000)")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="append each row to this file as a JSON line")
    args = parser.parse_args()
    if min(args.num_requests, args.input_len, args.output_len, args.max_num_seqs, args.block_size) < 1 \
            or args.pool_requests < 1:
        parser.error("counts and lengths must be positive, and the pool must hold one request")
    with tempfile.TemporaryDirectory(prefix="spillway-scheduling-") as tmp:
        folder = tiny_folder(Path(tmp))
        for async_scheduling in (False, True):
            row = run(folder, args, async_scheduling)
            print(f"{row['scheduling']:>12}: {row['steps']} steps, {row['decode_rows_per_step']} decode rows a step "
                  f"({row['small_steps']} steps under a quarter of the pool's requests), {row['preemptions']} "
                  f"preemptions, {row['tokens_computed']:,} tokens computed for {row['workload_tokens']:,} "
                  f"({row['recomputed']:+.1%}), {row['seconds']} s")
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
