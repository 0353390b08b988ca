"""ASGI middleware of the API: a cap on request bodies (API4) and no NUL bytes in a path or query."""

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """ASGI middleware: a request body over max_bytes gets a 413, whether or not it declared its length."""

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: Callable[[Scope], bool] = lambda _scope: False):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt  # exempt: a route with a cap of its own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_large(send)
        seen, answered = 0, False

        async def limited_receive() -> Message:
            # Past the limit: answer 413 now, and tell the app the client went away (an exception here
            # would be turned into a 400 by the body parser).
            nonlocal seen, answered
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not answered:
                    answered = True
                    await self._too_large(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:  # once the 413 is out, whatever the app still says is dropped
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not answered:
                raise

    async def _too_large(self, send: Send) -> None:
        body = (f'{{"detail":"request body larger than {self.max_bytes} bytes","field":"body"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class RefuseNul:
    """ASGI middleware: a NUL byte in the path or query is a 422 (PostgreSQL text cannot hold one)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path", b"") + b"?" + scope.get("query_string", b"")
            if b"%00" in raw or b"\x00" in raw or "\x00" in scope.get("path", ""):
                body = b'{"detail":"NUL bytes are not allowed in the path or query","field":"query"}'
                await send({"type": "http.response.start", "status": 422, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
