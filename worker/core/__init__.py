"""The engine's bookkeeping, pure Python: requests, the step plan, the scheduler and its
admission and commits, the block manager with its LRU, prefix lookup, the verbs of the tier
below it (tier.py: the CPU tier's slots, cpu_slots.py, or the null tier) and the log of its
KV events (kv_events.py).

Owns every decision about which tokens a step computes and which KV block lives where, as
integers and data; it never touches a tensor. May import: protocol/ (the wire) and the standard
library, nothing else of the worker, and never torch.
"""
