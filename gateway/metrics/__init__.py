"""Prometheus metrics under vLLM's names: the engine's gauges and counters, per-request
histograms and the speculative-decoding counters.

May import: protocol/.
"""
