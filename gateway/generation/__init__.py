"""From a validated request to worker requests and back to text: jobs (model checked,
prompts tokenized) and the generation that streams deltas, shared by the server and `LLM`.

May import: gateway/api, gateway/text, gateway/metrics, gateway/link, protocol/.
"""
