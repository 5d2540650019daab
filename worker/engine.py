"""One engine step: schedule, run the model, sample, update. No sockets here (see main.py)."""

from __future__ import annotations

import logging
import math

import torch

from spillway.kernels.utils import use_programmatic_launch
from spillway.protocol.hashing import root_hash
from spillway.protocol.reasoning import advance, forced_token
from spillway.protocol.messages import (
    FinishReason,
    Generate,
    Ready,
    RequestDelta,
    Stats,
    PROTOCOL_VERSION,
)
from spillway.protocol import envs
from spillway.protocol.config import WorkerConfig
from spillway.worker.config import resolve_device_settings
from spillway.worker.block_manager import BlockManager
from spillway.worker.model_runner import ChunkInput, ModelRunner, num_blocks_for_memory
from spillway.worker.models import loader
from spillway.worker.models import model_class_for
from spillway.worker.models.cpu_linear import pack_linear_layers
from spillway.worker.models.gpu_linear import store_weights_input_major
from spillway.worker.overlap import InFlightStep, TokenReadback, can_overlap, chunk_inputs
from spillway.worker.request import Request, RequestStatus
from spillway.worker.sampler import OutputTokens, Sampler, SamplingInput
from spillway.worker.scheduler import Scheduler, StepPlan

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU device's KV pool: 1 GiB holds ~23k SmolLM2-135M tokens


