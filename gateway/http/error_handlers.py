"""The app's exception handlers: every error a request meets, answered in OpenAI's error shape
(a client disconnect, which nobody reads, aside)."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from spillway.gateway.api import openai as api
from spillway.gateway.http.responses import error_response

logger = logging.getLogger("spillway.gateway")


async def _api_error(request: Request, exc: api.ApiError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405 in OpenAI's shape, so that a client calling an endpoint this
    server lacks (/v1/responses, /v1/embeddings) reads why."""
    path = request.url.path
    if exc.status_code == 404:
        error = api.ApiError(404, f"{path} is not served by this server", type="not_found_error",
                             code="unknown_route")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        error = api.ApiError(405, f"{request.method} is not allowed on {path}: it takes {allowed}",
                             code="method_not_allowed")
    else:
        error = api.ApiError(exc.status_code, str(exc.detail))
    response = error_response(error)
    response.headers.update(exc.headers or {})
    return response


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    return Response(status_code=400)  # nobody is listening


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(api.ApiError(500, "internal server error", type="server_error"))


HANDLERS = {api.ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone,
            Exception: _internal_error}
