"""From a validated OpenAI request to a Job: the model name checked, the prompts tokenized
(long ones off the event loop), the lengths checked against the worker's limits.

Nothing here holds the event loop for long: a request's prompts over INLINE_TOKENIZE_CHARS in
all and id lists over LONG_DECODE_TOKENS are (de)tokenized on a thread, prompt text too long to
fit the context whatever its tokens is refused with 413 before the tokenizer sees it, and a
request for more choices (n) or sequences than the server takes is refused before any prompt is
looked at."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial

from spillway.gateway.api import openai as api
from spillway.gateway.api import request_checks as checks
from spillway.gateway.text.chat_messages import ChatRender, chat_render, template_messages
from spillway.gateway.api.kv_transfer_params import KvTransferAsk, kv_transfer_ask
from spillway.gateway.api.prompt_ids import Prompt
from spillway.gateway.api.request_defaults import RequestDefaults
from spillway.gateway.api.sampling_params import MAX_N, SamplingParams
from spillway.gateway.api.tool_choice import ToolUse, check_no_other_constraint, tool_use
from spillway.gateway.generation.tool_answers import tool_constraint
from spillway.gateway.text.template_sandbox import TemplateLimitExceeded, TemplateSandbox
from spillway.gateway.text.tokenizer import LONG_DECODE_TOKENS, PromptTokenizer
from spillway.protocol.local import model_files
from spillway.protocol.messages import Ready

# Prompts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 16_384
UNTRUSTED_TEMPLATE = ("this server does not render chat templates sent with requests (chat_template, or "
                      "chat_template_kwargs.chat_template): start it with --trust-request-chat-template to allow them")


@dataclass(slots=True)
class Job:
    """A checked generation request: everything needed to run it and format its answer."""

    request_id: str
    chat: bool
    model: str
    prompts: list[Prompt]
    params: SamplingParams
    max_tokens: list[int]  # per prompt, after max_model_len
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    priority: int = 0
    cache_salt: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    response_id: str | None = None  # the answer's id when the client chose it (request_id)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the answer
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (return_tokens_as_token_ids)
    tool_use: ToolUse | None = None  # chat: the tools the model may call (gateway/api/tool_choice.py)
    tool_parser: str | None = None  # the server's --tool-call-parser, for tool_choice "auto"
    kv_transfer: KvTransferAsk | None = None  # the two-server form's kv_transfer_params (prefill or decode here)

    @property
    def answer_id(self) -> str:
        return self.response_id or self.request_id


class JobBuilder:
    """Checks requests against the model (names, lengths, vocabulary) and tokenizes them."""

    def __init__(self, tokenizer: PromptTokenizer | None, served_names: list[str], ready_fn,
                 reasoning: bool = False, defaults: RequestDefaults = RequestDefaults(),
                 max_sequences: int | None = None, sandbox: TemplateSandbox | None = None,
                 max_n: int = MAX_N, tool_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice; None: "auto" refused
        self.max_n = max_n  # choices per request (--max-n), and never more than the worker's max_num_seqs
        self.sandbox = sandbox  # renders requests' own chat templates; None: they are refused
        self._sandbox_turn = asyncio.Lock()  # one request's template at a time, so one pool thread
        self.max_sequences = max_sequences  # prompts x n in one request; None: no bound
        self.defaults = defaults  # --generation-config and --max-logprobs
        self.served_names = served_names
        self.reasoning = reasoning  # the server has a reasoning parser
        self._ready = ready_fn  # the current worker's Ready (it may have been restarted)

    @property
    def ready(self) -> Ready:
        return self._ready()

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_names or model in model_files.model_aliases(self.served_names[0]):
            return self.served_names[0]
        raise api.ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def require_tokenizer(self) -> PromptTokenizer:
        if self.tokenizer is None:
            raise api.bad_request("this model has no tokenizer: send prompts as token ids", code="no_tokenizer")
        return self.tokenizer

    async def chat_job(self, request: api.ChatCompletionRequest) -> Job:
        model = self.check_model(request.model)
        checks.check_unsupported(request)
        request = self.defaults.apply(request)
        messages = template_messages(request.messages)
        render = chat_render(request)
        logprobs = checks.chat_logprobs(request)
        self.defaults.check_logprobs(logprobs, "top_logprobs")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        params = checks.sampling_params(request, max_tokens, logprobs)
        use = tool_use(request, auto_enabled=self.tool_parser is not None)
        if use is not None:
            # The template renders the tools (its `tools` variable); "required" and a named
            # function hold the output to their calls' JSON.
            render = replace(render, chat_template_kwargs={**render.chat_template_kwargs, "tools": use.tools})
            check_no_other_constraint(use, params.structured_outputs)
            try:
                params.structured_outputs = tool_constraint(use) or params.structured_outputs
            except ValueError as exc:
                raise api.bad_request(str(exc), param="tools") from None
        self._check_sequences(params.n, params.n)
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        token_ids = await self.encode_chat(messages, render)
        job = self._job("chatcmpl", True, model, [self._truncate(Prompt(token_ids), request)], params, request)
        job.tool_use, job.tool_parser = use, self.tool_parser
        return job

    async def completion_job(self, request: api.CompletionRequest) -> Job:
        model = self.check_model(request.model)
        checks.check_unsupported(request)
        request = self.defaults.apply(request)
        self.defaults.check_logprobs(request.logprobs, "logprobs")
        max_tokens = request.max_tokens
        if max_tokens is None and self.defaults.max_tokens is None:
            max_tokens = 16  # the OpenAI API's default for completions
        params = checks.sampling_params(request, max_tokens, request.logprobs)
        given = checks.completion_prompts(request.prompt)
        self._check_sequences(params.n, len(given) * params.n)
        texts = [prompt for prompt in given if isinstance(prompt, str)]
        for text in texts:
            self.check_prompt_chars(len(text), "prompt")
        encoded = iter(await self.encode_all(texts, request.add_special_tokens))
        prompts = [self._truncate(Prompt(next(encoded), prompt) if isinstance(prompt, str) else prompt, request)
                   for prompt in given]
        return self._job("cmpl", False, model, prompts, params, request)

    def _check_sequences(self, n: int, num_sequences: int) -> None:
        limit = min(self.max_n, self.ready.max_num_seqs)
        if n > limit:
            # More choices than the worker runs at once would be run in turns against its own.
            raise api.bad_request(f"n={n} exceeds this server's limit of {limit} choices per request (the "
                                  f"smaller of --max-n {self.max_n} and --max-num-seqs {self.ready.max_num_seqs})",
                                  param="n", code="integer_above_max_value")
        if self.max_sequences is not None and num_sequences > self.max_sequences:
            raise api.bad_request(f"{num_sequences} sequences (prompts x n) exceed this server's limit of "
                                  f"{self.max_sequences}", param="n")

    def _truncate(self, prompt: Prompt, request) -> Prompt:
        """The last `truncate_prompt_tokens` of the prompt (-1: of the model's context length)."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return prompt
        return prompt.truncated(self.ready.max_model_len if keep == -1 else keep)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_all([text], add_special_tokens))[0]

    async def encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's token ids; on a thread when they are long together (a thousand short
        prompts tokenized one after another would hold the event loop as one long one does)."""
        if not texts:  # token-id prompts only: a model without a tokenizer takes them
            return []
        tokenizer = self.require_tokenizer()

        def encode() -> list[list[int]]:
            if add_special_tokens:
                return [tokenizer.encode(text) for text in texts]
            return [list(tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]

        if sum(map(len, texts)) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(encode)
        return encode()

    async def encode_chat(self, messages: list[dict], render: ChatRender) -> list[int]:
        """The conversation's token ids. A request's own template (any route) is refused unless
        the server trusts them, and then rendered by the sandbox, on a thread while it waits."""
        tokenizer = self.require_tokenizer()
        sandbox = None
        if render.chat_template is not None:
            if self.sandbox is None:
                raise api.bad_request(UNTRUSTED_TEMPLATE, param="chat_template", code="untrusted_chat_template")
            # Text longer than this never fits the context (check_prompt_chars).
            sandbox = partial(self.sandbox.render, max_chars=self.ready.max_model_len * tokenizer.max_token_chars)

        def encode() -> list[int]:
            try:
                return tokenizer.encode_chat(messages, **render.kwargs(), sandbox=sandbox)
            except TemplateLimitExceeded as exc:
                raise api.bad_request(str(exc), param="chat_template", code="chat_template_limit") from None
            except ValueError as exc:
                raise api.bad_request(str(exc), param="messages") from None
            except TypeError as exc:  # a chat_template_kwargs key the tokenizer rejects
                raise api.bad_request(f"cannot apply the chat template: {exc}",
                                      param="chat_template_kwargs") from None

        if sandbox is not None:
            async with self._sandbox_turn:
                return await asyncio.to_thread(encode)
        if sum(len(m["content"]) for m in messages) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(encode)
        return encode()

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids checked against the vocabulary, then decoded; a long list on a thread."""
        tokenizer = self.require_tokenizer()
        vocab_size = self.ready.vocab_size

        def decode() -> str:
            # Checked a slice at a time: one min() over millions of ids holds the GIL for tens of ms.
            for start in range(0, len(token_ids), LONG_DECODE_TOKENS):
                part = token_ids[start:start + LONG_DECODE_TOKENS]
                if min(part) < 0 or max(part) >= vocab_size:
                    raise api.bad_request(f"token ids must lie in [0, {vocab_size})", param="tokens")
            return tokenizer.decode(token_ids)

        if len(token_ids) > LONG_DECODE_TOKENS:
            return await asyncio.to_thread(decode)
        return decode()

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """No token stands for more than `max_token_chars` characters, so longer text than the
        context times that never fits: refused before the tokenizer spends seconds on it."""
        tokenizer = self.require_tokenizer()
        limit = self.ready.max_model_len * tokenizer.max_token_chars
        if num_chars > limit:
            raise api.ApiError(413, f"the prompt has {num_chars} characters; this model takes at most {limit} "
                               f"({self.ready.max_model_len} tokens of context, each at most "
                               f"{tokenizer.max_token_chars} characters)", param=param, code="request_too_large")

    def _job(self, prefix: str, chat: bool, model: str, prompts: list[Prompt], params: SamplingParams,
             request) -> Job:
        if params.thinking_budget is not None and not self.reasoning:
            raise api.bad_request("thinking_budget needs a reasoning parser: start the server with "
                                  "--enable-reasoning (or --reasoning-parser / --reasoning-config)",
                                  param="thinking_budget")
        max_tokens = [self._check_prompt(p, params.max_tokens, "messages" if chat else "prompt") for p in prompts]
        if params.min_tokens > min(max_tokens):
            raise api.bad_request(f"min_tokens ({params.min_tokens}) exceeds the room left for the completion "
                                  f"({min(max_tokens)} tokens in this model's context)", param="min_tokens")
        kv_transfer = kv_transfer_ask(request.kv_transfer_params, self.ready)
        options = request.stream_options
        stream = bool(request.stream)
        return Job(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            chat=chat,
            model=model,
            prompts=prompts,
            params=params,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=bool(stream and options is not None and options.include_usage),
            continuous_usage=bool(stream and options is not None and options.include_usage
                                  and options.continuous_usage_stats),
            priority=request.priority,
            cache_salt=request.cache_salt,
            response_id=f"{prefix}-{request.request_id}" if request.request_id else None,
            return_token_ids=bool(request.return_token_ids),
            tokens_as_ids=bool(request.return_tokens_as_token_ids),
            kv_transfer=kv_transfer,
        )

    def _check_prompt(self, prompt: Prompt, max_tokens: int | None, param: str) -> int:
        """The prompt fits with room for output, its ids in the vocabulary (and packed, for the
        wire); returns the resolved max_tokens."""
        ready, token_ids = self.ready, prompt.token_ids
        limit = ready.max_model_len
        if not token_ids:
            raise api.bad_request("the prompt is empty", param=param)
        if len(token_ids) >= limit or (max_tokens is not None and len(token_ids) + max_tokens > limit):
            requested = len(token_ids) + (max_tokens or 1)
            raise api.bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested} tokens ({len(token_ids)} in the prompt, {max_tokens or 1} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param=param, code="context_length_exceeded")
        if not prompt.pack_in_vocab(ready.vocab_size):  # after the length: a bounded pass
            raise api.bad_request(f"prompt token ids must lie in [0, {ready.vocab_size})", param=param)
        if max_tokens is not None:
            return max_tokens
        return min(limit - len(token_ids), self.defaults.max_tokens or limit)
