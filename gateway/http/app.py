"""The OpenAI-compatible HTTP server: Starlette routes over one EngineClient.

The lifespan starts the worker (or waits for a remote one), loads the tokenizer, and owns the
client until shutdown. Every error a client can cause is answered with OpenAI's error body and
a 4xx; handlers never block the event loop on the worker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path
from collections.abc import Callable
from contextlib import asynccontextmanager

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from spillway.gateway.api import answers
from spillway.gateway.api import openai as api
from spillway.gateway.text.chat_messages import template_messages, tokenize_render
from spillway.gateway.http.guards import ApiKeyMiddleware, check_json_body, check_json_values
from spillway.gateway.link.client import EngineClient, EngineOverloaded, EngineUnavailable
from spillway.gateway.http.error_handlers import HANDLERS
from spillway.gateway.http.intake_turns import IntakeTurns
from spillway.gateway.generation.jobs import JobBuilder
from spillway.gateway.metrics.metrics import CONTENT_TYPE, GatewayMetrics
from spillway.gateway.http.info_routes import models, openapi_endpoint, version_endpoint
from spillway.gateway.text.reasoning import ReasoningMarkers, resolve_markers
from spillway.gateway.link.remote_worker import RemoteWorker
from spillway.gateway.api.logprob_answers import TokenStrings
from spillway.gateway.http.responses import GenerationResponse, json_response
from spillway.gateway.http.server_settings import ServerSettings
from spillway.gateway.generation.serving import Generation
from spillway.gateway.http.stats_log import StatsLogger
from spillway.gateway.text.template_sandbox import TemplateSandbox
from spillway.gateway.text.tokenizer import PromptHasher, PromptTokenizer
from spillway.gateway.link.worker_process import WorkerProcess
from spillway.gateway.replicas.placement import place_prefill_decode, place_replicas
from spillway.gateway.replicas.prefill_decode import PrefillDecodeSet
from spillway.gateway.replicas.replica_set import ReplicaSet
from spillway.protocol.local import model_files

logger = logging.getLogger("spillway.gateway")

STATS_REFRESH_TIMEOUT_S = 2.0  # one engine step, even a long prefill on a CPU


class Gateway:
    """Everything the routes share: the client, the tokenizer, the metrics."""

    def __init__(self, settings: ServerSettings, client: EngineClient, metrics: GatewayMetrics, hf_tokenizer) -> None:
        ready = client.ready
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self.served_names = settings.served_model_names or [ready.model]
        self.block_hashes = PromptHasher.of(ready)
        self.tokenizer = PromptTokenizer(hf_tokenizer, settings.chat_template, settings.allow_special_tokens_in_content) \
            if hf_tokenizer is not None else None
        self.markers = _reasoning_markers(settings, hf_tokenizer)
        self.sandbox = TemplateSandbox(settings.request_template_limits) \
            if settings.trust_request_chat_template and self.tokenizer is not None else None
        self.jobs = JobBuilder(self.tokenizer, self.served_names, lambda: self.client.ready,
                               reasoning=self.markers is not None, defaults=settings.request_defaults,
                               max_sequences=settings.max_pending, sandbox=self.sandbox, max_n=settings.max_n,
                               tool_parser=settings.tool_call_parser)
        self.strings = TokenStrings(hf_tokenizer)
        self.created = int(time.time())
        # A bounded share of a burst's intakes per loop iteration, larger with more streams.
        self.intake = IntakeTurns(num_streams=lambda: client.num_in_flight)

    def run(self, job) -> GenerationResponse:
        generation = Generation(job, self.client, self.tokenizer, self.block_hashes, self.markers)
        try:
            generation.start()
        except EngineOverloaded as exc:
            raise api.ApiError(429, f"the server is overloaded: {exc}", type="rate_limit_error",
                               code="overloaded", retry_after=1) from None
        except EngineUnavailable as exc:
            raise api.ApiError(503, str(exc), type="server_error", code="engine_unavailable",
                               retry_after=5) from None
        return GenerationResponse(generation, self.strings)


def _reasoning_markers(settings: ServerSettings, hf_tokenizer) -> ReasoningMarkers | None:
    if not settings.reasoning:
        return None
    if hf_tokenizer is None:
        raise ValueError("a reasoning parser needs the model's tokenizer, and this model has none")
    return resolve_markers(hf_tokenizer, settings.reasoning_parser, settings.reasoning_config)


def load_tokenizer(settings: ServerSettings):
    """The tokenizer the settings name (the model's, or --tokenizer's); None if the model has none."""
    config = settings.worker
    files = model_files.resolve_model(config.model, config.load_format)
    if settings.tokenizer is not None:
        return model_files.load_tokenizer(model_files.ModelFiles(settings.tokenizer, Path(settings.tokenizer),
                                                                 files.load_format))
    try:
        return model_files.load_tokenizer(files)
    except model_files.TokenizerNotFoundError:
        logger.warning("model %s has no tokenizer: only token-id prompts will work", files.name)
        return None


def build_app(settings: ServerSettings, start_worker=None,
              tokenizer_loader: Callable[[], object] | None = None) -> Starlette:
    """The Starlette app; `start_worker` replaces starting a local worker process (`spillway
    serve` hands over the one it started first; tests give fakes), a list of them one per
    replica with `data_parallel_size` > 1, or one per worker with `prefill_workers` (the
    producers first); `tokenizer_loader` replaces loading the tokenizer at
    start-up (`spillway serve` loads it while the worker loads)."""

    @asynccontextmanager
    async def lifespan(app: Starlette):
        remote = None
        if settings.worker_link is not None:
            remote = RemoteWorker(f"the worker of API server 0 (this is API server {settings.api_server_index})",
                                  settings.worker, link=settings.worker_link)
        elif settings.worker_address:
            remote = RemoteWorker(settings.worker_address, settings.worker, keys=settings.worker_keys)
        metrics = GatewayMetrics(settings.served_model_names[0] if settings.served_model_names
                                 else settings.worker.served_model_name or "model", settings.worker.max_model_len,
                                 engine_stats=settings.api_server_index == 0, num_engines=settings.num_engines)
        if settings.worker_address:
            logger.info("waiting for a worker to connect to %s (spillway worker MODEL --connect %s)",
                        settings.worker_address, settings.worker_address)
        options = dict(ready_timeout_s=settings.ready_timeout_s if remote is None else float("inf"),
                       heartbeat_timeout_s=settings.heartbeat_timeout_s, step_timeout_s=settings.step_timeout_s,
                       response_timeout_s=settings.response_timeout_s)
        if settings.prefill_workers:
            client = _prefill_decode_set(settings, start_worker, metrics, options)
        elif settings.data_parallel_size > 1:
            client = _replica_set(settings, start_worker, metrics, options)
        else:
            factory = start_worker or remote or (lambda: WorkerProcess(settings.worker))
            client = EngineClient(factory, metrics=metrics.engine(0), max_pending=settings.max_pending, **options)
        stats_log = None
        try:
            hf_tokenizer = tokenizer_loader() if tokenizer_loader is not None else load_tokenizer(settings)
            await client.start()
            app.state.gateway = Gateway(settings, client, metrics, hf_tokenizer)
            if settings.serve_after is not None:
                await asyncio.to_thread(settings.serve_after)
            if settings.log_stats and settings.api_server_index == 0:
                stats_log = StatsLogger(client, metrics, logger).start()
            if settings.freeze_startup_objects:
                # What start-up built (the tokenizer, transformers' modules) lives as long as
                # the server: out of the collector's reach, a full collection mid-stream walks
                # only what requests allocate (~100 ms less of a stalled event loop each time).
                gc.collect()
                gc.freeze()
            yield
        finally:
            if stats_log is not None:
                stats_log.stop()
            gateway = getattr(app.state, "gateway", None)
            if gateway is not None and gateway.sandbox is not None:
                gateway.sandbox.close()
            await client.close()
            if remote is not None:
                remote.shutdown()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's health check, as vLLM serves it
        Route("/invocations", invocations, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=HANDLERS)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app


def _replica_set(settings: ServerSettings, start_workers, metrics: GatewayMetrics, options: dict) -> ReplicaSet:
    """The replicas' client: `start_workers` (one per replica: workers `spillway serve` started or
    placed on Ray, tests' fakes), or local workers where `place_replicas` puts them, started one
    after another where they share a GPU. `max_pending` bounds each replica."""
    sequential = False
    if start_workers is None:
        placement = place_replicas(settings.worker, settings.data_parallel_size)
        start_workers = placement.start_workers()
        sequential = placement.sequential
        logger.info("%s; routing by %s", placement.describe, settings.routing)
    return ReplicaSet(start_workers, routing=settings.routing, max_num_seqs=settings.worker.max_num_seqs,
                      metrics=metrics, sequential_start=sequential, max_pending=settings.max_pending, **options)


def _prefill_decode_set(settings: ServerSettings, start_workers, metrics: GatewayMetrics,
                        options: dict) -> PrefillDecodeSet:
    """The prefill and decode workers' client: `start_workers` (producers first: workers `spillway
    serve` started, tests' fakes), or local workers where `place_prefill_decode` puts them.
    `max_pending` bounds each worker."""
    sequential = False
    if start_workers is None:
        placement = place_prefill_decode(settings.worker, settings.prefill_workers, settings.decode_workers)
        start_workers = placement.start_workers()
        sequential = placement.sequential
        logger.info("%s; prompts to the prefill workers by %s", placement.describe, settings.routing)
    split = settings.prefill_workers
    return PrefillDecodeSet(start_workers[:split], start_workers[split:], routing=settings.routing,
                            max_num_seqs=settings.worker.max_num_seqs, metrics=metrics, sequential_start=sequential,
                            max_pending=settings.max_pending, **options)


# ---- routes -------------------------------------------------------------------------------


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def _read_json(request: Request, request_type: type):
    return api.decode_request(await _read_body(request), request_type)


async def _read_body(request: Request) -> bytes:
    check_json_body(request.headers.get("content-type"))
    limit = _gateway(request).settings.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise api.ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise api.ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    # From here to the request's send to the worker, the handler runs without awaiting: a
    # loop iteration runs a bounded share of a burst's intakes, so streams keep flowing.
    await _gateway(request).intake.take(size)
    body = b"".join(chunks)
    check_json_values(body)
    return body


async def chat_completions(request: Request):
    gateway = _gateway(request)
    job = await gateway.jobs.chat_job(await _read_json(request, api.ChatCompletionRequest))
    return gateway.run(job)


async def completions(request: Request):
    gateway = _gateway(request)
    job = await gateway.jobs.completion_job(await _read_json(request, api.CompletionRequest))
    return gateway.run(job)


async def invocations(request: Request):
    """SageMaker's entry point, as vLLM serves it: a body with `messages` is a chat completion,
    one with `prompt` a completion."""
    gateway = _gateway(request)
    body = await _read_body(request)
    try:
        fields = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise api.bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if isinstance(fields, dict) and "messages" in fields:
        job = await gateway.jobs.chat_job(api.decode_request(body, api.ChatCompletionRequest))
    elif isinstance(fields, dict) and "prompt" in fields:
        job = await gateway.jobs.completion_job(api.decode_request(body, api.CompletionRequest))
    else:
        raise api.bad_request("an /invocations body needs `messages` (chat) or `prompt` (completion)",
                              param="messages")
    return gateway.run(job)


async def health(request: Request) -> Response:
    """200 while the engine (any replica; any decode worker) can take requests; with replicas,
    their states too; with prefill and decode workers, their roles and states."""
    client = _gateway(request).client
    if client.healthy:
        if isinstance(client, ReplicaSet):
            return json_response({"replicas": [{"engine": str(index), "state": state}
                                               for index, state in enumerate(client.replica_states())]})
        if isinstance(client, PrefillDecodeSet):
            return json_response({"workers": [{"engine": str(index), "role": role, "state": state}
                                              for index, (role, state) in enumerate(client.worker_states())]})
        return Response(status_code=200)
    raise api.ApiError(503, "the engine is not ready (it is starting or restarting)", type="server_error",
                       code="engine_unavailable", retry_after=5)


async def metrics_endpoint(request: Request) -> Response:
    gateway = _gateway(request)
    await gateway.client.refresh_stats(STATS_REFRESH_TIMEOUT_S)
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> Response:
    gateway = _gateway(request)
    body = await _read_json(request, api.TokenizeRequest)
    gateway.jobs.check_model(body.model)
    if body.messages is not None:
        messages = template_messages(body.messages)
        gateway.jobs.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        token_ids = await gateway.jobs.encode_chat(messages, tokenize_render(body))
    elif body.prompt is not None:
        gateway.jobs.check_prompt_chars(len(body.prompt), "prompt")
        token_ids = await gateway.jobs.encode(body.prompt, body.add_special_tokens)
    else:
        raise api.bad_request("give `prompt` or `messages`", param="prompt")
    return json_response(answers.TokenizeResponse(len(token_ids), gateway.client.ready.max_model_len, token_ids))


async def detokenize(request: Request) -> Response:
    gateway = _gateway(request)
    body = await _read_json(request, api.DetokenizeRequest)
    gateway.jobs.check_model(body.model)
    return json_response(answers.DetokenizeResponse(await gateway.jobs.decode(body.tokens)))
