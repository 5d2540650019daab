"""Engine benchmarks, in one process without a server: batch-1 decode, prefill, throughput and
their kernels (engine.py), speculative decoding (spec.py), offline `LLM` against Hugging Face
(offline.py), a Stats report's cost (stats.py); two_trees.sh runs engine.py for two trees."""
