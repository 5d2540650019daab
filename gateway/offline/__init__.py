"""The offline API: `LLM`, its inputs and outputs (vLLM's names), on an event loop of its own
over the same client and generation code as the server.

May import: the gateway floors below it (api, text, metrics, link, replicas, generation), protocol/.
"""
