"""Disaggregated prefill and decode between workers (protocol/kv_transfer.py): the process's KV
sockets, a producer's KV server (a ROUTER that answers pulls) and a consumer's DEALER per producer,
the wire's framing of blocks, and where the server listens. Polled with the gateway links by the
busy loop (worker/main.py); what the blocks are and where they go is the engine's
(worker/driver/engine.py, worker/driver/kv_pulls.py).

May import: worker/driver and every floor below it, protocol/, zmq.
"""
