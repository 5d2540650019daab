"""`spillway serve [MODEL] [flags]` and `spillway worker MODEL --connect tcp://HOST:PORT`.

Flags follow `vllm serve`. A vLLM flag whose feature Spillway does not have yet is refused
with a message and exit status 2, never accepted and ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from spillway.gateway import engine_args
from spillway.gateway.engine_args import BLOCK_SIZES, DTYPES, engine_config
from spillway.gateway.spec_args import speculative_config
from spillway.gateway.reasoning import PARSERS
from spillway.gateway.client import DEFAULT_RESPONSE_TIMEOUT_S
from spillway.gateway.worker_process import WorkerProcess, WorkerStartError
from spillway.protocol import envs
from spillway.protocol.config import KV_CACHE_DTYPES
from spillway.protocol.link_auth import read_worker_key, require_key_off_loopback
from spillway.protocol.model_files import LOAD_FORMATS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="a model folder, a .gguf file, or a built-in config with --load-format dummy "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", help="same as the positional MODEL")
    engine.add_argument("--served-model-name", nargs="+", help="names the API answers to (first one reported)")
    engine.add_argument("--dtype", default="auto", choices=DTYPES)
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8 (= fp8_e4m3): float8 e4m3, unscaled, CUDA only")
    engine.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    engine.add_argument("--device", default="auto", help="auto (CUDA if present, else the CPU), cpu, cuda, cuda:N")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES)
    engine.add_argument("--max-model-len", type=_positive_int)
    engine.add_argument("--max-num-seqs", type=_positive_int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=_positive_int)
    engine.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9)
    engine.add_argument("--num-gpu-blocks-override", type=_positive_int)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--cpu-offload-gb", type=float, metavar="GIB",
                        help="GiB of pinned host memory for a CPU tier of the KV cache (not weights, as in vLLM); "
                             "default: $SPILLWAY_CPU_KVCACHE_SPACE or $VLLM_CPU_KVCACHE_SPACE, else none")
    engine.add_argument("--kv-offloading-size", type=float, metavar="GIB", help="same as --cpu-offload-gb")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: every decode step runs eagerly")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan the next decode step while the GPU runs this one (default: on with CUDA)")
    engine.add_argument("--trust-remote-code", action="store_true",
                        help="accepted: Spillway never runs code shipped with a model")
    engine.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    engine.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1)
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-model", help="a draft model with the target's tokenizer")
    spec.add_argument("--num-speculative-tokens", type=int, help="draft tokens verified per step")
    spec.add_argument("--speculative-draft-tensor-parallel-size", type=int, help="1 (no tensor parallelism yet)")
    spec.add_argument("--speculative-config", metavar="JSON",
                      help='{"method": "draft_model" | "ngram", "num_speculative_tokens": K, '
                           '"prompt_lookup_min": N, "prompt_lookup_max": N}')
    refused = parser.add_argument_group("not available yet (refused)")
    refused.add_argument("--swap-space", type=float)
    refused.add_argument("--quantization", "-q")
    refused.add_argument("--enable-lora", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spillway", description="Spillway LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    _add_engine_args(serve)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1/*")
    server.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    server.add_argument("--allow-special-tokens-in-content", action="store_true",
                        help="tokenize special-token text in chat messages (e.g. <|im_end|>) as those tokens, "
                             "letting a user write turns of other roles; for trusted clients only")
    reasoning = serve.add_argument_group("reasoning models")
    reasoning.add_argument("--enable-reasoning", action="store_true",
                           help="split <think> ... </think> into reasoning_content (the deepseek_r1 parser "
                                "unless --reasoning-parser or --reasoning-config says otherwise)")
    reasoning.add_argument("--reasoning-parser", choices=sorted(PARSERS),
                           help="which markers delimit thinking; implies --enable-reasoning")
    reasoning.add_argument("--reasoning-config", metavar="JSON",
                           help='markers of your own: {"start": "<think>", "end": "</think>", '
                                '"transition": "optional phrase forced before the end at the budget"}; '
                                "implies --enable-reasoning")
    server.add_argument("--worker-address", metavar="tcp://HOST:PORT",
                        help="do not start a worker: bind PORT and PORT+1 on HOST and wait for "
                             "`spillway worker MODEL --connect tcp://HOST:PORT`; off loopback, the link "
                             "needs a key ($SPILLWAY_WORKER_KEY or --worker-key-file)")
    _add_worker_key_arg(server)
    server.add_argument("--worker-response-timeout", type=float, default=DEFAULT_RESPONSE_TIMEOUT_S, metavar="S",
                        help="a request that hears nothing from the worker for S seconds ends with an error "
                             "(default %(default)g)")
    server.add_argument("--max-pending-requests", type=_positive_int,
                        help="sequences in flight beyond which requests get 429 (default 4 x --max-num-seqs)")
    server.add_argument("--max-request-body-bytes", type=_positive_int, default=8 << 20)
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--disable-log-requests", action="store_true", help="accepted: requests are not logged")
    serve.set_defaults(func=serve_command)

    worker = commands.add_parser("worker", help="run a worker for a gateway on another host")
    _add_engine_args(worker)
    worker.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                        help="the gateway's --worker-address")
    _add_worker_key_arg(worker)
    worker.set_defaults(func=worker_command)
    return parser


def _add_worker_key_arg(group) -> None:
    group.add_argument("--worker-key-file", metavar="PATH",
                       help="a file holding the secret (16 bytes or more) that authenticates and encrypts the "
                            "link between gateway and remote worker, the same on both; default $SPILLWAY_WORKER_KEY")


def _worker_keys(args: argparse.Namespace, address: str):
    """The link's keys; refuses an address other hosts reach without one (LinkKeyError)."""
    keys = read_worker_key(args.worker_key_file, envs.worker_key())
    require_key_off_loopback(address, keys)
    return keys


