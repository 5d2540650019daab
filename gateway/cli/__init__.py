"""The `spillway` command: `serve`, `worker`, `bench`, `chat`, `complete`, `collect-env`,
flag for flag as vLLM's.

May import: every gateway floor, protocol/ (and the worker only inside `spillway worker`'s
process, where torch is wanted).
"""
