"""Two engines on the default model (CPU) for the KV transfer tests: a producer and consumers, each
with the process's KV sockets (worker/kv_transfer/links.py) over ipc:// in a private folder, and
the steps a gateway and the busy loop would take, run by hand."""

from __future__ import annotations

import time

from spillway.protocol.config import WorkerConfig
from spillway.protocol.hashing import block_hashes
from spillway.protocol.kv_transfer import KvTransferConfig
from spillway.protocol.local import model_files
from spillway.protocol.messages import Generate, KvSource, RequestDelta, SamplingParams
from spillway.worker.driver.engine import Engine
from spillway.worker.kv_transfer.links import KvLinks

BLOCK = 16
MAX_MODEL_LEN = 128


def kv_engine(role: str, *, num_blocks: int, policy: str = "fail", pull_timeout_s: float = 1.0,
              num_cpu_blocks: int = 0, model: str | None = None, tensor_parallel_size: int = 1) -> Engine:
    """An engine of `role` on a pool of `num_blocks` blocks of 16 tokens, float32 (and a CPU tier
    of `num_cpu_blocks`), of `model` (the default model's folder when None) over `tensor_parallel_size` ranks."""
    return Engine(WorkerConfig(model=model or str(model_files.resolve_model(None).path), device="cpu",
                               dtype="float32", tensor_parallel_size=tensor_parallel_size,
                               max_num_seqs=4, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=num_blocks,
                               num_cpu_blocks_override=num_cpu_blocks,
                               kv_transfer=KvTransferConfig(kv_connector="HostConnector", kv_role=role,
                                                            kv_load_failure_policy=policy)),
                  kv_pull_timeout_s=pull_timeout_s)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(engine: Engine, request_id: str, prompt: list[int], max_tokens: int,
             kv_source: str | None = None) -> Generate:
    """The Generate a gateway sends: the prompt's block hashes, and the producer to pull from."""
    return Generate(request_id=request_id, prompt_token_ids=prompt,
                    block_hashes=block_hashes(prompt, BLOCK, engine.root_hash), params=greedy(max_tokens),
                    kv_source=None if kv_source is None else KvSource(address=kv_source))


def run(engine: Engine, msg: Generate, links: KvLinks | None = None, producer: KvLinks | None = None,
        bound_s: float = 60.0) -> list[RequestDelta]:
    """`msg` run to its end on `engine`, as the busy loop would: pulls sent after the intake, the
    producer's server and this engine's sockets handled, then a step; the request's deltas."""
    error = engine.add_request(msg)
    if error is not None:
        return [error]
    deltas: list[RequestDelta] = []
    deadline = time.monotonic() + bound_s
    while engine.has_work:
        assert time.monotonic() < deadline, "the request did not end"
        if links is not None:
            links.send_pulls()
            if producer is not None:
                producer.handle(20)
            links.handle(20 if engine.waits_for_pulls else 0)
            deltas += links.take_deltas()
        deltas += engine.step()
    return [delta for delta in deltas if delta.request_id == msg.request_id]


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.new_token_ids]


def usable_blocks(prompt: list[int]) -> int:
    """Full prompt blocks a prefix lookup can use: all but a last token's."""
    return (len(prompt) - 1) // BLOCK


def reference(engine: Engine, prompt: list[int], max_tokens: int = 6) -> list[int]:
    """The greedy tokens of `prompt` computed by `engine` alone, from an empty prefix cache."""
    assert engine.reset_prefix_cache()
    computed = tokens(run(engine, generate(engine, "alone", prompt, max_tokens)))
    assert engine.reset_prefix_cache()
    return computed


def prefill(producer: Engine, prompt: list[int], request_id: str = "prefill") -> list[int]:
    """The producer's part: the prompt with max_tokens=1; its blocks stay in its prefix cache."""
    return tokens(run(producer, generate(producer, request_id, prompt, 1)))
