"""The worker process: one engine behind ZeroMQ links to the gateway.

Its folders are floors, bottom up: core (bookkeeping, no torch), kv_tier, sample, attention,
models, runner, tp, speculative, driver, kv_transfer (the sockets between workers). The files at
this level are the process itself (the busy loop in main, the gateway links, the heartbeat, the
step trace) and may import any floor.
May import: protocol/ and kernels/, never the gateway.
"""
