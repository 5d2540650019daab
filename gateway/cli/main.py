"""`spillway serve [MODEL] [flags]` and `spillway worker MODEL --connect tcp://HOST:PORT`; also
`spillway --version`, `bench serve|throughput|latency` (gateway/cli/bench.py), `chat`, `complete`
(gateway/cli/chat_client.py) and `collect-env` (gateway/cli/collect_env.py), as vLLM's commands.

Flags follow `vllm serve` (gateway/cli/serve_args.py; `--config FILE` in gateway/cli/config_file.py).
A vLLM flag Spillway cannot honour is refused with a message naming it and exit status 2,
never accepted and ignored; so is one it does not know (argparse's "unrecognized arguments").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from pathlib import Path

from spillway.gateway.cli import chat_client, bench as cli_bench, collect_env

from spillway.gateway.link import engine_args
from spillway.gateway.cli.serve_args import build_parser, option_strings
from spillway.gateway.cli.config_file import ConfigFileError, expand_config
from spillway.gateway.link.engine_args import RefusedArgument, engine_config
from spillway.gateway.link.kv_transfer_args import KvTransferSettings, kv_transfer_settings
from spillway.gateway.http.file_handles import raise_open_file_limit
from spillway.gateway.api.request_defaults import read_request_defaults
from spillway.gateway.api.sampling_params import MAX_LOGPROBS
from spillway.gateway.http.serve_run import (
    BannerServer, PortInUse, Stopped, bind_port, in_background, local_replicas, local_workers, serve_api_server,
    stop_on_sigterm,
    uvicorn_config,
)
from spillway.gateway.link.spec_args import speculative_config
from spillway.gateway.link.worker_process import WorkerStartError
from spillway.gateway.replicas.ray_cluster import INSTALL_HINT, ray_installed
from spillway.protocol.local import envs, model_files
from spillway.protocol.local.link_auth import read_worker_key, require_key_off_loopback


def _worker_keys(args: argparse.Namespace, address: str):
    """The link's keys; refuses an address other hosts reach without one (LinkKeyError)."""
    keys = read_worker_key(args.worker_key_file, envs.worker_key())
    require_key_off_loopback(address, keys)
    return keys


def refusals(args: argparse.Namespace) -> list[str]:
    """Messages for every flag that asks for what Spillway cannot do (yet)."""
    problems = engine_args.refusals(vars(args), _flag, "flags")
    if getattr(args, "api_server_count", 1) > 1 and getattr(args, "worker_address", None) is not None:
        problems.append(f"--api-server-count {args.api_server_count} with --worker-address: not available yet "
                        "(a remote worker serves one gateway process)")
    if getattr(args, "data_parallel_size", 1) > 1:
        for flag, value in (("--api-server-count", getattr(args, "api_server_count", 1) > 1),
                            ("--worker-address", getattr(args, "worker_address", None) is not None)):
            if value:
                problems.append(f"--data-parallel-size {args.data_parallel_size} with {flag}: not available yet "
                                "(one API server routes over the replicas, each a local worker)")
    problems += _executor_backend_refusals(args)
    problems += _kv_transfer_refusals(args)
    if getattr(args, "max_logprobs", 0) > MAX_LOGPROBS:
        problems.append(f"--max-logprobs {args.max_logprobs}: the sampler returns at most {MAX_LOGPROBS} "
                        "logprobs per token")
    problems += _tool_flag_refusals(args)
    return problems


def _executor_backend_refusals(args: argparse.Namespace) -> list[str]:
    """`--distributed-executor-backend ray`: for `spillway serve` alone, with Ray installed."""
    if getattr(args, "distributed_executor_backend", "mp") != "ray":
        return []
    flag = "--distributed-executor-backend ray"
    if args.command == "worker":
        return [f"{flag}: a worker does not place workers; give it to `spillway serve`"]
    problems = []
    for other, given in (("--api-server-count", getattr(args, "api_server_count", 1) > 1),
                         ("--worker-address", getattr(args, "worker_address", None) is not None)):
        if given:
            problems.append(f"{flag} with {other}: not available yet (one API server routes over the "
                            "replicas, each placed by Ray)")
    if not ray_installed():
        problems.append(f"{flag} needs Ray, which is not installed: {INSTALL_HINT}")
    return problems


