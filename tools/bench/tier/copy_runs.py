"""How many copies the CPU tier's block moves take: the engine on the CPU (a tiny random Llama,
both pools in host memory, the same plan as on a GPU) through conversations whose histories
outgrow the GPU pool, counting each step's planned block pairs and the copies
`block_copies.copy_blocks` launches for them (one per run of consecutive slots). On a GPU each
copy is a host-side launch (~10 us), so a prefix of 626 blocks moved in 626 copies costs a
step ~6 ms of host time that one copy does not.

    python tools/bench/tier/copy_runs.py                         # this tree
    python tools/bench/tier/copy_runs.py --baseline DIR          # and the tree at DIR, same run
                                                           #   (mkdir DIR && git archive REV | tar -x -C DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ("protocol", "gateway", "worker", "kernels")


def forward_runs(pairs) -> int:
    """Copies of a copier that merges only runs going up on both sides (the one before
    `block_runs` existed)."""
    count, index = 0, 0
    while index < len(pairs):
        src, dst = pairs[index]
        length = 1
        while index + length < len(pairs) and pairs[index + length] == (src + length, dst + length):
            length += 1
        count, index = count + 1, index + length
    return count


def count_copies(model_dir: str, conversations: int, turns: int, seed: int) -> dict:
    """The child: pairs and copies per direction over the whole workload."""
    from spillway.protocol.config import WorkerConfig
    from spillway.protocol.messages import Generate, SamplingParams
    from spillway.worker.kv_tier import copier as kv_copies
    from spillway.worker.driver.engine import Engine

    runs = getattr(kv_copies, "block_runs", None)
    copies_of = (lambda pairs: len(runs(pairs))) if runs else forward_runs
    engine = Engine(WorkerConfig(model=model_dir, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=8192,
                                 num_gpu_blocks_override=520, num_cpu_blocks_override=2000))
    totals = {way: [0, 0] for way in ("loads", "stores", "ahead stores")}
    copy_kv = engine.executor.copy_kv

    def counted(copies):
        for way, pairs in (("loads", copies.cpu_to_gpu), ("stores", copies.gpu_to_cpu),
                           ("ahead stores", copies.ahead_to_cpu)):
            totals[way][0] += len(pairs)
            totals[way][1] += copies_of(pairs)
        return copy_kv(copies)

    engine.executor.copy_kv = counted
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    histories = [[rng.randrange(1, 500) for _ in range(1024)] for _ in range(conversations)]
    for turn in range(turns):
        for index, history in enumerate(histories):
            history += [rng.randrange(1, 500) for _ in range(256)]
            engine.add_request(Generate(request_id=f"c{index}-{turn}", prompt_token_ids=list(history),
                                        block_hashes=[], params=params))
            while engine.has_work:
                engine.step()
            while turn % 2 == 0 and engine.idle_write_back():  # idle between some turns
                pass
    return totals


def tiny_model(folder: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def run_child(tree: Path | None, model_dir: str, args) -> dict:
    env = dict(os.environ)
    if tree is not None:  # that tree's packages as spillway's
        site = Path(tempfile.mkdtemp(prefix="tier-copy-runs-site-")) / "spillway"
        site.mkdir()
        for package in PACKAGES:
            (site / package).symlink_to(tree.resolve() / package)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.parent), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, "--child", model_dir, "--conversations", str(args.conversations),
                          "--turns", str(args.turns), "--seed", str(args.seed)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a source tree to count as well, in the same run")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(count_copies(args.child, args.conversations, args.turns, args.seed)))
        return 0
    with tempfile.TemporaryDirectory(prefix="tier-copy-runs-") as tmp:
        model_dir = tiny_model(Path(tmp))
        trees = ([("baseline", args.baseline)] if args.baseline else []) + [("this tree", None)]
        print(f"{args.conversations} conversations x {args.turns} turns (1,024 tokens, then +256 a turn), GPU pool "
              f"520 blocks of 16, CPU tier 2,000; block pairs planned -> copies launched")
        for label, tree in trees:
            totals = run_child(tree, model_dir, args)
            print(f"{label:>10}: " + ", ".join(f"{way} {pairs:,} -> {copies:,}" for way, (pairs, copies)
                                                in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
