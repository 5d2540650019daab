"""Prometheus metrics under vLLM's names and labels (`model_name`, `engine`): each engine's
gauges and counters, per-request histograms and speculative-decoding counters, written through
that engine's view, and the whole gateway's figures combined over the engines.

May import: protocol/.
"""