def kv_transfer_flags(args: argparse.Namespace) -> KvTransferSettings:
    """--kv-transfer-config, --prefill-workers and --decode-workers, checked (RefusedArgument)."""
    return kv_transfer_settings(args.kv_transfer_config, getattr(args, "prefill_workers", None),
                                getattr(args, "decode_workers", None), data_parallel_size=args.data_parallel_size,
                                enable_prefix_caching=args.enable_prefix_caching, spell=_kv_flag,
                                settings_spelling="flags")


def _kv_transfer_refusals(args: argparse.Namespace) -> list[str]:
    """Disaggregated prefill and decode's flags, alone and with the server's others: the workers
    of --prefill-workers/--decode-workers are this server's own, local, under one API server."""
    if not hasattr(args, "kv_transfer_config"):
        return []
    try:
        settings = kv_transfer_flags(args)
    except RefusedArgument as exc:
        return [str(exc)]
    remote = getattr(args, "worker_address", None) is not None
    if settings.config is not None and remote and not settings.disaggregated:
        return ["--kv-transfer-config with --worker-address: the remote worker's role is its own; give "
                "--kv-transfer-config to `spillway worker`, and this server reads the role from it"]
    if not settings.disaggregated:
        return []
    workers = f"--prefill-workers {args.prefill_workers} with --decode-workers {args.decode_workers}"
    problems = []
    for flag, given in (("--api-server-count", getattr(args, "api_server_count", 1) > 1), ("--worker-address", remote),
                        ("--distributed-executor-backend ray", args.distributed_executor_backend == "ray")):
        if given:
            problems.append(f"{workers} and {flag}: not available yet (one API server sends each prompt through "
                            "its local prefill and decode workers)")
    return problems


def _kv_flag(name: str, value: object) -> str:
    """A flag as the user typed it, a JSON value quoted as a shell needs it."""
    if name == "kv_transfer_config":
        return f"--kv-transfer-config '{value}'"
    return _flag(name, value)


def _tool_flag_refusals(args: argparse.Namespace) -> list[str]:
    """Tool calling's flags as vLLM wants them: the switch with a parser, a parser it knows."""
    from spillway.gateway.text.tool_calls import TOOL_PARSERS

    parser = getattr(args, "tool_call_parser", None)
    if parser is not None and parser not in TOOL_PARSERS:
        return [f"--tool-call-parser {parser}: not one of {', '.join(TOOL_PARSERS)}"]
    if getattr(args, "enable_auto_tool_choice", False) and parser is None:
        return ["--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)"]
    return []


def _flag(name: str, value: object) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def worker_config(args: argparse.Namespace):
    """Check the engine flags, resolve the model (converting a GGUF file once) and build the
    worker's configuration; returns it with the model's name as given (the default's hub id),
    which `/v1/models` reports as `root` and serves when no `--served-model-name` is given."""
    if args.model is not None and args.model_tag is not None and args.model != args.model_tag:
        raise ValueError(f"two different models given: {args.model_tag!r} and --model {args.model!r}")
    config, files = engine_config(
        args.model or args.model_tag, load_format=args.load_format,
        served_model_name=args.served_model_name[0] if args.served_model_name else None, spell=_flag,
        settings_spelling="flags",
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, device=args.device, seed=args.seed, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        cpu_offload_gb=args.cpu_offload_gb, kv_offloading_size=args.kv_offloading_size,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend, additional_config=args.additional_config,
        kv_transfer=kv_transfer_flags(args).config,
        speculative=speculative_config(
            speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
            speculative_draft_tensor_parallel_size=args.speculative_draft_tensor_parallel_size,
            speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size),
    )
    return config, files.name


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
    """Run the server until Ctrl-C or SIGTERM (exit status 0 either way, also while the model
    loads); 1 when it cannot start."""
    raise_open_file_limit()  # each connection holds a file handle; the worker and API servers inherit it
    try:
        sock = bind_port(args.host, args.port)  # before anything slow: a port in use ends it at once
    except PortInUse as exc:
        print(f"spillway serve: {exc}", file=sys.stderr)
        return 1
    try:
        with stop_on_sigterm():
            return _serve(args, sock)
    except (KeyboardInterrupt, Stopped):  # the worker, if any, is closed already
        return 0
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock) -> int:
    api_servers = None
    if args.api_server_count > 1:
        from spillway.gateway.http.api_servers import ApiServers

        api_servers = ApiServers(args.api_server_count)  # metrics shared across processes from here on
    try:
        code = _serve_first(args, sock, api_servers)
    except Stopped:  # uvicorn raises again the SIGTERM it stopped on
        if api_servers is None or api_servers.failed is None:
            raise
        code = 1  # sent by ApiServers: a server exited on its own
    finally:
        if api_servers is not None:
            api_servers.stop()
    return 1 if api_servers is not None and api_servers.failed else code


