"""The worker's time for a burst of long prompts on one prefix that only the CPU tier holds
(the served convoy's shape, in-process: no HTTP, no gateway): each request's intake (its Generate
decoded, `Engine.add_request`), the step that admits them all (prefix lookups, references, the
one shared load), and the steps that then compute them until each has its first token (staging
50 block tables of the prefix's length, the forward, the commit); and, beside it, the burst's
time to its last first token against one request's alone on the same prefix.

    python tools/bench/tier/admission.py                        # this tree: 50 requests on a 10,000-token prefix
    python tools/bench/tier/admission.py --baseline DIR         # and the tree at DIR, alternating, same run
                                                           #   (mkdir DIR && git archive REV | tar -x -C DIR)
    python tools/bench/tier/admission.py --device cuda          # the GPU path (on the CPU the copies and the
                                                           #   attention run on the host: in the columns)
    python tools/bench/tier/admission.py --device cuda --model qwen3-8b --tokenizer-dir tok
                                                           # a real shape (dummy weights): the device's time too

The default model is a tiny random Llama: the bookkeeping does not depend on the model's size,
and its forward leaves the compute column mostly host time. Per run: microseconds per request of
intake, admission and compute, and the two times in milliseconds, each the median over
`--rounds` bursts (the prefix pushed out to the CPU tier again before each burst and before
the lone request); the table shows the median over `--repeats` runs of each tree.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from spillway.tools.bench.result_rows import print_tree_medians, runs_of_trees  # noqa: E402
from spillway.tools.bench.serve.server_process import build_model_folder, default_tokenizer_dir, tree_env  # noqa: E402

PIECES = ("intake", "admission", "compute", "total", "burst_ms", "alone_ms")
BLOCK_SIZE = 16


def time_burst(prompt_len: int, burst: int, rounds: int, device: str = "cpu", model: str | None = None,
               tokenizer_dir: Path | None = None) -> dict[str, float]:
    """The child, with whichever spillway it imports: microseconds per request of each piece,
    and milliseconds from the burst's first arrival to its last first token and from a lone
    request's arrival to its first token (the same prefix, pushed out the same way first)."""
    import torch

    from spillway.gateway.text.tokenizer import PromptHasher
    from spillway.protocol.config import WorkerConfig
    from spillway.protocol.hashing import pack_token_ids
    from spillway.protocol.messages import Generate, SamplingParams, encoder, gateway_decoder
    from spillway.worker.driver.engine import Engine

    torch.manual_seed(0)
    folder, vocab = model_folder(model, tokenizer_dir, prompt_len)
    prefix_blocks = -(-(prompt_len + 4) // BLOCK_SIZE)
    gpu_blocks = prefix_blocks + burst + 64  # the prefix and the burst's own blocks, not the fillers too
    num_fillers = -(-gpu_blocks * BLOCK_SIZE // prompt_len) + 1  # prompts of the prefix's length
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = Engine(WorkerConfig(model=str(folder), load_format="dummy" if model else "auto", device=device,
                                 dtype=dtype, max_num_seqs=burst + 8, max_model_len=prompt_len + 32,
                                 block_size=BLOCK_SIZE, num_gpu_blocks_override=gpu_blocks,
                                 num_cpu_blocks_override=4 * gpu_blocks))
    hasher = PromptHasher.of(engine.ready())
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    wire, decoder = encoder(), gateway_decoder()
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(count)]

    def message(request_id: str, ids: list[int]) -> bytes:
        packed = pack_token_ids(ids)
        return wire.encode(Generate(request_id=request_id, prompt_token_ids=packed, block_hashes=hasher(packed),
                                    params=params))

    def run(request_id: str, ids: list[int]) -> None:
        refused = engine.add_request(decoder.decode(message(request_id, ids)))
        if refused is not None:
            raise RuntimeError(f"{request_id} refused: {refused.error}")
        while engine.has_work:
            engine.step()

    def push_out(name: str) -> None:
        """Distinct prompts that take the whole GPU pool: the prefix goes to the CPU tier."""
        for i in range(num_fillers):
            run(f"{name}-{i}", tokens(prompt_len))
        while engine.idle_write_back():  # as an idle worker does: the burst's evictions find CPU copies
            pass
        if device != "cpu":
            torch.cuda.synchronize()

    def until_first_tokens(count: int) -> None:
        firsts = 0
        while firsts < count and engine.has_work:
            firsts += sum(bool(delta.new_token_ids) for delta in engine.step())

    prefix = tokens(prompt_len)
    run("prefix", prefix + tokens(4))
    times: dict[str, list[float]] = {name: [] for name in PIECES if name != "total"}
    for round_ in range(rounds + 1):  # the first round warms up
        push_out(f"filler-{round_}")
        messages = [message(f"r-{round_}-{i}", prefix + tokens(4)) for i in range(burst)]
        started = time.perf_counter()
        for data in messages:
            engine.add_request(decoder.decode(data))
        taken = time.perf_counter()
        engine.step()  # admits them all; they wait for the shared load
        admitted = time.perf_counter()
        if engine.scheduler.num_awaiting_load != burst:
            raise RuntimeError(f"{engine.scheduler.num_awaiting_load} of {burst} wait for the load: "
                               "the prefix was not in the CPU tier alone")
        until_first_tokens(burst)  # the load lands, then the burst computes
        computed = time.perf_counter()
        while engine.has_work:
            engine.step()
        push_out(f"again-{round_}")
        alone = message(f"alone-{round_}", prefix + tokens(4))
        alone_started = time.perf_counter()
        engine.add_request(decoder.decode(alone))
        until_first_tokens(1)
        alone_ended = time.perf_counter()
        while engine.has_work:
            engine.step()
        if round_:
            for name, seconds, scale in (("intake", taken - started, 1e6 / burst),
                                         ("admission", admitted - taken, 1e6 / burst),
                                         ("compute", computed - admitted, 1e6 / burst),
                                         ("burst_ms", computed - started, 1e3),
                                         ("alone_ms", alone_ended - alone_started, 1e3)):
                times[name].append(seconds * scale)
    medians = {name: statistics.median(values) for name, values in times.items()}
    medians["total"] = medians["intake"] + medians["admission"] + medians["compute"]
    return {name: medians[name] for name in PIECES}


def model_folder(model: str | None, tokenizer_dir: Path | None, prompt_len: int) -> tuple[Path, int]:
    """A built-in config's folder for dummy weights (`model`), else a tiny random Llama's; and
    its vocabulary size."""
    folder = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    if model is not None:
        folder = build_model_folder(model, tokenizer_dir or default_tokenizer_dir(), folder)
        return folder, json.loads((folder / "config.json").read_text())["vocab_size"]
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 512
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=prompt_len + 64)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder, vocab


