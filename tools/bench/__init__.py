"""Benchmarks by subject, each a script (`python tools/bench/<subject>/<name>.py --help`) that prints
its figures beside a baseline measured in the same run: kernels/ (attention kernels, their PTX,
the matrix products at graph buckets), engine/ (one engine in-process: decode, prefill,
throughput, speculation, stats, offline), tier/ (the CPU KV tier: copies, loads, admission,
landing, served), serve/ (`spillway serve` and the gateway alone, the link, intake, accept).

Shared here: ceilings.py (the machine's bandwidth and matrix rate, a device timer) and
result_rows.py (rows printed, saved as JSON lines, tabled). torch and the engine are imported
where a benchmark measures, after its arguments are parsed, so that every --help runs on any
machine in well under a second (tests/tools/test_every_tool_runs.py).

They may import spillway's public names and tools.loadgen; tools/soak/ imports serve/'s server
process and streaming client; besides them only tests import them.
"""