class Engine:
    """Owns the scheduler, the model runner and the sampler of one worker."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device, self.dtype, self.kv_cache_dtype = resolve_device_settings(config)
        torch.manual_seed(config.seed)
        use_programmatic_launch(config.programmatic_launch)
        files = loader.resolve_model(config.model, config.load_format)
        self.model_name = config.served_model_name or files.name
        hf_config = loader.load_config(files)
        self.max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        self.vocab_size = int(hf_config.vocab_size)
        model = self._build_model(hf_config, files)
        window = getattr(model, "sliding_window", None)
        if window is not None and self.max_model_len > window:
            # Sliding-window attention is not implemented: stay within one window, exactly.
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding "
                                 f"window ({window}), which Spillway does not implement yet")
            self.max_model_len = window
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(8192, config.max_num_seqs)
        self.runner = ModelRunner(model, num_blocks=None, block_size=self.block_size, device=self.device,
                                  dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                                  max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=self.max_num_batched_tokens,
                                  max_model_len=self.max_model_len)
        num_blocks = self._num_blocks(hf_config)
        self.runner.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens in %s", num_blocks, self.block_size,
                    str(self.kv_cache_dtype).removeprefix("torch."))
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs(config.max_num_seqs)
        self.block_manager = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.eos_token_ids = loader.eos_token_ids(files, hf_config)
        self.root_hash = root_hash(config.hash_seed, self.model_name)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            root_hash=self.root_hash,
            eos_token_ids=self.eos_token_ids,
        )
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, device=self.device)
        self.debug_invariants = envs.debug_invariants()
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._readback = TokenReadback(config.max_num_seqs, self.device)
        self._in_flight: InFlightStep | None = None
        self.num_async_steps = 0  # steps launched before the one before was read
        self.num_steps = 0
        self._arrivals = 0

    def _build_model(self, hf_config, files: loader.ModelFiles) -> torch.nn.Module:
        model = model_class_for(hf_config).build(hf_config, device=self.device, dtype=self.dtype)
        if files.load_format == "dummy":
            loader.init_dummy_weights(model, seed=self.config.seed)
        else:
            model.load_weights(loader.iter_weights(files))
        if self.device.type == "cpu":
            packed = pack_linear_layers(model)
            logger.info("CPU linear layers: %s", f"{packed} packed for oneDNN" if packed else "torch sgemm")
        elif self.device.type == "cuda" and self.config.input_major_weights:
            store_weights_input_major(model)
            torch.cuda.empty_cache()  # the row-major copies are gone; give their memory back
        return model.eval()

    def _num_blocks(self, hf_config) -> int:
        if self.config.num_gpu_blocks_override is not None:
            if self.config.num_gpu_blocks_override < 1:
                raise ValueError("num_gpu_blocks_override must be at least 1")
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = num_blocks_for_memory(hf_config, self.block_size, self.kv_cache_dtype, int(budget))
        # No point in more blocks than max_num_seqs full-length requests can use.
        needed = self.config.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        num_blocks = min(num_blocks, needed)
        if num_blocks < math.ceil(self.max_model_len / self.block_size):
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; lower max_model_len or give it more memory"
            )
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        """Bytes for KV: the utilisation's share of the GPU, less what is in use (weights, CUDA
        context, other processes), the peak a step of max_num_batched_tokens adds and the
        decode graphs' logits buffer."""
        activation_peak = self.runner.profile_peak_memory(self.max_num_batched_tokens, self.max_model_len)
        if not self.config.enforce_eager:
            activation_peak += ModelRunner.graph_logits_bytes(self.config.max_num_seqs, self.vocab_size)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        logger.info("GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations and graph buffers, "
                    "%.2f GiB for the KV cache", total / 2**30, (total - free) / 2**30,
                    activation_peak / 2**30, max(budget, 0) / 2**30)
        return int(budget)

    def ready(self) -> Ready:
        return Ready(
            protocol_version=PROTOCOL_VERSION,
            model=self.model_name,
            block_size=self.block_size,
            hash_seed=self.config.hash_seed,
            num_gpu_blocks=self.block_manager.num_gpu_blocks,
            num_cpu_blocks=0,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            enable_prefix_caching=self.config.enable_prefix_caching,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, msg: Generate) -> RequestDelta | None:
        """Queue a request; returns an error delta instead when the worker cannot take it."""
        error = self._check_request(msg)
        if error is not None:
            return RequestDelta(request_id=msg.request_id, new_token_ids=[],
                                finish_reason=FinishReason.ERROR, error=error)
        self._arrivals += 1
        try:
            self.scheduler.add(Request.from_generate(msg, self._arrivals))
        except ValueError as exc:
            return RequestDelta(request_id=msg.request_id, new_token_ids=[],
                                finish_reason=FinishReason.ERROR, error=str(exc))
        return None

    def _check_request(self, msg: Generate) -> str | None:
        num_prompt = len(msg.prompt_token_ids)
        if num_prompt == 0:
            return "the prompt is empty"
        if num_prompt >= self.max_model_len:
            return (f"the prompt has {num_prompt} tokens; max_model_len={self.max_model_len} "
                    "leaves no room for output")
        if min(msg.prompt_token_ids) < 0 or max(msg.prompt_token_ids) >= self.vocab_size:
            return f"prompt token ids must lie in [0, {self.vocab_size})"
        thinking = msg.thinking
        if thinking is not None and (not thinking.start_token_ids or not thinking.end_token_ids
                                     or (thinking.budget is not None and thinking.budget < 0)):
            return "the thinking policy needs start and end markers and a non-negative budget"
        if self.scheduler.has_request(msg.request_id):
            return f"request id {msg.request_id!r} is already in use"
        return None

    def abort(self, request_ids: list[str]) -> list[RequestDelta]:
        aborted = self.scheduler.abort(request_ids)
        for request in aborted:
            self.sampler.forget(request.request_id)
        return [RequestDelta(request_id=r.request_id, new_token_ids=[],
                             finish_reason=FinishReason.ABORT) for r in aborted]

    def abort_all(self) -> int:
        """Abort every request without reporting them (their gateway is gone); how many."""
        return len(self.abort(self.scheduler.request_ids()))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedule and run one step; returns the tokens of the steps completed meanwhile.

        With async scheduling a decode step is launched before the step in flight is read
        (worker/overlap.py), so a step's tokens come back from the next call.
        """
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self.scheduler.mark_in_flight(previous.plan)
        plan = self.scheduler.schedule(ahead=previous is not None)
        if self.async_scheduling and can_overlap(plan):
            chunks, feed = chunk_inputs(plan, previous)
            logits = self.runner.execute(chunks, feed)
            token_ids = self.sampler.sample_ids(logits, [self._sampling_input(c.request) for c in plan.chunks])
            self._in_flight = self._readback.start(plan, token_ids)
            self.num_async_steps += 1
            return [] if previous is None else self._settle(previous.plan, previous.read(), {})
        if previous is None:
            deltas = []
        else:
            deltas = self._settle(previous.plan, previous.read(), {})
            # Requests that the step in flight finished are dropped from the plan made ahead of it.
            plan.chunks = [c for c in plan.chunks if c.request.status == RequestStatus.RUNNING]
        if plan.chunks:
            deltas += self._settle(plan, *self._run(plan))
        return deltas

    def _settle(self, plan: StepPlan, sampled: dict[str, int], logprobs: dict) -> list[RequestDelta]:
        """Apply a computed plan's tokens; the deltas for the gateway."""
        results = self.scheduler.update(plan, sampled)
        self.num_steps += 1
        deltas = []
        for result in results:
            request_id = result.request.request_id
            if result.finish_reason is not None:
                self.sampler.forget(request_id)
            token_logprobs = logprobs.get(request_id)
            deltas.append(RequestDelta(
                request_id=request_id,
                new_token_ids=result.new_token_ids,
                finish_reason=result.finish_reason,
                logprobs=[token_logprobs] if token_logprobs is not None and result.new_token_ids else None,
                num_cached_tokens=result.num_cached_tokens,
            ))
        if self.debug_invariants:
            self.block_manager.check_invariants()
        return deltas

    def _run(self, plan: StepPlan):
        chunks = [
            ChunkInput(c.request.all_token_ids[c.start:c.start + c.num_tokens], c.start, c.block_table)
            for c in plan.chunks
        ]
        logits = self.runner.execute(chunks)
        rows = [i for i, c in enumerate(plan.chunks) if c.sample]
        if not rows:
            return {}, {}
        requests = [plan.chunks[i].request for i in rows]
        inputs = [self._sampling_input(r) for r in requests]
        sampled = self.sampler.sample(logits[rows] if len(rows) < len(chunks) else logits, inputs)
        for request, token in zip(requests, sampled):
            if request.thinking_state is not None:
                request.thinking_state = advance(request.thinking_policy, request.thinking_state, token.token_id)[0]
        tokens = {inp.request_id: s.token_id for inp, s in zip(inputs, sampled)}
        logprobs = {inp.request_id: s.logprobs for inp, s in zip(inputs, sampled) if s.logprobs is not None}
        return tokens, logprobs

    @staticmethod
    def _sampling_input(request: Request) -> SamplingInput:
        forced = None if request.thinking_state is None else forced_token(request.thinking_state)
        return SamplingInput(request.request_id, request.params, request.prompt_token_ids,
                             OutputTokens(request.all_token_ids, request.num_prompt_tokens), forced)

    def stats(self) -> Stats:
        bm, sched = self.block_manager, self.scheduler
        try:
            bm.check_invariants()
            ok = True
        except AssertionError:
            logger.exception("block manager invariants broken")
            ok = False
        return Stats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            gpu_cache_usage=bm.usage,
            num_gpu_blocks=bm.num_gpu_blocks,
            num_free_gpu_blocks=bm.num_free_blocks,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
            invariants_ok=ok,
        )

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