def measure(tree: Path | None, args) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--prompt-len", str(args.prompt_len), "--burst",
               str(args.burst), "--rounds", str(args.rounds), "--device", args.device]
    if args.model:
        command += ["--model", args.model] + (["--tokenizer-dir", str(args.tokenizer_dir)] if args.tokenizer_dir else [])
    done = subprocess.run(command, env=tree_env(tree), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run of {tree or 'this tree'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=10_000, help="the shared prefix's tokens")
    parser.add_argument("--burst", type=int, default=50, help="requests on the prefix at once")
    parser.add_argument("--baseline", type=Path, help="a source tree to compare against, in the same run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree, alternating")
    parser.add_argument("--rounds", type=int, default=5, help="bursts per run (the median counts)")
    parser.add_argument("--device", default="cpu", help="where the engine runs: cpu (the default) or cuda")
    parser.add_argument("--model", help="a built-in config with dummy weights (default: a tiny random Llama)")
    parser.add_argument("--tokenizer-dir", type=Path, help="--model's tokenizer files (default: the default model's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.prompt_len, args.burst, args.repeats, args.rounds) < 1 or args.prompt_len < 2 * BLOCK_SIZE:
        parser.error(f"--burst, --repeats and --rounds must be at least 1, --prompt-len at least {2 * BLOCK_SIZE}")
    if args.child:
        print(json.dumps(time_burst(args.prompt_len, args.burst, args.rounds, args.device, args.model,
                                    args.tokenizer_dir)))
        return 0
    runs = runs_of_trees(lambda tree: measure(tree, args), args.baseline, args.repeats)
    title = (f"{args.burst} requests on a {args.prompt_len}-token prefix held by the CPU tier alone, worker us per "
             f"request; ms from the burst's first arrival to its last first token and from a lone request's "
             f"arrival to its first token (median of {args.repeats} runs of {args.rounds} bursts), {args.device}, "
             f"{args.model or 'a tiny random Llama'}; machine: {os.cpu_count()} CPUs")
    print_tree_medians(title, runs, PIECES, width=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
