"""Guards in front of the routes: the API key, and what a request body must say it is."""

from __future__ import annotations

import hashlib
import hmac

from spillway.gateway.api import openai as api
from spillway.gateway.http.responses import error_response


# Decoding a body holds the GIL, and so the event loop, in one piece: up to ~120 ns per JSON
# value or key (msgspec 0.23 on a 2-core machine; a map of short keys and a list of one-item
# lists cost the most, plain token ids ~35 ns). This bound keeps any body's decode under ~30 ms
# whatever its shape; the byte limit alone lets an 8 MiB list of one-digit ids cost ~55 ms.
MAX_BODY_VALUES = 250_000


def check_json_values(body: bytes) -> None:
    """413 for a body with more than MAX_BODY_VALUES separators (`,` `:` `[` `{`), counted in
    C before the decoder runs; those inside strings count too, an upper bound that text within
    any context length stays far below."""
    if len(body) <= MAX_BODY_VALUES:  # too short to hold that many: skip the four scans (~0.1 ms a 50 KB body)
        return
    count = body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")
    if count > MAX_BODY_VALUES:
        raise api.ApiError(413, f"the request body holds {count} JSON values and keys (separators , : [ {{); "
                           f"at most {MAX_BODY_VALUES} are taken: send fewer token ids or prompts per request",
                           code="request_too_large")


def check_json_body(content_type: str | None) -> None:
    """415 unless the body says it is JSON (or says nothing, as scripts may): a page in a
    browser can send `text/plain` or a form to a server without --api-key with no CORS check."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise api.ApiError(415, f"the request body must be application/json, not {media_type or 'empty'}",
                           code="unsupported_media_type")


# What a load balancer or Prometheus polls, without a key; they tell nothing of the model or its prompts.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


class ApiKeyMiddleware:
    """With --api-key, every route but OPEN_PATHS requires `Authorization: Bearer <key>`
    (/tokenize renders the operator's chat template; an unknown path says nothing without it)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = hashlib.sha256(api_key.encode()).digest()

    def _authorized(self, header: bytes) -> bool:
        """`Bearer <key>`, the scheme in any case (RFC 9110); the keys compared as digests of one
        length, in constant time, so the comparison says nothing of the key's length."""
        scheme, _, token = header.strip().partition(b" ")
        given = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(given, self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            if not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                error = api.ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                     code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
