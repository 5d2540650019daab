"""The gateway's link to its worker: the asynchronous client, the worker link (start, read,
send, notice its death), local and remote worker processes, and the engine arguments that
become a worker's configuration.

May import: gateway/api, gateway/text, gateway/metrics, protocol/.
"""
