"""The offline API: `LLM`, `SamplingParams`, `RequestOutput`, as vLLM users know them.

`LLM` drives a worker process over the same protocol as the server: there is one engine.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Sequence

from tqdm import tqdm

from spillway.gateway.engine_args import NOT_YET_NAMES, engine_config, refusals
from spillway.gateway.offline_inputs import normalize_params, normalize_prompts, require_tokenizer
from spillway.gateway.outputs import RequestOutput, SampleState, completion_output
from spillway.gateway.reasoning import ReasoningMarkers, resolve_markers, thinking_policy
from spillway.gateway.sampling_params import SamplingParams
from spillway.gateway.tokenizer import PromptHasher, PromptTokenizer
from spillway.gateway.worker_process import WorkerProcess, WorkerStartError
from spillway.protocol import model_files
from spillway.protocol.messages import (
    Abort,
    Control,
    ControlCommand,
    FinishReason,
    Generate,
    RequestDelta,
    Stats,
    StepOutputs,
    WorkerError,
)

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
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        trust_remote_code: bool = False,
        chat_template: str | None = None,
        enable_reasoning: bool = False,
        reasoning_parser: str | None = None,
        reasoning_config: str | dict | None = None,
        **unsupported,
    ) -> None:
        for name in unsupported:
            if name not in NOT_YET_NAMES:
                raise ValueError(f"LLM() got an unknown argument {name!r}")
        problems = refusals({**unsupported, "tensor_parallel_size": tensor_parallel_size},
                            lambda name, value: f"LLM({name}={value!r})")
        if problems:
            raise ValueError("; ".join(problems))
        if tokenizer is not None and tokenizer != model:
            raise ValueError("a tokenizer separate from the model is not supported yet")
        self.config, files = engine_config(
            model,
            load_format=load_format,
            served_model_name=served_model_name,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            seed=seed,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
        )
        try:
            self._hf_tokenizer = model_files.load_tokenizer(files)
        except model_files.TokenizerNotFoundError:
            self._hf_tokenizer = None  # token-id prompts only
        self._worker = WorkerProcess(self.config)
        self._finalizer = weakref.finalize(self, self._worker.close)
        try:
            self.ready = self._worker.wait_ready()
        except WorkerStartError as exc:
            self._finalizer()
            raise ValueError(f"the engine could not start: {exc}") from exc
        self._hasher = PromptHasher.of(self.ready)
        self._tokenizer = PromptTokenizer(self._hf_tokenizer, chat_template) if self._hf_tokenizer else None
        self._markers: ReasoningMarkers | None = None
        if enable_reasoning or reasoning_parser or reasoning_config:
            if self._hf_tokenizer is None:
                self._finalizer()
                raise ValueError("a reasoning parser needs the model's tokenizer")
            self._markers = resolve_markers(self._hf_tokenizer, reasoning_parser, reasoning_config)
        self._ids = itertools.count()
        self.last_stats: Stats | None = None

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
            text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            items.append((text, tok.encode_chat(conversation, add_generation_prompt=add_generation_prompt,
                                                chat_template=chat_template,
                                                chat_template_kwargs=chat_template_kwargs)))
        params = normalize_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def reset_prefix_cache(self) -> None:
        self._worker.send(Control(ControlCommand.RESET_PREFIX_CACHE))
        self.stats()

    def stats(self) -> Stats:
        """The worker's counters (cache usage, prefix hits, preemptions); checks its invariants."""
        self._worker.send(Control(ControlCommand.STATS))
        while True:
            msg = self._recv()
            if isinstance(msg, StepOutputs) and msg.stats is not None:
                self.last_stats = msg.stats
                return msg.stats

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ------------------------------------------------------------------------

    def _require_tokenizer(self) -> PromptTokenizer:
        return require_tokenizer(self._tokenizer)

    def _run(self, items, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        batch = next(self._ids)
        pending: dict[str, SampleState] = {}
        if self._markers is None and any(p.thinking_budget is not None for p in params):
            raise ValueError("thinking_budget needs a reasoning parser: LLM(..., enable_reasoning=True)")
        for index, ((_, token_ids), p) in enumerate(zip(items, params)):
            thinking = None if self._markers is None else thinking_policy(self._markers, token_ids, p.thinking_budget)
            max_tokens = self.ready.max_model_len - len(token_ids)
            if p.max_tokens is not None:
                max_tokens = min(max_tokens, p.max_tokens)
            hashes = self._hasher(token_ids)
            for sample in range(p.n):
                request_id = f"offline-{batch}-{index}-{sample}"
                seed = None if p.seed is None else p.seed + sample
                pending[request_id] = SampleState(index, sample, p, logprobs=[] if p.logprobs is not None else None,
                                               thinking=thinking)
                self._worker.send(Generate(
                    request_id=request_id, prompt_token_ids=token_ids, block_hashes=hashes,
                    params=p.to_wire(max_tokens, seed),
                    thinking=thinking if p.thinking_budget is not None else None,
                ))
        bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm, file=sys.stderr)
        try:
            self._collect(pending, items, bar)
        except BaseException:
            self._worker.send(Abort([rid for rid, s in pending.items() if s.finish_reason is None]))
            raise
        finally:
            bar.close()
        return self._outputs(items, params, pending, batch)

    def _collect(self, pending: dict[str, SampleState], items, bar) -> None:
        open_samples = [0] * len(items)
        for state in pending.values():
            open_samples[state.prompt_index] += 1
        unfinished = len(pending)
        while unfinished:
            msg = self._recv()
            if msg.stats is not None:
                self.last_stats = msg.stats
            for delta in msg.outputs:
                state = pending.get(delta.request_id)
                if state is None or state.finish_reason is not None:
                    continue  # a late delta for a sample this side already finished
                if delta.error is not None:
                    self._worker.send(Abort([rid for rid, s in pending.items() if s.finish_reason is None]))
                    raise ValueError(delta.error)
                self._apply(delta.request_id, state, delta)
                if state.finish_reason is not None:
                    unfinished -= 1
                    open_samples[state.prompt_index] -= 1
                    if open_samples[state.prompt_index] == 0:
                        bar.update(1)

    def _apply(self, request_id: str, state: SampleState, delta: RequestDelta) -> None:
        if delta.num_cached_tokens >= 0:
            state.num_cached_tokens = delta.num_cached_tokens
        state.token_ids.extend(delta.new_token_ids)
        if state.logprobs is not None and delta.logprobs:
            state.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            state.finish_reason = delta.finish_reason.value
            if delta.finish_reason is FinishReason.STOP and state.token_ids:
                last = state.token_ids[-1]
                state.stop_reason = last if last in state.params.stop_token_ids else None
        if state.params.stop_strings and self._tokenizer is not None:
            self._check_stop_strings(request_id, state)

    def _check_stop_strings(self, request_id: str, state: SampleState) -> None:
        text = self._tokenizer.decode(state.token_ids, state.params.skip_special_tokens)
        hits = [(text.find(s), s) for s in state.params.stop_strings if s in text]
        if not hits:
            return
        position, stop = min(hits)
        state.text = text[: position + (len(stop) if state.params.include_stop_str_in_output else 0)]
        state.finish_reason, state.stop_reason = FinishReason.STOP.value, stop
        self._worker.send(Abort([request_id]))

    def _recv(self) -> StepOutputs:
        while True:
            msg = self._worker.recv(timeout_ms=1000)
            match msg:
                case StepOutputs():
                    return msg
                case WorkerError(message=message):
                    raise RuntimeError(f"the engine failed: {message}")
                case None if not self._worker.alive:
                    raise RuntimeError(f"the engine process died (exit code {self._worker.process.exitcode})")

    def _outputs(self, items, params, pending: dict[str, SampleState], batch: int) -> list[RequestOutput]:
        results = []
        for index, ((text, token_ids), p) in enumerate(zip(items, params)):
            samples = [pending[f"offline-{batch}-{index}-{s}"] for s in range(p.n)]
            completions = [completion_output(state, self._tokenizer, self._markers) for state in samples]
            results.append(RequestOutput(
                request_id=f"offline-{batch}-{index}",
                prompt=text,
                prompt_token_ids=token_ids,
                outputs=completions,
                num_cached_tokens=samples[0].num_cached_tokens,
            ))
        return results
