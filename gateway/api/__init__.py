"""The OpenAI and vLLM surfaces as data: request and answer bodies, sampling parameters,
request defaults and checks, log-probability answers, prompt token ids.

May import: protocol/ and the standard library; nothing else of the gateway.
"""