def refusals(args: argparse.Namespace) -> list[str]:
    """Messages for every flag that asks for a feature Spillway does not have yet."""
    return engine_args.refusals(vars(args), _flag)


def _flag(name: str, value: object) -> str:
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def worker_config(args: argparse.Namespace):
    """Check the engine flags, resolve the model (converting a GGUF file once) and build the
    worker's configuration; returns it with the served model names."""
    if args.model is not None and args.model_tag is not None and args.model != args.model_tag:
        raise ValueError(f"two different models given: {args.model_tag!r} and --model {args.model!r}")
    config, files = engine_config(
        args.model or args.model_tag, load_format=args.load_format,
        served_model_name=args.served_model_name[0] if args.served_model_name else None, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, device=args.device, seed=args.seed, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        cpu_offload_gb=args.cpu_offload_gb, kv_offloading_size=args.kv_offloading_size,
        speculative=speculative_config(
            speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
            speculative_draft_tensor_parallel_size=args.speculative_draft_tensor_parallel_size,
            speculative_config=args.speculative_config),
    )
    return config, args.served_model_name or [files.name]


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _read_reasoning_config(value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--reasoning-config is not valid JSON: {exc}") from None
    if not isinstance(spec, dict) or set(spec) - {"start", "end", "transition"} \
            or not all(isinstance(spec.get(k, ""), str) for k in ("start", "end", "transition")) \
            or not spec.get("start") or not spec.get("end"):
        raise ValueError('--reasoning-config must be {"start": str, "end": str, "transition": str (optional)}, '
                         "with non-empty markers")
    return spec


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from spillway.gateway.app import ServerSettings, build_app
    from spillway.gateway.http_protocol import server_config
    from spillway.gateway.remote_worker import worker_addresses

    try:
        config, names = worker_config(args)
        chat_template = _read_chat_template(args.chat_template)
        reasoning_config = _read_reasoning_config(args.reasoning_config)
        keys = None
        if args.worker_address is not None:
            worker_addresses(args.worker_address)
            keys = _worker_keys(args, args.worker_address)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"spillway serve: {exc}", file=sys.stderr)
        return 1
    start_worker = None
    if args.worker_address is None:
        # The first worker starts before the server: settings its device cannot run (no CUDA,
        # an fp8 cache on the CPU) end the command with the worker's own message.
        try:
            start_worker = _local_workers(config)
        except WorkerStartError as exc:
            print(f"spillway serve: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C while the model loads: the worker is closed already
            return 1
    settings = ServerSettings(
        worker=config, served_model_names=names, api_key=args.api_key, chat_template=chat_template,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        max_body_bytes=args.max_request_body_bytes,
        max_pending=args.max_pending_requests or 4 * args.max_num_seqs, worker_address=args.worker_address,
        worker_keys=keys, response_timeout_s=args.worker_response_timeout,
        enable_reasoning=bool(args.enable_reasoning or args.reasoning_parser or reasoning_config is not None),
        reasoning_parser=args.reasoning_parser, reasoning_config=reasoning_config, freeze_startup_objects=True,
    )
    loop = "uvloop" if _has_uvloop() else "asyncio"
    server = uvicorn.Server(server_config(build_app(settings, start_worker), host=args.host, port=args.port, loop=loop,
                                          log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        pass
    return 0 if server.started else 1


def _local_workers(config):
    """Start a worker and wait until it is ready (WorkerStartError if it cannot start); returns
    the app's `start_worker`, which hands out that worker first, then new ones."""
    worker = WorkerProcess(config)
    started = time.monotonic()
    last_report = started

    def on_wait() -> None:
        nonlocal last_report
        if time.monotonic() - last_report >= 5.0:
            last_report = time.monotonic()
            logging.getLogger("spillway.gateway").info("waiting for the worker to load the model (%.0f s)",
                                                       last_report - started)

    try:
        worker.wait_ready(on_wait=on_wait)
    except BaseException:
        worker.close()
        raise
    started_workers = [worker]
    return lambda: started_workers.pop() if started_workers else WorkerProcess(config)


def worker_command(args: argparse.Namespace) -> int:
    from spillway.gateway.remote_worker import worker_addresses
    from spillway.worker.config import resolve_device_settings
    from spillway.worker.main import run_worker

    try:
        config, _ = worker_config(args)
        resolve_device_settings(config)  # this is the worker: say what its device cannot run, then stop
        inbox, outbox = worker_addresses(args.connect)
        keys = _worker_keys(args, args.connect)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"spillway worker: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("spillway").info("worker for %s connecting to %s", config.served_model_name, args.connect)
    try:
        return run_worker(config, inbox, outbox, parent_pid=None, keys=keys)
    except KeyboardInterrupt:
        return 0


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = refusals(args)
    if problems:
        for problem in problems:
            print(f"spillway {args.command}: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
