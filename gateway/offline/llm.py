"""The offline API: `LLM`, `SamplingParams`, `RequestOutput`, as vLLM users know them.

`LLM` runs the server's client and per-request generation code (EngineClient, Generation) on
an event loop of its own (gateway/offline/engine_thread.py): one engine, one driver. Detokenization, stop
strings, `min_tokens` and the reasoning split behave offline exactly as they do in the server.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Sequence

from tqdm import tqdm

from spillway.gateway.api import openai as api
from spillway.gateway.link.client import EngineUnavailable, WorkerLost
from spillway.gateway.link import spec_args
from spillway.gateway.link.kv_transfer_args import KvTransferSettings, kv_transfer_settings
from spillway.gateway.replicas.placement import EXECUTOR_BACKENDS, place_prefill_decode, place_replicas
from spillway.gateway.replicas.ray_cluster import INSTALL_HINT, ray_installed
from spillway.gateway.replicas.ray_replicas import RayReplicas
from spillway.gateway.replicas.router import ROUTING_POLICIES
from spillway.gateway.link.engine_args import ALWAYS_ON_NAMES, NOT_YET_NAMES, engine_config, refusals
from spillway.gateway.generation.jobs import Job
from spillway.gateway.api.prompt_ids import Prompt
from spillway.gateway.offline.engine_thread import EngineThread, run_generations
from spillway.gateway.offline.inputs import check_prompt, normalize_params, normalize_prompts, require_tokenizer
from spillway.gateway.offline.outputs import RequestOutput, completion_output, prompt_logprobs_output
from spillway.gateway.text.reasoning import ReasoningMarkers, resolve_markers
from spillway.gateway.api.sampling_params import SamplingParams
from spillway.gateway.generation.serving import Generation
from spillway.gateway.text.tokenizer import PromptHasher, PromptTokenizer
from spillway.gateway.link.worker_process import WorkerProcess, WorkerStartError
from spillway.protocol.local import model_files
from spillway.protocol.messages import Stats


class LLM:
    """An engine for offline batch generation.

    >>> llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        device: str = "auto",
        load_format: str = "auto",
        served_model_name: str | None = None,
        num_gpu_blocks_override: int | None = None,
        cpu_offload_gb: float | None = None,
        kv_offloading_size: float | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        routing: str = "prefix",
        kv_transfer_config: str | dict | None = None,
        prefill_workers: int | None = None,
        decode_workers: int | None = None,
        attention_backend: str | None = None,
        additional_config: str | dict | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        trust_remote_code: bool = False,
        chat_template: str | None = None,
        allow_special_tokens_in_content: bool = False,
        enable_reasoning: bool = False,
        reasoning_parser: str | None = None,
        reasoning_config: str | dict | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_draft_tensor_parallel_size: int | None = None,
        speculative_config: str | dict | None = None,
        **unsupported,
    ) -> None:
        for name in unsupported:
            if name not in NOT_YET_NAMES and name not in ALWAYS_ON_NAMES:
                raise ValueError(f"LLM() got an unknown argument {name!r}")
        spell = lambda name, value: f"LLM({name}={value!r})"  # noqa: E731
        problems = refusals(unsupported, spell)
        if problems:
            raise ValueError("; ".join(problems))
        if data_parallel_size < 1:
            raise ValueError(f"LLM(data_parallel_size={data_parallel_size!r}): at least 1 replica")
        backend = distributed_executor_backend or "mp"
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"LLM(distributed_executor_backend={distributed_executor_backend!r}): not one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        if backend == "ray" and not ray_installed():
            raise ValueError(f"LLM(distributed_executor_backend='ray') needs Ray, which is not installed: "
                             f"{INSTALL_HINT}")
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"LLM(routing={routing!r}): not one of {', '.join(ROUTING_POLICIES)}")
        kv = kv_transfer_settings(kv_transfer_config, prefill_workers, decode_workers,
                                  data_parallel_size=data_parallel_size, enable_prefix_caching=enable_prefix_caching,
                                  spell=spell)
        if kv.disaggregated and backend == "ray":
            raise ValueError(f"LLM(prefill_workers={prefill_workers!r}, decode_workers={decode_workers!r}) with "
                             "distributed_executor_backend='ray': not available yet (the prefill and decode "
                             "workers are local processes)")
        if tokenizer is not None and tokenizer != model:
            raise ValueError("a tokenizer separate from the model is not supported yet")
        self.config, files = engine_config(
            model,
            load_format=load_format,
            served_model_name=served_model_name,
            spell=spell,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            device=device,
            seed=seed,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            cpu_offload_gb=cpu_offload_gb,
            kv_offloading_size=kv_offloading_size,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            tensor_parallel_size=tensor_parallel_size,
            attention_backend=attention_backend,
            additional_config=additional_config,
            kv_transfer=kv.config,
            speculative=spec_args.speculative_config(
                speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens,
                speculative_draft_tensor_parallel_size=speculative_draft_tensor_parallel_size,
                speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size),
        )
        try:
            self._hf_tokenizer = model_files.load_tokenizer(files)
        except model_files.TokenizerNotFoundError:
            self._hf_tokenizer = None  # token-id prompts only
        self._markers: ReasoningMarkers | None = None
        if enable_reasoning or reasoning_parser or reasoning_config:
            if self._hf_tokenizer is None:
                raise ValueError("a reasoning parser needs the model's tokenizer")
            self._markers = resolve_markers(self._hf_tokenizer, reasoning_parser, reasoning_config)
        self._engine, ray_placed = _engine_thread(self.config, data_parallel_size, backend, routing, kv)
        self._finalizer = weakref.finalize(self, _close, self._engine, ray_placed)
        try:
            self.ready = self._engine.start()
        except WorkerStartError as exc:
            self._finalizer()
            raise ValueError(f"the engine could not start: {exc}") from exc
        except BaseException:
            self._finalizer()
            raise
        self._hasher = PromptHasher.of(self.ready)
        self._tokenizer = PromptTokenizer(self._hf_tokenizer, chat_template, allow_special_tokens_in_content) \
            if self._hf_tokenizer else None
        self._ids = itertools.count()

    # ---- public API -----------------------------------------------------------------------

    def get_tokenizer(self):
        return self._hf_tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts: strings, token-id lists, or
        `{"prompt": ...}` / `{"prompt_token_ids": [...]}` dicts."""
        items = normalize_prompts(prompts, self._tokenizer, self.ready.max_model_len, self.ready.vocab_size)
        params = normalize_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them."""
        tok = self._require_tokenizer()
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        items = []
        for conversation in conversations:
            if not conversation or not all(isinstance(m, dict) and "role" in m for m in conversation):
                raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
            items.append(tok.chat_prompt(conversation, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, chat_template_kwargs=chat_template_kwargs))
        for _, token_ids in items:
            check_prompt(token_ids, self.ready.max_model_len, self.ready.vocab_size)
        params = normalize_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix; returns once the worker has done so."""
        self._call(self._reset_prefix_cache)

    async def _reset_prefix_cache(self) -> None:
        self._engine.client.reset_prefix_cache()
        await self._engine.client.stats()

    def stats(self) -> Stats:
        """The worker's counters (cache usage, prefix hits, preemptions); checks its invariants."""
        return self._call(self._engine.client.stats, None, True)

    @property
    def last_stats(self) -> Stats | None:
        return self._engine.client.last_stats

    def shutdown(self) -> None:
        """Stop the worker and this LLM's event loop thread; the LLM is unusable afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ------------------------------------------------------------------------

    def _require_tokenizer(self) -> PromptTokenizer:
        return require_tokenizer(self._tokenizer)

    def _call(self, function, *args, on_wait=None):
        """Run a coroutine function on the engine's loop; engine failures as RuntimeError."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM has been shut down")
        try:
            return self._engine.call(function, *args, on_wait=on_wait)
        except WorkerLost as exc:
            raise RuntimeError(f"the engine stopped: {exc}") from None
        except EngineUnavailable:
            reason = self._engine.client.lost_reason or "it is not running"
            raise RuntimeError(f"the engine cannot take requests: {reason}") from None
        except api.ApiError as exc:  # the worker refused a request
            raise ValueError(exc.message) from None

    def _run(self, items, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        if self._markers is None and any(p.thinking_budget is not None for p in params):
            raise ValueError("thinking_budget needs a reasoning parser: LLM(..., enable_reasoning=True)")
        batch = next(self._ids)
        jobs, placement = self._jobs(f"offline-{batch}", items, params)
        generations = [Generation(job, self._engine.client, self._tokenizer, self._hasher, self._markers,
                                  keep_whole_text=True) for job in jobs]
        # The loop thread only counts; this thread moves the bar (tqdm's lock is never shared with
        # the loop thread: an interrupt raised while this thread holds it would leave it held).
        num_done = [0]

        def prompt_done() -> None:  # on the loop thread
            num_done[0] += 1

        def show_progress() -> None:
            if num_done[0] > bar.n:
                bar.update(num_done[0] - bar.n)

        bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm, file=sys.stderr)
        try:
            logprobs = self._call(run_generations, generations, prompt_done, on_wait=show_progress)
            show_progress()
        finally:
            bar.close()
        results = []
        for index, ((text, token_ids), (job_index, prompt_index)) in enumerate(zip(items, placement)):
            generation, n = generations[job_index], params[index].n
            samples = generation.samples[prompt_index * n:(prompt_index + 1) * n]
            want_logprobs = params[index].logprobs is not None
            completions = [completion_output(sample, i, logprobs[job_index][sample.index] if want_logprobs else None,
                                             self._tokenizer, self._markers) for i, sample in enumerate(samples)]
            results.append(RequestOutput(request_id=f"offline-{batch}-{index}", prompt=text, prompt_token_ids=token_ids,
                                         outputs=completions, num_cached_tokens=samples[0].num_cached_tokens,
                                         prompt_logprobs=prompt_logprobs_output(samples[0], self._tokenizer)))
        return results

    def _jobs(self, batch_id: str, items, params: list[SamplingParams]) -> tuple[list[Job], list[tuple[int, int]]]:
        """One Job per distinct SamplingParams object, and where each prompt went: (job, prompt)."""
        jobs: list[Job] = []
        job_of: dict[int, int] = {}  # id(params) -> index in jobs
        placement = []
        for (text, token_ids), p in zip(items, params):
            if id(p) not in job_of:
                job_of[id(p)] = len(jobs)
                jobs.append(Job(request_id=f"{batch_id}-{len(jobs)}", chat=False, model=self.ready.model,
                                prompts=[], params=p, max_tokens=[]))
            job = jobs[job_of[id(p)]]
            # Offline, max_tokens past the context end is cut there, not refused.
            room = self.ready.max_model_len - len(token_ids)
            job.max_tokens.append(room if p.max_tokens is None else min(room, p.max_tokens))
            placement.append((job_of[id(p)], len(job.prompts)))
            job.prompts.append(Prompt(token_ids, text))
        return jobs, placement


def _engine_thread(config, data_parallel_size: int, backend: str, routing: str, kv: KvTransferSettings):
    """The engine over its replicas' workers (local processes, or on Ray: then also the
    `RayReplicas` to close after it), or over its prefill and decode workers."""
    if kv.disaggregated:
        placement = place_prefill_decode(config, kv.prefill_workers, kv.decode_workers)
        return EngineThread(placement.start_workers(), routing=routing, max_num_seqs=config.max_num_seqs,
                            sequential_start=placement.sequential, prefill_workers=kv.prefill_workers), None
    if backend == "ray":
        placed = RayReplicas(config, data_parallel_size)
        starts = placed.start_workers
        return EngineThread(starts if data_parallel_size > 1 else starts[0], routing=routing,
                            max_num_seqs=config.max_num_seqs), placed
    if data_parallel_size > 1:
        placement = place_replicas(config, data_parallel_size)
        return EngineThread(placement.start_workers(), routing=routing,
                            max_num_seqs=config.max_num_seqs, sequential_start=placement.sequential), None
    return EngineThread(lambda: WorkerProcess(config)), None


def _close(engine: EngineThread, ray_placed) -> None:
    try:
        engine.close()
    finally:
        if ray_placed is not None:
            ray_placed.close()
