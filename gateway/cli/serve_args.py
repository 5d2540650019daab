"""The command line of `spillway serve` and `spillway worker`, flag for flag as `vllm serve`'s.

A flag vLLM has and Spillway cannot honour is still parsed, so that it is refused by name
(exit status 2) rather than reported as unknown. Defaults are shown in `--help`.
"""

from __future__ import annotations

import argparse

from spillway.gateway.link.client import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_RESPONSE_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S
from spillway.gateway.link.engine_args import BLOCK_SIZES, DTYPES
from spillway.gateway.http.http_protocol import (
    DEFAULT_TIMEOUT_KEEP_ALIVE_S, DEFAULT_TIMEOUT_REQUEST_BODY_S, DEFAULT_TIMEOUT_REQUEST_HEAD_S,
)
from spillway.gateway.replicas.placement import EXECUTOR_BACKENDS
from spillway.gateway.replicas.router import ROUTING_POLICIES
from spillway.gateway.text.reasoning import PARSERS
from spillway.gateway.api.sampling_params import MAX_LOGPROBS, MAX_N
from spillway.gateway.text.template_sandbox import DEFAULT_MEMORY_MIB, DEFAULT_TIMEOUT_S
from spillway.protocol.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from spillway.protocol.local.model_files import LOAD_FORMATS


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _max_n(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_N:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_N}], got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_engine_args(parser: argparse.ArgumentParser):
    """The engine's flags, both commands'; returns the group of disaggregated prefill and decode,
    to which `serve` adds its worker counts."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="a model folder, a .gguf file, or a built-in config with --load-format dummy "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", help="same as the positional MODEL")
    engine.add_argument("--served-model-name", nargs="+", help="names the API answers to (first one reported)")
    engine.add_argument("--dtype", default="auto", choices=DTYPES)
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8 (= fp8_e4m3): float8 e4m3, unscaled, CUDA only")
    engine.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS,
                        help="fp8: the decoder's projections quantized at load to float8 e4m3, one scale per "
                             "output row, activations per token (FP8 tensor cores: compute capability 8.9+; "
                             "plain torch on the CPU). An FP8 checkpoint runs in FP8 without it")
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
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="prompts are always prefilled in chunks of the step's token budget; "
                             "--no-enable-chunked-prefill is refused")
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
    engine.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                        help="engine replicas behind this server, each a worker of its own: on GPUs of their own "
                             "when there are enough, else sharing one GPU's memory (default 1)")
    engine.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default="mp",
                        help="where the replicas' workers run: processes of this host (mp; uni is the same), or "
                             "a Ray cluster (ray: the one this host joined with `ray start`, else a local one), "
                             "each replica in a placement group of its own (default %(default)s)")
    engine.add_argument("--routing", choices=ROUTING_POLICIES, default="prefix",
                        help="how requests spread over the replicas: to the one holding the longest run of the "
                             "prompt's prefix blocks unless it is loaded (prefix), to the least loaded (load), "
                             "or in turn (round-robin) (default %(default)s)")
    engine.add_argument("--attention-backend", metavar="NAME",
                        help="a vLLM attention backend (FLASH_ATTN, TRITON_ATTN, FLASHINFER, ...; for DeepSeek "
                             "V2/V3: FLASHMLA, TRITON_MLA, CUTLASS_MLA, TOKENSPEED_MLA, ...): a name that fits the "
                             "model is taken and Spillway's own kernel runs, named in the worker's log")
    engine.add_argument("--additional-config", metavar="JSON",
                        help='vLLM\'s additional configuration; Spillway reads {"mla_backend": NAME} (as '
                             "--attention-backend) and refuses any other key")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-model", help="a draft model with the target's tokenizer")
    spec.add_argument("--num-speculative-tokens", type=int, help="draft tokens verified per step")
    spec.add_argument("--speculative-draft-tensor-parallel-size", type=int, help="1 or --tensor-parallel-size")
    spec.add_argument("--speculative-config", metavar="JSON",
                      help='{"method": "draft_model" | "ngram", "num_speculative_tokens": K, '
                           '"prompt_lookup_min": N, "prompt_lookup_max": N}')
    refused = parser.add_argument_group("not available yet (refused)")
    refused.add_argument("--swap-space", type=float)
    refused.add_argument("--enable-lora", action="store_true")
    disaggregated = parser.add_argument_group("disaggregated prefill and decode")
    disaggregated.add_argument(
        "--kv-transfer-config", metavar="JSON",
        help='{"kv_connector": NAME, "kv_role": ROLE, ...} (vLLM\'s): this server\'s worker in one role of the '
             "two-server form, where a proxy sends each request to a prefill server, then its answer's "
             "kv_transfer_params with the request to a decode server: kv_producer prefills (answers name its KV "
             "server), kv_consumer decodes what a producer prefilled (pulling its blocks), kv_both either. Every "
             "connector named (HostConnector, Spillway's; vLLM's PyNcclConnector, P2pNcclConnector, NixlConnector) "
             "moves blocks through host memory; kv_ip and kv_port: where a producer listens for consumers on other hosts "
             "(default: this host only). With --prefill-workers and --decode-workers its kv_role must be kv_both")
    return disaggregated


def build_parser() -> argparse.ArgumentParser:
    """The parser of both commands; `--config FILE` is expanded before it runs (config_file.py)."""
    parser = argparse.ArgumentParser(prog="spillway", description="Spillway LLM serving engine", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    # allow_abbrev=False: a vLLM flag Spillway lacks must not pass as a prefix of one it has.
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API", allow_abbrev=False)
    serve.add_argument("--config", metavar="FILE",
                       help="a YAML file of flags (keys are flag names without the dashes); flags given "
                            "on the command line win")
    disaggregated = _add_engine_args(serve)
    _add_frontend_args(serve)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="the port to listen on")
    server.add_argument("--api-key", help="require `Authorization: Bearer <key>` on every route but /health, "
                                          "/ping and /metrics")
    server.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="render chat templates sent with requests (chat_template, chat_template_kwargs."
                             "chat_template), in a child process within the two bounds below and the context's "
                             "length; without it such requests get a 400")
    server.add_argument("--request-chat-template-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        metavar="S", help="a request's chat template that renders for longer gets a 400, its "
                                          "renderer killed and restarted (default %(default)g)")
    server.add_argument("--request-chat-template-memory-mb", type=_positive_int, default=DEFAULT_MEMORY_MIB,
                        metavar="MIB", help="the address space of the process that renders requests' chat "
                                            "templates, its ~200 MiB of modules included; a template that "
                                            "needs more gets a 400 (default %(default)s)")
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
    tools = serve.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model call the request\'s tools by itself (tool_choice "auto", the default '
                            "with tools); needs --tool-call-parser")
    tools.add_argument("--tool-call-parser", metavar="NAME",
                       help="how the model writes tool calls: hermes, qwen3_coder, llama3_json, mistral, "
                            "deepseek_v3, ... (vLLM's names)")
    disaggregated.add_argument("--prefill-workers", type=_positive_int, metavar="N",
                               help="run N producer workers beside the --decode-workers: each prompt is prefilled "
                                    "by a producer (by prefix, as --routing says) and decoded by the least loaded "
                                    "consumer, which pulls the prompt's KV blocks from it; the workers are placed "
                                    "as -dp replicas are (sharing one GPU when there are fewer GPUs). Needs "
                                    "--decode-workers; not with -dp > 1, --api-server-count > 1, --worker-address "
                                    "or --distributed-executor-backend ray")
    disaggregated.add_argument("--decode-workers", type=_positive_int, metavar="M",
                               help="run M consumer workers beside the --prefill-workers (both or neither)")
    server.add_argument("--worker-address", metavar="tcp://HOST:PORT",
                        help="do not start a worker: bind PORT and PORT+1 on HOST and wait for "
                             "`spillway worker MODEL --connect tcp://HOST:PORT`; off loopback, the link "
                             "needs a key ($SPILLWAY_WORKER_KEY or --worker-key-file)")
    _add_worker_key_arg(server)
    server.add_argument("--worker-response-timeout", type=float, default=DEFAULT_RESPONSE_TIMEOUT_S, metavar="S",
                        help="a request that hears nothing from the worker for S seconds ends with an error "
                             "(default %(default)g)")
    server.add_argument("--worker-heartbeat-timeout", type=_positive_float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                        metavar="S", help="a worker silent for S seconds (no heartbeat: stopped or frozen) is "
                                          "lost, a local one killed and replaced (default %(default)g)")
    server.add_argument("--worker-step-timeout", type=_positive_float, default=DEFAULT_STEP_TIMEOUT_S, metavar="S",
                        help="a worker whose one step runs for S seconds is lost, a local one killed and "
                             "replaced (default %(default)g)")
    server.add_argument("--api-server-count", "-asc", type=_positive_int, default=1, metavar="N",
                        help="API server processes on the port, each with its own link to the worker: "
                             "more intake for bursts of long prompts (default 1)")
    server.add_argument("--max-pending-requests", type=_positive_int,
                        help="sequences in flight beyond which requests get 429 (default 4 x --max-num-seqs)")
    server.add_argument("--max-request-body-bytes", type=_positive_int, default=8 << 20)
    server.add_argument("--timeout-keep-alive", type=_positive_float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                        metavar="S", help="close a keep-alive connection idle for S seconds after a response "
                                          "(default %(default)g)")
    server.add_argument("--timeout-request-head", type=_positive_float, default=DEFAULT_TIMEOUT_REQUEST_HEAD_S,
                        metavar="S", help="close a connection whose request line and headers have not all arrived "
                                          "S seconds after it opened or the head began (408; default %(default)g)")
    server.add_argument("--timeout-request-body", type=_positive_float, default=DEFAULT_TIMEOUT_REQUEST_BODY_S,
                        metavar="S", help="close a connection whose request body has not all arrived S seconds "
                                          "after its head (408; default %(default)g); responses are never timed")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--disable-log-requests", action="store_true", help="accepted: requests are not logged")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="no stats line (requests, throughput, KV usage) every 10 s while busy")

    worker = commands.add_parser("worker", help="run a worker for a gateway on another host", allow_abbrev=False)
    _add_engine_args(worker)
    worker.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                        help="the gateway's --worker-address")
    _add_worker_key_arg(worker)
    for command in (serve, worker):
        _show_defaults(command)
    return parser


def _add_frontend_args(serve: argparse.ArgumentParser) -> None:
    """What only the gateway uses: the tokenizer and the defaults and limits of requests."""
    frontend = serve.add_argument_group("requests")
    frontend.add_argument("--tokenizer", metavar="PATH",
                          help="a folder with the tokenizer to use instead of the model's own")
    frontend.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                          help="where requests' sampling defaults come from: auto, the model's "
                               "generation_config.json; vllm, none; or a folder holding one")
    frontend.add_argument("--max-logprobs", type=_non_negative_int, default=MAX_LOGPROBS,
                          help=f"the most logprobs a request may ask for (at most {MAX_LOGPROBS})")
    frontend.add_argument("--max-n", type=_max_n, default=MAX_N, metavar="N",
                          help="the most choices (n) one request may ask for; never more than --max-num-seqs, "
                               "whichever is smaller applies (default: %(default)s)")


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append each flag's default to its help, where it has one worth showing."""
    for action in parser._actions:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or not action.option_strings:
            continue
        if action.help is None:
            action.help = "default: %(default)s"
        elif "%(default)" not in action.help and "default" not in action.help:
            action.help += " (default: %(default)s)"


def _add_worker_key_arg(group) -> None:
    group.add_argument("--worker-key-file", metavar="PATH",
                       help="a file holding the secret (16 bytes or more) that authenticates and encrypts the "
                            "link between gateway and remote worker, the same on both; default $SPILLWAY_WORKER_KEY")


def option_strings(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """Every flag of one command (`serve`, `worker`)."""
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return set(commands.choices[command]._option_string_actions)
