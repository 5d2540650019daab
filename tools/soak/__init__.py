"""Soak runs: mixed traffic against `spillway serve` with the processes' memory sampled
(served.py, with traffic.py and memory.py), and one engine's memory without a server (engine.py)."""
