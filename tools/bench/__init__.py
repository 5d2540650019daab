"""Benchmarks by subject, each a script (`python tools/bench/<subject>/<name>.py --help`) that prints
its figures beside a baseline measured in the same run: kernels/ (attention kernels, their PTX,
the matrix products at graph buckets), engine/ (one engine in-process: decode, prefill,
throughput, speculation, stats, offline), tier/ (the CPU KV tier: copies, loads, admission,
landing, served), serve/ (`spillway serve` and the gateway alone, the link, intake, accept).

Shared here: ceilings.py (the machine's bandwidth and matrix rate, a device timer) and
result_rows.py (rows printed, saved as JSON lines, tabled). Benchmarks import spillway's public
names only, and torch where they measure (after parsing their arguments, so --help stays fast).
"""
