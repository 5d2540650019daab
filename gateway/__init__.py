"""The gateway: the OpenAI-compatible server and the offline API.

Its folders are floors, bottom up: api, text, metrics, link, generation, offline, http, cli.
May import: protocol/ only, never torch or the worker (but `spillway worker`'s own process).
"""

from spillway.gateway.offline.llm import LLM
from spillway.gateway.offline.outputs import CompletionOutput, Logprob, RequestOutput
from spillway.gateway.api.sampling_params import SamplingParams
from spillway.gateway.api.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
