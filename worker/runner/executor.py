"""One device's share of the worker: the model, the KV pool and the CUDA graphs.

The driver (worker/driver/engine.py: scheduler, requests, sampler state) sends each step to the
executor as a `PackedStep`, plain data that never points at a request, so the same step can
be broadcast to N executors without change: with tensor parallelism, rank 0's executor sends
each step to the other ranks' (`step_sender`, worker/tp/group.py) before running it itself,
and so the copies between the GPU pool and the CPU tier that run between steps (`copy_sender`).

Start-up, in this order on CUDA (the pool is what is left once the model and one step fit):

    load_model ──► Executor(model) ──► kv_pool_blocks: profile one max_num_batched_tokens step
               ──► allocate_kv_cache(num_blocks) ──► capture_graphs (decode and prefill buckets,
                   the prefill buckets' cascade twins, and verify buckets with speculative decoding)
               ──► warm_up (the eager path's kernel variants)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from spillway.worker.kv_tier.host_pool import allocate_cpu_pool
from spillway.worker.runner.kv_budget import KVBudget
from spillway.worker.kv_tier.copier import KVCopier
from spillway.worker.runner.kv_block_io import KvLayout, read_blocks, write_blocks
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner, TokenFeed, default_backend, latent_rank
from spillway.worker.models import loader, model_class_for
from spillway.protocol.config import QUANTIZATION_METHODS
from spillway.worker.models.cpu_linear import pack_linear_layers
from spillway.worker.models.fp8_checkpoint import dequantized_weights, fp8_checkpoint_of
from spillway.worker.models.fp8_experts import quantize_experts
from spillway.worker.models.fp8_linear import fp8_capability_problem, quantize_linear_layers
from spillway.worker.models.gpu_linear import store_weights_input_major
from spillway.worker.models.shard_loading import load_shard
from spillway.worker.models.tensor_parallel import shard_model
from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU device's KV pool: 1 GiB holds ~23k SmolLM2-135M tokens


@dataclass(slots=True)
class PackedStep:
    """One step as every executor receives it: ints and lists only (msgpack-encodable).

    Chunk `feed_rows[i]` takes its one input token from the device: row `feed_sources[i]` of
    the token ids the step before sampled, not yet read by the host (its `token_ids` hold a
    placeholder). `sample_rows`: the chunks whose last-token logits the sampler reads.
    `logits_rows`: when set, the rows of the step's flattened tokens whose logits are returned
    instead: each sampled chunk's last row (and its drafts' rows, to verify them), then
    `num_prompt_rows` rows that score prompt tokens (prompt_logprobs, worker/sample/logprobs.py).
    """

    chunks: list[ChunkInput]
    feed_rows: list[int]
    feed_sources: list[int]
    sample_rows: list[int]
    kv_copies: KVCopies = NO_KV_COPIES
    logits_rows: list[int] = field(default_factory=list)
    num_prompt_rows: int = 0

    @property
    def verifies(self) -> bool:
        """Draft tokens to verify: sampled chunks with more than their last row read."""
        return len(self.logits_rows) - self.num_prompt_rows > len(self.sample_rows)


def load_model(hf_config, files: loader.ModelFiles, *, device: torch.device, dtype: torch.dtype,
               seed: int, input_major_weights: bool = True, shard: tuple[int, int] | None = None,
               quantization: str | None = None) -> nn.Module:
    """The model with its weights (random ones for the dummy format), laid out for `device`.

    `shard`: `(rank, world_size)` of the default process group. A checkpoint's shard is built
    at its own shapes and reads only its slices (shard_loading.py); dummy weights are generated
    whole from the seed, so that they are the same model whatever the size, then cut. Either
    way before the linear layers are re-laid for the device (both find the shards).

    `quantization` "fp8", or an FP8 checkpoint (fp8_checkpoint.py): the decoder's projections
    run in FP8 (fp8_linear.py), and so do the experts' stacked weights (fp8_experts.py), quantized
    after the cut, so each rank's row scales are its own.
    ValueError for another method, or a GPU without FP8 tensor cores, before anything loads."""
    checkpoint = None if files.load_format == "dummy" else fp8_checkpoint_of(hf_config)
    runs_fp8 = _runs_fp8(quantization, checkpoint is not None, device)
    if shard is not None and files.load_format != "dummy":
        model = load_shard(hf_config, files, *shard, device=device, dtype=dtype)
    else:
        model = model_class_for(hf_config).build(hf_config, device=device, dtype=dtype)
        if files.load_format == "dummy":
            loader.init_dummy_weights(model, seed=seed)
        else:
            model.load_weights(dequantized_weights(loader.iter_weights(files), checkpoint))
        if shard is not None:
            shard_model(model, *shard)
    if runs_fp8:
        projections, expert_stacks = quantize_linear_layers(model), quantize_experts(model)
        logger.info("FP8 weights: %d projections and %d expert stacks quantized per output row", projections,
                    expert_stacks)
    if device.type == "cpu":
        packed = pack_linear_layers(model)
        logger.info("CPU linear layers: %s", f"{packed} packed for oneDNN" if packed else "torch sgemm")
    elif device.type == "cuda" and input_major_weights:
        store_weights_input_major(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the row-major (or unquantized) copies are gone; give their memory back
    return model.eval()


def _runs_fp8(quantization: str | None, fp8_checkpoint: bool, device: torch.device) -> bool:
    """Whether the projections run in FP8; ValueError for a method other than QUANTIZATION_METHODS'
    or a device that cannot."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    runs_fp8 = quantization == "fp8" or fp8_checkpoint
    problem = fp8_capability_problem(device) if runs_fp8 else None
    if problem is not None:
        raise ValueError(problem)
    return runs_fp8


