"""The driver of one worker: requests, scheduler and sampler state, and the step pipeline.

One step takes one path, plan -> inputs -> execute -> sample -> commit (worker/driver/pipeline.py);
the executor (worker/runner/executor.py) owns the model, the KV pool and the graphs. No sockets
here (see main.py).

Disaggregated prefill and decode (protocol/kv_transfer.py) meet the engine in four verbs: a
producer's `serve_kv_pull` reads the blocks a consumer asks for out of its GPU pool or CPU tier; a consumer holds
a request with `Generate.kv_source` apart (`KvPulls`, worker/driver/kv_pulls.py) until
`take_kv_blocks` brings its answer, whose blocks it adopts into its prefix cache and pool, or
until its pull fails (`fail_kv_pull`, or no answer in time); `take_kv_pulls` hands out the pulls
to send. The process's KV links (worker/kv_transfer/) carry them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import numpy as np
import torch

from spillway.kernels.utils import use_programmatic_launch
from spillway.protocol.hashing import root_hash
from spillway.protocol.kv_transfer import KV_PULL_TIMEOUT_S, KvBlocks, KvPull
from spillway.protocol.messages import FinishReason, Generate, KvEvents, Ready, RequestDelta, Stats
from spillway.protocol.local import envs
from spillway.protocol.config import WorkerConfig
from spillway.protocol.attention_backends import backend_problem, uses_latent_attention
from spillway.protocol.reasoning import forced_token
from spillway.worker.attention.requested_backend import requested_backend_note
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.kv_events import KvEventReplay
from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.runner.device_settings import resolve_device_settings
from spillway.worker.kv_tier.host_pool import check_host_memory, time_host_to_device
from spillway.worker.runner.executor_start import build_executor, draft_pool_blocks, finish_start, pool_blocks
from spillway.worker.runner.kv_blocks import num_blocks_for_memory
from spillway.worker.sample.logprobs import first_delta_prompt_logprobs, record_prompt_logprobs
from spillway.worker.runner.executor import PackedStep
from spillway.worker.runner.model_runner import ModelRunner
from spillway.worker.runner.kv_head_groups import regroup
from spillway.worker.models import loader
from spillway.worker.models.spec import kv_cache_row
from spillway.worker.driver.commit_order import (AFTER_LAUNCH, BEFORE_LAUNCH, BEFORE_PLAN, FINISHED, NEXT_CALL,
                                                 NOTHING, RUNNING, Commit, CommitOrder, commit_order)
from spillway.worker.driver.constrained import ConstrainedRequests
from spillway.worker.driver.kv_pulls import (KvPulls, KvTransferCounters, PendingPull, answer_problem,
                                             kv_transfer_refusal)
from spillway.worker.driver.pipeline import LaunchedStep, TokenReadback, pack_step
from spillway.worker.core.request import Request, refusal
from spillway.worker.sample.grammars import GrammarCompiler
from spillway.worker.sample.sampler import Sampler, SamplingInput
from spillway.worker.core.scheduler import Scheduler
from spillway.worker.speculative.decoder import SpecDecoder
from spillway.worker.speculative.setup import build_spec_decoder
from spillway.worker.driver.stats import collect_stats, ready_message
from spillway.worker.driver.tier_driver import NullTierDriver, TierDriver, write_ahead_blocks
from spillway.worker.driver.timing import LinkTiming, StepTiming
from spillway.worker.tp.group import RankGroup, check_tensor_parallel, share_from_rank_zero
from spillway.worker.core.step_plan import NO_KV_COPIES, StepPlan

logger = logging.getLogger(__name__)


class Engine:
    """Owns the scheduler, the sampler and the requests of one worker; drives its executor.

    `defer_release`: finished requests' blocks are freed by `release_finished` (the busy loop
    calls it once their deltas are sent), not when their last token is committed.
    `kv_pull_timeout_s`: how long a consumer waits for a pull's answer (module doc)."""

    def __init__(self, config: WorkerConfig, *, defer_release: bool = False,
                 kv_pull_timeout_s: float = KV_PULL_TIMEOUT_S) -> None:
        self.config = config
        if problem := kv_transfer_refusal(config):  # before the model loads
            raise ValueError(problem)
        if config.cpu_offload_gb and config.num_cpu_blocks_override is None:
            # Refused before the model loads.
            check_host_memory(int(config.cpu_offload_gb * 2**30), config.setting("cpu_offload_gb"))
        self.device, self.dtype, self.kv_cache_dtype = resolve_device_settings(config)
        torch.manual_seed(config.seed)
        use_programmatic_launch(config.programmatic_launch)
        files = loader.resolve_model(config.model, config.load_format)
        self.model_name = config.served_model_name or files.name
        hf_config = loader.load_config(files)
        self.vocab_size = int(hf_config.vocab_size)
        latent = uses_latent_attention(hf_config.to_dict())
        if config.attention_backend is not None and (problem := backend_problem(config.attention_backend, latent)):
            raise ValueError(f"{config.spell('attention_backend', config.attention_backend)}: {problem}")
        self.group: RankGroup | None = None  # tensor parallelism: the other ranks
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(config, hf_config, self.device)
            self.group = RankGroup(config, self.device)
            self.device = self.group.device
        self.executor, limits = build_executor(config, files, hf_config, device=self.device, dtype=self.dtype,
                                               kv_cache_dtype=self.kv_cache_dtype,
                                               shard=self.group.shard if self.group else None)
        self.max_model_len, self.max_num_batched_tokens = limits.max_model_len, limits.max_num_batched_tokens
        if config.attention_backend is not None:
            logger.info(requested_backend_note(config.attention_backend, self.executor.runner.backend, latent=latent))
        self.block_size = config.block_size
        self.eos_token_ids = loader.eos_token_ids(files, hf_config)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, device=self.device)
        self.constrained = ConstrainedRequests(GrammarCompiler(files, self.vocab_size, self.eos_token_ids),
                                               config.max_num_seqs, self.device, config.grammar_compile_timeout_s)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:  # before the pool is sized: a draft model takes its share first
            self.spec = build_spec_decoder(
                config.speculative, self.sampler, target_vocab_size=self.vocab_size, device=self.device,
                dtype=self.dtype, max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
                cuda_graphs=self.device.type == "cuda" and not config.enforce_eager,
                draft_pool_blocks=lambda block_bytes: draft_pool_blocks(self.executor, config, limits, block_bytes))
        num_blocks = pool_blocks(self.executor, config, limits, tensor_parallel=self.group is not None)
        self.executor.allocate_kv_cache(num_blocks)
        # What another worker's blocks must match (a tensor-parallel worker's: every rank's share),
        # up to the grouping of the model's KV heads over the ranks.
        self.num_kv_heads = kv_cache_row(hf_config)[1]
        self.kv_layout = (self.executor.kv_layout() if self.group is None
                          else self.group.kv_layout(self.executor.runner.kv_cache))
        self.kv_pulls = KvPulls(kv_pull_timeout_s)
        self.kv_counters = KvTransferCounters()
        # The deadlines and budgets scale with the model's step as this device runs it, the CPU
        # tier's write-back with its link (worker/driver/timing.py).
        decode_step_s = finish_start(self.executor, config)
        self.timing = StepTiming.derive(decode_step_s)
        logger.info("decode step: %.3f ms", decode_step_s * 1e3)
        num_cpu_blocks = self._num_cpu_blocks(hf_config)
        if self.group is not None:  # each rank's tier holds its own heads of the same blocks
            share_from_rank_zero(num_cpu_blocks, self.device)
        link: LinkTiming | None = None
        if num_cpu_blocks:
            copy_bytes_per_s = time_host_to_device(self.device)
            link = LinkTiming.derive(copy_bytes_per_s)
            logger.info("host-to-device copy: %.1f GB/s", copy_bytes_per_s / 1e9)
            self.executor.allocate_cpu_kv_cache(num_cpu_blocks, load_bytes_per_s=config.kv_load_gb_s * 1e9,
                                                load_burst_s=self.timing.load_burst_s,
                                                load_speed_guess=link.load_speed_guess,
                                                size_setting=config.setting("cpu_offload_gb"))
        if self.group is not None:
            self.executor.step_sender = self.group.send_step
            self.executor.copy_sender = self.group.send_kv_copies
        self.block_manager = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching, num_cpu_blocks,
                                          kv_events=config.kv_events)
        self.root_hash = root_hash(config.hash_seed, self.model_name)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            root_hash=self.root_hash,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            write_ahead_blocks=(0 if link is None else
                                write_ahead_blocks(self.executor.runner.kv_block_bytes, link.write_ahead_bytes)),
            defer_release=defer_release,
        )
        self.tier: TierDriver | NullTierDriver = NullTierDriver() if link is None else TierDriver(
            self.block_manager, self.scheduler, self.executor, self.timing.landing, link.idle_write_ahead_bytes)
        self.debug_invariants = envs.debug_invariants()
        # In debug mode, a gateway's view of the KV events taken, checked against the cache at each take.
        self._kv_replay = KvEventReplay() if config.kv_events and self.debug_invariants else None
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._readback = TokenReadback(config.max_num_seqs, self.device,
                                       by_kernel=self.tier.small_copies_by_kernel)
        self._in_flight: LaunchedStep | None = None
        self._holding = False  # the step in flight is left there while loads land (TierDriver.hold_in_flight)
        self.num_async_steps = 0  # steps launched before the one before was committed
        self.last_plan: StepPlan | None = None  # for the step trace (worker/step_trace.py)
        self.num_steps = 0
        self._arrivals = 0

    @property
    def runner(self) -> ModelRunner:
        """The executor's model runner (benchmarks reach the graphs and the KV pool through it)."""
        return self.executor.runner

    def _num_cpu_blocks(self, hf_config) -> int:
        config = self.config
        if config.num_cpu_blocks_override is not None:
            return config.num_cpu_blocks_override
        return num_blocks_for_memory(hf_config, self.block_size, self.kv_cache_dtype,
                                     int(config.cpu_offload_gb * 2**30))

    def ready(self, kv_address: str = "") -> Ready:
        """`kv_address`: where this producer's KV server listens ("": none)."""
        return ready_message(self.config, self.block_manager, model=self.model_name, max_model_len=self.max_model_len,
                             max_num_batched_tokens=self.max_num_batched_tokens, vocab_size=self.vocab_size,
                             eos_token_ids=self.eos_token_ids, device=str(self.device), dtype=str(self.dtype),
                             kv_address=kv_address)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, msg: Generate) -> RequestDelta | None:
        """Queue a request; returns an error delta instead when the worker cannot take it
        (`worker.request.refusal` says why)."""
        self._arrivals += 1
        try:
            request = Request.from_generate(msg, self._arrivals)
            if msg.kv_source is not None:  # prefilled elsewhere: its blocks come first
                self._hold_for_blocks(request, msg.kv_source.address)
            else:
                self._release(request)
        except ValueError as exc:
            return _error(msg.request_id, str(exc))
        return None

    def _release(self, request: Request, compile: tuple[Future, float] | None = None) -> None:
        """Into the scheduler, or, with a grammar, the constrained queue (it joins the scheduler
        once its grammar compiled: the `compile` begun for it, if one was); ValueError for a
        request refused."""
        if request.params.structured is not None:
            self.constrained.add(request, compile)
        else:
            self.scheduler.add(request)

    def _admit_compiled(self) -> list[RequestDelta]:
        """Constrained requests whose grammar compiled join the scheduler; the deltas of those
        refused (their grammar, or the scheduler's checks)."""
        if not self.constrained.num_compiling:
            return []
        ready, refused = self.constrained.ready()
        for request in ready:
            try:
                self.scheduler.add(request)
            except ValueError as exc:
                refused.append(RequestDelta(request_id=request.request_id, new_token_ids=[],
                                            finish_reason=FinishReason.ERROR, error=str(exc)))
        return refused

    def abort(self, request_ids: list[str]) -> list[RequestDelta]:
        aborted = (self.kv_pulls.abort(request_ids) + self.constrained.abort(request_ids)
                   + self.scheduler.abort(request_ids))
        for request in aborted:
            self._forget(request.request_id)
        return [RequestDelta(request_id=r.request_id, new_token_ids=[],
                             finish_reason=FinishReason.ABORT) for r in aborted]

    def abort_all(self) -> int:
        """Abort every request without reporting them (their gateway is gone); how many."""
        return len(self.abort(self.scheduler.request_ids() + self.constrained.request_ids()
                              + self.kv_pulls.request_ids()))

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_unfinished or self._in_flight is not None
                or self.constrained.num_compiling > 0 or len(self.kv_pulls) > 0)

    @property
    def waits_for_pulls(self) -> bool:
        """Nothing to compute, nothing compiling, and requests wait for their KV pulls: the busy
        loop then waits for messages (an answer among them) up to `kv_pull_wait_s`."""
        return (len(self.kv_pulls) > 0 and not self.scheduler.has_unfinished and self._in_flight is None
                and not self.constrained.num_compiling)

    def kv_pull_wait_s(self) -> float:
        """Seconds until the first pull's deadline (inf while none has been sent)."""
        return max(0.0, self.kv_pulls.seconds_to_deadline(time.monotonic()))

    @property
    def waits_for_loads(self) -> bool:
        """Nothing to compute until loads from the CPU tier land: the last plan was empty, no
        step is in flight (or one left there while they land), and requests wait for their
        blocks (the busy loop then polls the inbox with a short timeout instead of spinning)."""
        plan = self.last_plan
        return ((self._in_flight is None or self._holding) and plan is not None and not plan.chunks
                and self.scheduler.num_awaiting_load > 0)

    def awaited_load_landed(self) -> bool:
        """While `waits_for_loads`: whether a load some request waits for has landed, so the
        next step computes (the busy loop stops taking arrivals in to run it)."""
        return self.tier.awaited_load_landed()

    # ---- KV transfer between workers (module doc) ------------------------------------------

    def _hold_for_blocks(self, request: Request, address: str) -> None:
        """Hold a request prefilled by the producer at `address` until the prompt blocks this
        worker lacks have been pulled from it; released at once when it lacks none.
        ValueError for a request refused."""
        kv = self.config.kv_transfer
        if kv is None or not kv.consumes:
            role = "none" if kv is None else kv.kv_role
            raise ValueError(f"the request names a KV source ({address}), and this worker is no KV consumer "
                             f"(its kv_role: {role})")
        in_use = (self.scheduler.has_request(request.request_id) or request.request_id in self.kv_pulls
                  or request.request_id in self.constrained.request_ids())
        if problem := refusal(request, max_model_len=self.max_model_len, block_size=self.block_size,
                              vocab_size=self.vocab_size, in_use=in_use):
            raise ValueError(problem)
        self.scheduler.hash_prompt(request)
        missing = self._missing_blocks(request)
        if not missing:
            self._release(request)
            return
        # A grammar compiles while the blocks travel: the request is ready when both are.
        compile = self.constrained.start(request) if request.params.structured is not None else None
        self.kv_pulls.add(request, address, missing, compile)

    def _missing_blocks(self, request: Request) -> list[bytes]:
        """The prompt's block hashes a prefix lookup could use and this worker does not hold,
        from the first it lacks. The last prompt token is always computed (its logits give the
        first output), so a prompt of whole blocks uses all but its last; one that asks for
        prompt logprobs reads no cache at all (worker/core/admission.py)."""
        if request.params.prompt_logprobs is not None:
            return []
        usable = request.block_hashes[:(request.num_prompt_tokens - 1) // self.block_size]
        return usable[len(self.block_manager.look_up(usable)):]

    def take_kv_pulls(self) -> list[tuple[str, KvPull]]:
        """(producer address, pull) for each request held since the last call: to send now,
        their deadlines start."""
        return self.kv_pulls.take_outgoing(time.monotonic()) if self.kv_pulls else []

    def take_kv_blocks(self, answer: KvBlocks, payload: memoryview | bytes | None) -> list[RequestDelta]:
        """A producer's answer to a pull, with `payload`, the frame after it (None when the
        answer came with another number of frames). Checked, its blocks this worker lacks are
        adopted into the prefix cache and written into their slots before any later step, and
        the request is released to run; a failed check applies kv_load_failure_policy. An answer
        no request waits for (aborted, failed, answered) is dropped. Returns error deltas."""
        pending = self.kv_pulls.answered(answer.transfer_id)
        if pending is None:
            logger.debug("a KV answer for %r, which no request waits for: dropped", answer.transfer_id)
            return []
        problem = answer_problem(answer, pending.block_hashes, None if payload is None else len(payload),
                                 self.model_name, self.kv_layout, self.num_kv_heads)
        if problem is not None:
            return self._kv_pull_failed(pending, problem)
        received = len(payload)
        if tuple(answer.block_shape) != self.kv_layout.block_shape:  # a producer of another tensor-parallel size
            payload = regroup(payload, len(answer.block_hashes), answer.block_shape, self.kv_layout.block_shape,
                              self.num_kv_heads, self.kv_layout.itemsize)
        adopted = self.block_manager.adopt(answer.block_hashes)
        if adopted:
            # The slots taken may have evicted cached blocks whose write-back to the CPU tier
            # reads them: those copies go first (the payload's write is queued behind them).
            if (copies := self.block_manager.take_copies()) is not NO_KV_COPIES:
                self.executor.copy_kv(copies)
            index = {block_hash: position for position, block_hash in enumerate(answer.block_hashes)}
            self._write_kv_blocks(payload, [(index[block_hash], slot) for block_hash, slot in adopted])
            if self.debug_invariants:
                self.block_manager.check_invariants()
        self.kv_counters.received(received, time.monotonic() - pending.sent)
        return self._release_or_refuse(pending)

    def fail_kv_pull(self, transfer_id: str, problem: str) -> list[RequestDelta]:
        """The pull `transfer_id` cannot be sent or answered (`problem`): kv_load_failure_policy."""
        pending = self.kv_pulls.answered(transfer_id)
        return [] if pending is None else self._kv_pull_failed(pending, problem)

    def kv_source_lost(self, address: str) -> list[RequestDelta]:
        """The gateway lost the producer at `address`: every pull waiting on it fails now."""
        deltas = []
        for request_id in self.kv_pulls.waiting_on(address):
            deltas += self.fail_kv_pull(request_id, "the gateway lost that prefill worker")
        return deltas

    def _expire_kv_pulls(self) -> list[RequestDelta]:
        deltas = []
        for pending in self.kv_pulls.expired(time.monotonic()):
            deltas += self._kv_pull_failed(pending, f"no answer within {self.kv_pulls.timeout_s:g} s")
        return deltas

    def _kv_pull_failed(self, pending: PendingPull, problem: str) -> list[RequestDelta]:
        """"fail": the request ends with an error naming the producer and why; "recompute": it
        runs, computing the blocks it lacks."""
        self.kv_counters.failures += 1
        error = f"the KV transfer from {pending.address} failed: {problem}"
        if self.config.kv_transfer.kv_load_failure_policy == "fail":
            return [_error(pending.request.request_id, error)]
        self.kv_pulls.warn(f"{error}; the prompt is computed instead (kv_load_failure_policy recompute)")
        return self._release_or_refuse(pending)

    def _release_or_refuse(self, pending: PendingPull) -> list[RequestDelta]:
        request = pending.request
        try:
            self._release(request, pending.compile)
        except ValueError as exc:
            return [_error(request.request_id, str(exc))]
        return []

    def serve_kv_pull(self, pull: KvPull) -> tuple[KvBlocks, np.ndarray | bytes]:
        """A producer's answer to `pull` and its payload: the longest run of the hashes asked,
        from the first, whose blocks this worker holds and may read now, in its GPU pool or in
        its CPU tier's host memory (`BlockManager.readable_prefix`, once the tier's stores that
        have landed are known), gathered in that order into new host memory: the GPU blocks
        after every step launched so far, the CPU ones on the host. The payload points into
        neither pool, so a slot reused after this returns cannot change what is sent."""
        self.tier.stores_landed()
        prefix = self.block_manager.readable_prefix(pull.block_hashes)
        payload = self._read_kv_blocks(prefix) if prefix.num_blocks else b""
        return self._kv_answer(pull.transfer_id, pull.block_hashes[:prefix.num_blocks]), payload

    def _read_kv_blocks(self, prefix: ReadablePrefix) -> np.ndarray:
        if self.group is None:
            return self.executor.read_kv_blocks(prefix)
        return self.group.read_kv_blocks(self.executor.runner.kv_cache, prefix, self.executor.tier_pool)

    def _write_kv_blocks(self, payload: memoryview | bytes, pairs: list[tuple[int, int]]) -> None:
        if self.group is None:
            self.executor.write_kv_blocks(payload, pairs)
        else:
            self.group.write_kv_blocks(self.executor.runner.kv_cache, payload, pairs)

    def kv_refusal(self, transfer_id: str, error: str) -> KvBlocks:
        """The answer to a pull that cannot be served (`error`), with no blocks."""
        return self._kv_answer(transfer_id, [], error)

    def _kv_answer(self, transfer_id: str, block_hashes: list[bytes], error: str = "") -> KvBlocks:
        layout = self.kv_layout
        return KvBlocks(transfer_id=transfer_id, block_hashes=block_hashes, model=self.model_name,
                        dtype=layout.dtype, block_shape=list(layout.block_shape), error=error)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """plan -> launch -> commit; returns the deltas of the steps committed meanwhile.
        `commit_order` (worker/driver/commit_order.py) places the commits of the step in flight
        and of the step launched now around the plan and the launch; each goes through
        `_commit_due`. A plan that runs ahead (asynchronous scheduling) is launched before the
        step in flight is committed, and is itself committed by the next call."""
        compiled = self._admit_compiled()
        if self.kv_pulls:
            compiled = self._expire_kv_pulls() + compiled
        if ((self.constrained.num_compiling or self.kv_pulls) and not self.scheduler.has_unfinished
                and self._in_flight is None):
            # Nothing to run until a grammar compiles: wait for one as long as the busy loop
            # would take messages in, so arrivals and aborts are not held back. (Pulls are
            # waited for by the busy loop, whose poll an answer ends.)
            if self.constrained.num_compiling:
                self.constrained.wait(self.timing.drain_budget_s)
            self.last_plan = None  # no step: nothing for the step trace or the iteration counts
            return compiled
        return compiled + self._step() if compiled else self._step()

    def _step(self) -> list[RequestDelta]:
        previous = self._in_flight
        self.tier.before_step()
        lookahead = 0 if self.spec is None else self.spec.lookahead(self.scheduler.num_running)
        state = (NOTHING if previous is None
                 else RUNNING if lookahead or not previous.finished() else FINISHED)
        order = commit_order(state, lookahead)  # before planning: whether `previous` goes first
        deltas = self._commit_due(BEFORE_PLAN, order, previous, None, [])
        if order.in_flight is BEFORE_PLAN:
            previous = None
        plan = self._plan(previous, lookahead)
        holds = previous is not None and not plan.chunks and self.tier.hold_in_flight(previous)
        order = commit_order(state, lookahead, holds, self.async_scheduling and plan.run_ahead)
        self._holding = order.in_flight is NEXT_CALL
        deltas = self._commit_due(BEFORE_LAUNCH, order, previous, None, deltas)
        if order.in_flight is BEFORE_LAUNCH:
            plan.drop_finished()
        if not plan.chunks:
            if plan.kv_copies is not NO_KV_COPIES:  # loads for requests that start next step
                self.executor.copy_kv(plan.kv_copies)
            return deltas
        ahead = order.launched is NEXT_CALL
        if ahead and plan.samples_after_commit:
            # The forward runs on the device while the step before is committed, whose tokens
            # advance the grammars; then the masks are filled and the sampling launched.
            forward = self._forward(plan, previous)
            deltas = self._commit_due(AFTER_LAUNCH, order, previous, None, deltas)
            launched = self._sample(plan, forward, ahead)
        else:
            launched = self._launch(plan, previous if ahead else None, ahead)
            deltas = self._commit_due(AFTER_LAUNCH, order, previous, launched, deltas)
        if ahead:
            # After that commit, which settles the counts of the requests `plan` continues.
            self.scheduler.mark_in_flight(plan)
            self._in_flight = launched
            self.num_async_steps += 1
        return deltas

    def _plan(self, in_flight: LaunchedStep | None, lookahead: int) -> StepPlan:
        """The scheduler's plan, with drafts where it reserved slots; `in_flight`: the step
        still on the device, whose tokens the plan counts as pending."""
        # Nothing runs (or only a step planned so) and the loads the requests wait for are
        # about to land: plan them now, their forward queued behind the loads
        # (TierDriver.plan_before_landing).
        before_landing = self.tier.plan_before_landing(in_flight)
        plan = self.last_plan = self.scheduler.schedule(ahead=in_flight is not None, lookahead=lookahead,
                                                        before_landing=before_landing)
        if lookahead:
            self.spec.propose(plan)  # a plan with drafts does not run ahead
        return plan

    def _commit_due(self, point: Commit, order: CommitOrder, previous: LaunchedStep | None,
                    launched: LaunchedStep | None, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Commit the step that `order` places at `point` (at most one is): the step in flight
        or the one launched now; its deltas follow `deltas`."""
        if order.in_flight is point:
            self._in_flight = None
            step = previous
        elif order.launched is point:
            step = launched
        else:
            return deltas
        committed = self._commit(step)
        return deltas + committed if deltas else committed

    def _launch(self, plan: StepPlan, previous: LaunchedStep | None, ahead: bool) -> LaunchedStep:
        """Inputs, execute, sample: everything up to the tokens, read by no host code.
        `ahead`: the step is committed one step later; `previous` feeds its pending tokens."""
        return self._sample(plan, self._forward(plan, previous), ahead)

    def _forward(self, plan: StepPlan, previous: LaunchedStep | None) -> tuple[PackedStep, torch.Tensor]:
        """The step's inputs and forward, launched: the packed step and the sampled rows' logits."""
        packed = pack_step(plan, previous)
        logits = self.executor.execute(packed, previous.token_ids if packed.feed_rows else None)
        if packed.num_prompt_rows:
            record_prompt_logprobs(plan, logits[len(logits) - packed.num_prompt_rows:])
            logits = logits[:len(logits) - packed.num_prompt_rows]
        return packed, logits

    def _sample(self, plan: StepPlan, forward: tuple[PackedStep, torch.Tensor], ahead: bool) -> LaunchedStep:
        """The tokens of a launched forward: drafts verified, or sampled under the masks of the
        constrained rows (filled on the host now, while the device may still run the forward)."""
        packed, logits = forward
        if not packed.sample_rows:
            return self._readback.start(plan, [], None, {}, ahead)
        requests = [plan.chunks[row].request for row in packed.sample_rows]
        if packed.verifies:  # draft tokens to verify: committed at once
            verified = self.spec.verify(logits, plan, packed.sample_rows, self.constrained.draft_masks)
            launched = self._readback.start(plan, requests, verified.token_ids, verified.logprobs, False)
            launched.accepted = verified.accepted
            return launched
        inputs = [self._sampling_input(request) for request in requests]
        masks = self.constrained.masks(requests)
        token_ids = self.sampler.sample_ids(logits, inputs, masks)
        logprobs = {}
        if not plan.run_ahead:  # a plan that runs ahead has no request that asks for logprobs
            logprobs = {requests[row].request_id: [token_logprobs]
                        for row, token_logprobs in self.sampler.logprobs(logits, inputs, token_ids).items()}
        return self._readback.start(plan, requests, token_ids, logprobs, ahead)

    def _commit(self, step: LaunchedStep) -> list[RequestDelta]:
        """Apply a launched step's tokens (Scheduler.update); the deltas for the gateway."""
        results = self.scheduler.update(step.plan, step.read(), step.accepted)
        self.num_steps += 1
        deltas = []
        for result in results:
            request_id = result.request.request_id
            if result.finish_reason is not None:
                self._forget(request_id)
            token_logprobs = step.logprobs.get(request_id)
            deltas.append(RequestDelta(
                request_id=request_id,
                new_token_ids=result.new_token_ids,
                finish_reason=result.finish_reason,
                logprobs=token_logprobs[:len(result.new_token_ids)] if token_logprobs is not None else None,
                num_cached_tokens=result.num_cached_tokens,
                queued_s=result.queued_s,
                prompt_logprobs=first_delta_prompt_logprobs(result.request, result.num_cached_tokens),
            ))
        if self.debug_invariants:
            self.block_manager.check_invariants()
        return deltas

    def _forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    @staticmethod
    def _sampling_input(request: Request) -> SamplingInput:
        forced = None if request.thinking_state is None else forced_token(request.thinking_state)
        return SamplingInput(request.request_id, request.params, request.sampling_prompt, request.outputs, forced)

    def stats(self, check_invariants: bool = False) -> Stats:
        """Counters for the gateway (worker/driver/stats.py); the invariants only when asked or in debug mode."""
        return collect_stats(self.block_manager, self.scheduler, num_steps=self.num_steps,
                             check_invariants=check_invariants or self.debug_invariants,
                             copier=self.executor.kv_copier, spec=None if self.spec is None else self.spec.metrics,
                             kv_transfer=self.kv_counters)

    def take_kv_events(self) -> KvEvents | None:
        """The prefix blocks stored and removed since the last call (worker/core/kv_events.py),
        for the next StepOutputs; None when nothing changed or `WorkerConfig.kv_events` is off."""
        events = self.block_manager.take_kv_events()
        if self._kv_replay is not None:
            self._kv_replay.apply(events)
            if self.debug_invariants:
                self._kv_replay.check(self.block_manager.held_block_hashes())
        return events

    def kv_events_snapshot(self) -> KvEvents | None:
        """Every prefix block held, as one report that replaces a gateway's view (a gateway
        attached anew); None when `WorkerConfig.kv_events` is off."""
        return self.block_manager.kv_events_snapshot() if self.config.kv_events else None

    def idle_write_back(self) -> bool:
        """With no request to run, the CPU tier writes cached blocks back (`TierDriver`);
        whether to call again soon."""
        return self.tier.idle_write_back()

    def release_finished(self) -> None:
        """Free the blocks of requests finished since the last call (with
        `scheduler.defer_release`: the busy loop calls it once their deltas are sent)."""
        self.scheduler.release_finished()

    def use_speculation(self, spec: SpecDecoder | None) -> None:
        """Speculate with `spec` from the next step on (None: decode plainly), as a decoder the
        constructor would build for this engine (`build_spec_decoder`): benchmarks compare runs
        with and without speculation on one engine, its graphs and pool unchanged."""
        self.spec = spec

    def reset_prefix_cache(self) -> bool:
        self.scheduler.release_finished()
        self.tier.settle_loads()  # loads of requests gone may still write the slots it frees
        return self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Stop the grammar compiles and the other tensor-parallel ranks, if any."""
        self.constrained.close()
        if self.group is not None:
            self.group.stop()


def _error(request_id: str, error: str) -> RequestDelta:
    return RequestDelta(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error)
