"""Routes that describe the server: the model list (vLLM's model cards), the version, and the
OpenAPI document."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import Response

from spillway.gateway.api import answers
from spillway.gateway.http.openapi_schema import openapi_document
from spillway.gateway.http.responses import json_response


async def models(request: Request) -> Response:
    """The served names as vLLM's model cards: `root` is the model they serve."""
    gateway = request.app.state.gateway
    ready = gateway.client.ready
    root = gateway.settings.model_root or gateway.served_names[0]
    permission = [answers.ModelPermission(f"modelperm-{gateway.created}", gateway.created)]
    cards = [answers.ModelCard(id=name, created=gateway.created, root=root, max_model_len=ready.max_model_len,
                               permission=permission) for name in gateway.served_names]
    return json_response(answers.ModelList(cards))


async def version_endpoint(request: Request) -> Response:
    return json_response({"version": _version()})


async def openapi_endpoint(request: Request) -> Response:
    """This server's routes and body schemas as an OpenAPI document."""
    return json_response(openapi_document(request.app.routes, _version()))


def _version() -> str:
    try:
        return version("spillway")
    except PackageNotFoundError:
        return "unknown"
