"""The gateway: the OpenAI-compatible server and the offline API."""

from spillway.gateway.llm import LLM
from spillway.gateway.outputs import CompletionOutput, Logprob, RequestOutput
from spillway.gateway.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
