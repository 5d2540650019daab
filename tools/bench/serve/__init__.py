"""Served-path benchmarks: `spillway serve` against `LLM` (serve.py), the gateway alone against a
fake worker (gateway_alone.py), its intake (intake.py), shared-socket accepts (accept.py), the
worker link's CURVE cost (link.py); server_process.py and stream_client.py start a server and
time its streams for these and for tools/soak/."""
