"""The engine's bookkeeping, pure Python: requests, the step plan, the scheduler and its
admission and commits, the block manager with its LRU, prefix lookup and CPU-slot bookkeeping.

Owns every decision about which tokens a step computes and which KV block lives where, as
integers and data; it never touches a tensor. May import: protocol/ (the wire) and the standard
library, nothing else of the worker, and never torch.
"""