class Executor:
    """Owns the model runner (model, KV pool, graphs) of one device and runs packed steps.
    `speculative`: steps will verify draft tokens, so the runner captures verify graphs too."""

    def __init__(self, model: nn.Module, *, block_size: int, device: torch.device, dtype: torch.dtype,
                 kv_cache_dtype: torch.dtype, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, speculative: bool = False) -> None:
        self.device = device
        self.speculative = speculative
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model, num_blocks=None, block_size=block_size, device=device, dtype=dtype,
                                  kv_cache_dtype=kv_cache_dtype,
                                  backend=default_backend(device, block_size, speculative, model.attention_scale,
                                                          latent_rank(model)),
                                  max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        self.kv_copier: KVCopier | None = None  # with a CPU tier (allocate_cpu_kv_cache)
        # A draft model's pool, taken from the same budget (worker/runner/kv_budget.py): the CPU's
        # fixed budget leaves it out; on CUDA it is measured in use.
        self.draft_kv_bytes = 0
        self._activation_peak_bytes: int | None = None
        # Tensor parallelism, on rank 0: sends each step (and its fed tokens) to the other ranks.
        self.step_sender: Callable[[PackedStep, torch.Tensor | None], None] | None = None
        # ... and each step's-worth of copies between the tiers that runs between steps.
        self.copy_sender: Callable[[KVCopies], None] | None = None

    def kv_budget(self, *, gpu_memory_utilization: float, with_graphs: bool) -> KVBudget:
        """The bytes this device's KV pools may take: on CUDA, the utilisation's share of the GPU
        less what is in use (weights, CUDA context, other processes, a draft model's pool), the
        peak a step of max_num_batched_tokens adds and the graphs' logits buffer
        (`CudaGraphs.logits_bytes`, larger with verify graphs); on the CPU, 1 GiB less
        `draft_kv_bytes`."""
        if self.device.type != "cuda":
            return KVBudget(max(0, CPU_KV_CACHE_BYTES - self.draft_kv_bytes), gpu_memory_utilization)
        activation_peak = self._activation_peak()
        if with_graphs:
            activation_peak += self.runner.cuda_graphs.logits_bytes(self.max_num_seqs, self.speculative)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * gpu_memory_utilization - (total - free) - activation_peak
        logger.info("GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations and graph "
                    "buffers, %.2f GiB for the KV cache", total / 2**30, (total - free) / 2**30,
                    activation_peak / 2**30, max(budget, 0) / 2**30)
        return KVBudget(max(0, int(budget)), gpu_memory_utilization, total)

    def kv_pool_blocks(self, *, gpu_memory_utilization: float, with_graphs: bool) -> int:
        """How many KV blocks fit this device's budget (`kv_budget`). A block holds this
        device's KV heads only (a tensor-parallel rank's share: `ModelRunner.kv_block_bytes`)."""
        return self.kv_budget(gpu_memory_utilization=gpu_memory_utilization,
                              with_graphs=with_graphs).blocks(self.runner.kv_block_bytes)

    def _activation_peak(self) -> int:
        """Peak bytes a step of max_num_batched_tokens prefill tokens allocates beyond the
        weights, measured once (a draft model's share and the pool are sized from it)."""
        if self._activation_peak_bytes is None:
            self._activation_peak_bytes = self._measure_activation_peak()
        return self._activation_peak_bytes

    @torch.inference_mode()
    def _measure_activation_peak(self) -> int:
        """Runs one forward of max_num_batched_tokens tokens (sequences of at most
        `max_model_len - 1` tokens) into a throwaway KV cache, then logits and a sort for
        `max_num_seqs` rows as the sampler would. The throwaway cache itself is not counted."""
        runner, num_tokens = self.runner, self.max_num_batched_tokens
        assert self.device.type == "cuda" and runner.kv_cache is None
        seq_len = max(1, min(num_tokens, self.max_model_len - 1))
        lengths = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        lengths = lengths[: self.max_num_seqs]
        blocks = [math.ceil(n / runner.block_size) for n in lengths]
        runner.allocate_kv_cache(sum(blocks))
        tables, first = [], 0
        for count in blocks:
            tables.append(list(range(first, first + count)))
            first += count
        chunks = [ChunkInput([0] * n, 0, table) for n, table in zip(lengths, tables)]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        runner.execute(chunks)  # eager: no graph is captured yet
        hidden = torch.zeros(self.max_num_seqs, runner.model.spec.hidden_size, device=self.device, dtype=runner.dtype)
        runner.model.compute_logits(hidden).softmax(dim=-1).sort(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        runner.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens in %s", num_blocks, self.runner.block_size,
                    str(self.runner.kv_cache_dtype).removeprefix("torch."))

    def allocate_cpu_kv_cache(self, num_blocks: int, *, load_bytes_per_s: float, load_burst_s: float,
                              load_speed_guess: float, size_setting: str = "cpu_offload_gb") -> None:
        """The CPU tier's pool (pinned on CUDA), after the GPU pool; ValueError beyond the
        host's available memory, naming `size_setting`. The loads' pace while others compute,
        what a quiet spell saves up of it, and their speed until timed: `KVCopier`."""
        runner = self.runner
        cpu_pool = allocate_cpu_pool(num_blocks, runner.kv_cache_shape, runner.kv_cache_dtype,
                                     pinned=self.device.type == "cuda", size_setting=size_setting)
        self.kv_copier = KVCopier(runner.kv_cache, cpu_pool, load_bytes_per_s, load_burst_s, load_speed_guess)
        logger.info("CPU KV tier: %d blocks, %.2f GiB of %s host memory", num_blocks, cpu_pool.nbytes / 2**30,
                    "pinned" if self.device.type == "cuda" else "plain")

    def copy_kv(self, copies: KVCopies) -> None:
        """Start copies between the tiers that run between steps (worker/kv_tier/copier.py): a
        step without chunks, write-backs while idle; on every rank (`copy_sender`)."""
        if self.copy_sender is not None:
            self.copy_sender(copies)
        self._run_copies(copies)

    def follow_copies(self, copies: KVCopies | None = None) -> None:
        """On a tensor-parallel rank other than 0: everything that follows waits for every copy
        queued so far (rank 0 plans by its own landings, which this rank's may trail); then
        `copies`, when given, start."""
        if self.kv_copier is not None:
            self.kv_copier.wait_for_queued()
        if copies is not None:
            self._run_copies(copies)

    def _run_copies(self, copies: KVCopies, pace: bool = False) -> list[torch.cuda.Event] | None:
        """Start a step's copies between the tiers (`pace`: its forward runs beside the loads).
        Returns the events its forward waits for layer by layer, if it does (`KVCopier.run`)."""
        if self.kv_copier is None:
            # Only the CPU tier plans copies; a plan with some cannot be run without it.
            raise ValueError("the step asks for KV copies between tiers, and this worker has no CPU tier")
        return self.kv_copier.run(copies, pace)

    def kv_layout(self) -> KvLayout:
        """The dtype and shape of one block of the KV pool, as another worker's must match."""
        return KvLayout.of(self.runner.kv_cache)

    @property
    def tier_pool(self) -> torch.Tensor | None:
        """The CPU tier's pool (host memory), None without a tier."""
        return None if self.kv_copier is None else self.kv_copier.cpu_pool

    def wait_for_stores(self) -> None:
        """The host waits until every store into the CPU tier queued so far is in host memory:
        a tensor-parallel rank other than 0, about to read its tier for rank 0, which knows only
        its own stores landed."""
        if self.kv_copier is not None and self.kv_copier.store_stream is not None:
            self.kv_copier.store_stream.synchronize()

    def read_kv_blocks(self, prefix: ReadablePrefix) -> np.ndarray:
        """The KV of `prefix`'s blocks, in its order, as bytes in new host memory: those in the
        GPU pool read after every step launched, those in the CPU tier's pool copied on the host
        (worker/runner/kv_block_io.py)."""
        if prefix.cpu_reads and self.kv_copier is None:
            raise ValueError("KV blocks to read from a CPU tier, and this worker has none")
        tier_pool = self.kv_copier.cpu_pool if prefix.cpu_reads else None
        return read_blocks(self.runner.kv_cache, prefix.gpu_reads, prefix.num_blocks, tier_pool, prefix.cpu_reads)

    def write_kv_blocks(self, payload: memoryview | bytes, pairs: Sequence[tuple[int, int]]) -> None:
        """Block `index` of `payload` into pool slot `slot`, for each `(index, slot)` of `pairs`,
        ahead of any step launched after it (worker/runner/kv_block_io.py)."""
        write_blocks(self.runner.kv_cache, payload, pairs)

    def capture_graphs(self) -> None:
        self.runner.capture_graphs(self.max_num_seqs, verify=self.speculative)

    def warm_up(self) -> None:
        """Compile the kernels an eager step needs before the first request (CUDA only)."""
        if self.device.type == "cuda":
            self.runner.warm_up()

    def execute(self, step: PackedStep, fed_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of the sampled chunks' last tokens, `[len(step.sample_rows), vocab]`
        (of `step.logits_rows` instead when set).

        `fed_tokens`: the step before's sampled ids on the device, when `step.feed_rows` is
        set. The result may be a view of a buffer that the next step overwrites.
        """
        if self.step_sender is not None:
            self.step_sender(step, fed_tokens if step.feed_rows else None)
        layer_ready = None
        if step.kv_copies != NO_KV_COPIES:
            layer_ready = self._run_copies(step.kv_copies, pace=True)
        feed = TokenFeed(step.feed_rows, step.feed_sources, fed_tokens) if step.feed_rows else None
        if step.logits_rows:
            return self.runner.execute(step.chunks, feed, step.logits_rows, layer_ready=layer_ready)
        logits = self.runner.execute(step.chunks, feed, layer_ready=layer_ready)
        if len(step.sample_rows) == len(step.chunks):
            return logits
        return logits[step.sample_rows]
