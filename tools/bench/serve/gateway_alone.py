"""The gateway alone, on the CPU: `spillway serve`'s app against a fake worker that produces
one token per running request every `--step-ms` (tests/gateway/fake_worker.py), driven by
tools/bench/serve/serve.py's streaming client. The engine costs nothing here, so what the served path
loses is the gateway's (or the client's: its CPU is reported too).

    python tools/bench/serve/gateway_alone.py                          # this tree: 256 x (128/512), 4 ms steps
    python tools/bench/serve/gateway_alone.py --baseline DIR           # and a tree at DIR, alternating, same run
                                                           #   (mkdir DIR && git archive REV | tar -x -C DIR)
    python tools/bench/serve/gateway_alone.py --client-from DIR        # this tree's gateway, DIR's client against this one's
    python tools/bench/serve/gateway_alone.py --streams 50 --prompt-len 10000 --output-len 4 --step-ms 2 --bursts 10
                                                           # intake: a burst of long prompts, ten times

Per run: delivered output tok/s, its ratio to the fake engine's rate (streams / step time:
1.0 means the served path kept up), the gateway process's CPU (cores, microseconds per token
and per request), the client's CPU, tokens per SSE event, and per burst (medians over
`--bursts`) the time from the first request's arrival at the fake worker to the last's and the
slowest time to first token; with `--hold-ms`, the first token and the time from the first send
to the first arrival at the worker (the way in), against a lone request's. `--preconnect` opens
every connection before the sends (tools/bench/serve/stream_client.py: the clocks then leave out this one
client's connects).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

from spillway.tools.bench.serve.server_process import build_model_folder, cpu_seconds, default_tokenizer_dir, free_port  # noqa: E402
from spillway.tools.bench.serve.stream_client import stream_all  # noqa: E402

MODEL = "smollm2-135m"
SERVED_NAME = "bench"


def serve(port: int, folder: str, step_s: float, max_num_seqs: int, arrivals_path: str, hold_s: float) -> None:
    """The child: the app of `spillway serve` on `port`, its worker the fake one."""
    sys.path.insert(0, str(ROOT / "tests" / "gateway"))
    import uvicorn
    from fake_worker import FakeWorkerProcess

    from spillway.gateway.http.app import ServerSettings, build_app
    from spillway.protocol.config import WorkerConfig

    config = WorkerConfig(model=folder, served_model_name=SERVED_NAME, max_model_len=32768, load_format="dummy",
                          max_num_seqs=max_num_seqs)
    rng = random.Random(0)
    script = [rng.randrange(256, 49152) for _ in range(997)]  # random text, as tools/bench/serve/serve.py's prompts
    # As `spillway serve` builds them (a baseline tree may lack the setting).
    settings_names = {field.name for field in dataclasses.fields(ServerSettings)}
    frozen = {"freeze_startup_objects": True} if "freeze_startup_objects" in settings_names else {}
    settings = ServerSettings(worker=config, served_model_names=[SERVED_NAME], max_pending=4 * max_num_seqs, **frozen)
    app = build_app(settings, lambda: FakeWorkerProcess(config, script, step_s=step_s, arrivals_path=arrivals_path,
                                                                 hold_s=hold_s))
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", log_level="warning")


def tree_env(tree: Path | None) -> dict[str, str]:
    """The environment of a child that imports `tree`'s gateway and protocol packages as
    spillway's (None: the installed ones)."""
    env = dict(os.environ)
    if tree is not None:
        site = Path(tempfile.mkdtemp(prefix="bench-gateway-site-")) / "spillway"
        site.mkdir()
        for package in ("gateway", "protocol"):
            (site / package).symlink_to(tree.resolve() / package)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.parent), env.get("PYTHONPATH")]))
    return env


def start_gateway(tree: Path | None, folder: Path, args, arrivals: Path) -> tuple[subprocess.Popen, str]:
    """`tree`: serve that tree's gateway and protocol packages instead of the installed ones;
    the fake worker writes each request's arrival to `arrivals`."""
    env = tree_env(tree)
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--folder", str(folder),
                              "--step-ms", str(args.step_ms), "--streams", str(args.streams),
                              "--arrivals", str(arrivals), "--hold-ms", str(args.hold_ms)], env=env)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"the gateway exited with {child.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return child, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    child.kill()
    raise TimeoutError("the gateway did not become healthy")