def _serve_first(args: argparse.Namespace, sock, api_servers) -> int:
    """API server 0: the worker's owner (and with --api-server-count, the other servers')."""
    from spillway.gateway.http.app import build_app, load_tokenizer
    from spillway.gateway.replicas.placement import place_prefill_decode, place_replicas
    from spillway.gateway.replicas.ray_replicas import RayReplicas

    try:
        settings = _server_settings(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"spillway serve: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, engine_args.RefusedArgument) else 1
    if api_servers is not None:  # forked before the worker's sockets and threads exist
        api_servers.start(lambda index, link: serve_api_server(args, sock, settings, index, link,
                                                             api_servers.wait_serving,
                                                             api_servers.connections.slot(index)))
    tokenizer = in_background(load_tokenizer, settings)  # while the worker loads the model
    start_worker = ray_placed = None
    if args.worker_address is None:
        # The first worker starts before the server: settings its device cannot run (no CUDA,
        # an fp8 cache on the CPU) end the command with the worker's own message.
        try:
            if args.distributed_executor_backend == "ray":
                ray_placed = RayReplicas(settings.worker, settings.data_parallel_size)
                start_worker = ray_placed.start_workers
                if settings.data_parallel_size == 1:
                    start_worker = start_worker[0]
            elif settings.prefill_workers:
                start_worker = local_replicas(place_prefill_decode(settings.worker, settings.prefill_workers,
                                                                   settings.decode_workers))
            elif settings.data_parallel_size > 1:
                start_worker = local_replicas(place_replicas(settings.worker, settings.data_parallel_size))
            else:
                start_worker = local_workers(settings.worker, api_servers.links if api_servers is not None else None)
            if api_servers is not None:
                api_servers.check()
        except (WorkerStartError, RuntimeError, ConnectionError) as exc:
            print(f"spillway serve: {exc}", file=sys.stderr)
            return 1
    try:
        server = BannerServer(uvicorn_config(args, build_app(settings, start_worker, tokenizer.result)),
                              settings.served_model_names[0], api_servers)
        server.run(sockets=[sock])  # uvicorn raises the signal that stopped it again once it has shut down
    finally:
        if ray_placed is not None:  # after the app closed its links
            ray_placed.close()
    return 0 if server.started else 1


def _server_settings(args: argparse.Namespace):
    """The server's settings from the flags, every file they name read and checked."""
    from spillway.gateway.http.server_settings import ServerSettings
    from spillway.gateway.link.remote_worker import worker_addresses
    from spillway.gateway.text.template_sandbox import TemplateLimits

    config, root = worker_config(args)
    reasoning_config = _read_reasoning_config(args.reasoning_config)
    keys = None
    if args.worker_address is not None:
        worker_addresses(args.worker_address)
        keys = _worker_keys(args, args.worker_address)
    defaults = read_request_defaults(args.generation_config, Path(config.model), args.max_logprobs)
    if defaults.overridden:
        logging.getLogger("spillway.gateway").info("request defaults from the generation config: %s",
                                                   defaults.overridden)
    return ServerSettings(
        worker=config, served_model_names=args.served_model_name or [root], model_root=root, api_key=args.api_key,
        chat_template=_read_chat_template(args.chat_template), max_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        request_template_limits=TemplateLimits(args.request_chat_template_timeout, args.request_chat_template_memory_mb),
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        max_pending=args.max_pending_requests or 4 * args.max_num_seqs, worker_address=args.worker_address,
        max_n=args.max_n,
        worker_keys=keys, response_timeout_s=args.worker_response_timeout,
        heartbeat_timeout_s=args.worker_heartbeat_timeout, step_timeout_s=args.worker_step_timeout,
        enable_reasoning=bool(args.enable_reasoning or args.reasoning_parser or reasoning_config is not None),
        reasoning_parser=args.reasoning_parser, reasoning_config=reasoning_config, freeze_startup_objects=True,
        tokenizer=_check_tokenizer(args.tokenizer), request_defaults=defaults, log_stats=not args.disable_log_stats,
        tool_call_parser=_tool_call_parser(args), data_parallel_size=args.data_parallel_size, routing=args.routing,
        prefill_workers=args.prefill_workers or 0, decode_workers=args.decode_workers or 0,
    )


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser of tool_choice "auto" (`_tool_flag_refusals` checked the flags)."""
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _check_tokenizer(folder: str | None) -> str | None:
    if folder is not None and not any((Path(folder) / name).is_file() for name in model_files.TOKENIZER_FILES):
        raise ValueError(f"--tokenizer {folder}: no tokenizer there (tokenizer.json or the like)")
    return folder


def worker_command(args: argparse.Namespace) -> int:
    from spillway.gateway.link.remote_worker import worker_addresses
    from spillway.worker.runner.device_settings import resolve_device_settings
    from spillway.worker.main import run_worker

    raise_open_file_limit()
    try:
        config, _ = worker_config(args)
        resolve_device_settings(config)  # this is the worker: say what its device cannot run, then stop
        inbox, outbox = worker_addresses(args.connect)
        keys = _worker_keys(args, args.connect)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"spillway worker: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, engine_args.RefusedArgument) else 1
    logging.getLogger("spillway").info("worker for %s connecting to %s", config.served_model_name, args.connect)
    try:
        return run_worker(config, inbox, outbox, parent_pid=None, keys=keys)
    except KeyboardInterrupt:
        return 0


def add_other_commands(parser: argparse.ArgumentParser) -> None:
    """`--version` and the commands besides serve and worker, each in a module of its own whose
    heavy imports wait until it runs."""
    parser.add_argument("-v", "--version", action="version", version=importlib.metadata.version("spillway"))
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    cli_bench.add_parser(commands)
    chat_client.add_parsers(commands)
    collect_env.add_parser(commands)


def run_command(args: argparse.Namespace) -> int:
    match args.command:
        case "serve":
            return serve_command(args)
        case "worker":
            return worker_command(args)
        case "bench":
            return cli_bench.run(args)
        case "chat":
            return chat_client.run_chat(args)
        case "complete":
            return chat_client.run_complete(args)
        case "collect-env":
            return collect_env.run(args)
    raise AssertionError(f"no command {args.command!r}")  # argparse allows only the ones above


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    add_other_commands(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        try:
            argv = expand_config(argv, option_strings(parser, "serve"))
        except ConfigFileError as exc:
            print(f"spillway serve: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    problems = refusals(args)
    if problems:
        command = " ".join(filter(None, (args.command, getattr(args, "bench_command", None))))
        for problem in problems:
            print(f"spillway {command}: {problem}", file=sys.stderr)
        return 2
    if args.command in ("serve", "worker") or getattr(args, "bench_command", "serve") != "serve":
        # Not for the clients: httpx logs every request it sends at INFO.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
