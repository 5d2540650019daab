"""An ASGI app around another that keeps each POST's path and JSON body: what a client sent."""

from __future__ import annotations

import json


class Recording:
    """The app, keeping each POST's path and JSON body."""

    def __init__(self, app) -> None:
        self.app = app
        self.posts: list[tuple[str, dict]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks = []

        async def keep():
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                self.posts.append((scope["path"], json.loads(b"".join(chunks) or b"{}")))
            return message

        return await self.app(scope, keep, send)

    def bodies(self, path: str) -> list[dict]:
        return [body for at, body in self.posts if at == path]