def client_from(tree: Path):
    """`stream_all` of the streaming client in another tree's tools/bench/serve/stream_client.py."""
    spec = importlib.util.spec_from_file_location("baseline_serve_stream", tree / "tools" / "bench" / "serve" / "stream_client.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.stream_all


def measure(label: str, tree: Path | None, folder: Path, args, client=stream_all) -> dict:
    rng = random.Random(1)
    prompts = [[rng.randrange(256, 49152) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    handle, name = tempfile.mkstemp(prefix="bench-gateway-arrivals-")
    os.close(handle)
    arrivals = Path(name)
    child, url = start_gateway(tree, folder, args, arrivals)
    connect = {"preconnect": True} if args.preconnect else {}  # a client from before the option takes none
    try:
        asyncio.run(client(url, prompts[:2], 4, SERVED_NAME))  # warm-up
        gateway_cpu = client_cpu = wall = 0.0
        timings, spreads, slowest_ttft, median_ttft, alone_ttft = [], [], [], [], []
        way_in, alone_way_in = [], []  # the first send to the first arrival at the worker
        for _ in range(args.bursts):
            seen = len(read_arrivals(arrivals))
            gateway_before, client_before = cpu_seconds(child.pid), time.process_time()
            burst, burst_wall = asyncio.run(client(url, prompts, args.output_len, SERVED_NAME, **connect))
            gateway_cpu += cpu_seconds(child.pid) - gateway_before
            client_cpu += time.process_time() - client_before
            wall += burst_wall
            timings += burst
            arrived = read_arrivals(arrivals)[seen:]
            spreads.append(max(arrived) - min(arrived))
            way_in.append(min(arrived) - min(t.start for t in burst))
            slowest_ttft.append(max(t.ttft for t in burst))
            median_ttft.append(statistics.median(t.ttft for t in burst))
            if args.hold_ms:  # one request alone on the idle fake worker, held the same
                seen = len(read_arrivals(arrivals))
                alone = asyncio.run(client(url, prompts[:1], args.output_len, SERVED_NAME, **connect))[0][0]
                alone_ttft.append(alone.ttft)
                alone_way_in.append(read_arrivals(arrivals)[seen] - alone.start)
    finally:
        child.terminate()
        child.wait(20)
        arrivals.unlink()
    tokens = sum(t.completion_tokens for t in timings)
    events = [n for t in timings for n in t.event_tokens]
    engine_rate = args.streams / (args.step_ms / 1e3)
    result = {"label": label, "tok_s": tokens / wall, "of_engine": tokens / wall / engine_rate,
              "gateway_cores": gateway_cpu / wall, "gateway_us_per_token": gateway_cpu / tokens * 1e6,
              "gateway_us_per_request": gateway_cpu / len(timings) * 1e6,
              "client_cores": client_cpu / wall, "tokens_per_event": sum(events) / len(events), "wall_s": wall,
              "arrival_spread_ms": statistics.median(spreads) * 1e3,
              "slowest_ttft_ms": statistics.median(slowest_ttft) * 1e3,
              "median_ttft_ms": statistics.median(median_ttft) * 1e3,
              "way_in_ms": statistics.median(way_in) * 1e3}
    held = ""
    if alone_ttft:
        result["alone_ttft_ms"] = statistics.median(alone_ttft) * 1e3
        result["alone_way_in_ms"] = statistics.median(alone_way_in) * 1e3
        held = (f", first token p50 {result['median_ttft_ms']:.1f} ms against {result['alone_ttft_ms']:.1f} alone "
                f"(alone/burst {result['alone_ttft_ms'] / result['median_ttft_ms']:.3f}); first send to first "
                f"arrival {result['way_in_ms']:.1f} ms against {result['alone_way_in_ms']:.1f} alone")
    print(f"{label:>10}: {result['tok_s']:>9,.1f} tok/s ({result['of_engine']:.3f} of the fake engine's "
          f"{engine_rate:,.0f}), gateway {result['gateway_cores']:.2f} cores = "
          f"{result['gateway_us_per_token']:.1f} us/token = {result['gateway_us_per_request']:.0f} us/request, "
          f"client {result['client_cores']:.2f} cores, {result['tokens_per_event']:.2f} tokens/event, "
          f"{wall:.1f} s; per burst: arrivals over {result['arrival_spread_ms']:.1f} ms, "
          f"slowest first token {result['slowest_ttft_ms']:.1f} ms{held}", flush=True)
    return result


def read_arrivals(path: Path) -> list[float]:
    """The fake worker's arrival times so far (it flushes each line as it writes it)."""
    return [float(line) for line in path.read_text().split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--step-ms", type=float, default=4.0, help="the fake engine's step time")
    parser.add_argument("--baseline", type=Path, help="a source tree to compare against, in the same run")
    parser.add_argument("--client-from", type=Path, help="a source tree whose streaming client also drives this "
                        "tree's gateway, alternating with this tree's client")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each tree, alternating")
    parser.add_argument("--bursts", type=int, default=1, help="the streams sent at once this many times per run, "
                        "one after another (short bursts are too brief for the CPU clock's 10 ms ticks)")
    parser.add_argument("--hold-ms", type=float, default=0.0,
                        help="the fake worker holds a burst's first step this long after its first arrival (a "
                        "shared prefix loading from the CPU tier); adds a lone request per burst, held the same, "
                        "and the ratio of its first token to the burst's median")
    parser.add_argument("--preconnect", action="store_true", help="open every request's connection before the "
                        "sends, each clock started at its send (tools/bench/serve/stream_client.py)")
    parser.add_argument("--tokenizer-dir", type=Path, help="the tokenizer files (default: the default model's)")
    parser.add_argument("--results", type=Path, help="append each run as a JSON line")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--arrivals", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bursts < 1:
        parser.error("--bursts must be at least 1")
    if args.serve is not None:
        serve(args.serve, args.folder, args.step_ms / 1e3, args.streams, args.arrivals, args.hold_ms / 1e3)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        folder = build_model_folder(MODEL, args.tokenizer_dir or default_tokenizer_dir(), Path(tmp))
        print(f"{args.streams} streams x ({args.prompt_len}/{args.output_len}) x {args.bursts} bursts, fake engine "
              f"step {args.step_ms} ms; machine: {os.cpu_count()} CPUs", flush=True)
        results = []
        for _ in range(args.repeats):
            if args.baseline is not None:
                results.append(measure("baseline", args.baseline, folder, args))
            if args.client_from is not None:
                results.append(measure("its client", None, folder, args, client_from(args.client_from)))
            results.append(measure("this tree", None, folder, args))
    if args.results is not None:
        with args.results.open("a") as f:
            for result in results:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
