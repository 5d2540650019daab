"""Guards in front of the routes: the API key, and what a request body must say it is."""

from __future__ import annotations

import hashlib
import hmac

from spillway.gateway import openai as api
from spillway.gateway.responses import error_response


def check_json_body(content_type: str | None) -> None:
    """415 unless the body says it is JSON (or says nothing, as scripts may): a page in a
    browser can send `text/plain` or a form to a server without --api-key with no CORS check."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise api.ApiError(415, f"the request body must be application/json, not {media_type or 'empty'}",
                           code="unsupported_media_type")


class ApiKeyMiddleware:
    """With --api-key, /v1/* and /invocations require `Authorization: Bearer <key>`."""

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
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] == "/invocations"):
            if not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                error = api.ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                     code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
