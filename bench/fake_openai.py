"""An instant OpenAI-compatible server: numbered words, streamed or whole, for tests and benchmarks of
the `openai` backend kind and of routing (and for a gateway under comparison to call).

    .venv/bin/python -m bench.fake_openai --port 8091 [--mode ok|fail|stall|busy] [--token-delay-ms 0]

`/v1/chat/completions` and `/v1/completions` answer `max_tokens` words "w0 w1 ...", with the usage
(`stream_options.include_usage`). Modes, also settable at run time with `POST /admin/mode?mode=...`
(tests flip a member from healthy to failing to stalled): `fail` answers 500, `stall` waits
`--stall-s` before answering, `busy` answers 429 with `retry-after: 1`. `GET /admin/stats` counts the
requests served, the streams a client left early and the connections clients opened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class State:
    mode: str = "ok"
    token_delay_ms: float = 0.0
    stall_s: float = 5.0
    served: int = 0
    refused: int = 0
    refused_at: list[float] = field(default_factory=list)  # when each refusal (500 or 429) was answered
    left_early: int = 0
    peers: set[int] = field(default_factory=set)  # the clients' ports: one per connection they opened


def create_app(state: State) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        if request.client is not None:
            state.peers.add(request.client.port)
        chat = request.url.path.endswith("chat/completions")
        if state.mode == "fail":
            state.refused += 1
            state.refused_at.append(time.time())
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        if state.mode == "busy":
            state.refused += 1
            state.refused_at.append(time.time())
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit"}}, status_code=429, headers={"retry-after": "1"})
        if state.mode == "stall":
            await asyncio.sleep(state.stall_s)
        state.served += 1
        n = int(body.get("max_tokens") or 16)
        words = [f"w{i} " for i in range(n)]
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        created, model = int(time.time()), body.get("model", "fake")
        if not body.get("stream"):
            if state.token_delay_ms:  # as long as its stream would take
                await asyncio.sleep(n * state.token_delay_ms / 1000)
            text = "".join(words)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            return JSONResponse({"id": "fake", "object": "chat.completion" if chat else "text_completion", "created": created,
                                 "model": model, "choices": [{**choice, "finish_reason": "length"}], "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            try:
                for i, word in enumerate(words):
                    if state.token_delay_ms:
                        await asyncio.sleep(state.token_delay_ms / 1000)
                    choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                    choice["finish_reason"] = "length" if i == n - 1 else None
                    yield _sse({"id": "fake", "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]})
                yield _sse({"id": "fake", "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                state.left_early += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    async def mode(request: Request) -> Response:
        state.mode = request.query_params.get("mode", "ok")
        return JSONResponse({"mode": state.mode})

    async def stats(request: Request) -> Response:
        return JSONResponse({"served": state.served, "refused": state.refused, "left_early": state.left_early, "mode": state.mode,
                             "connections": len(state.peers)})

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/admin/mode", mode, methods=["POST"]),
        Route("/admin/stats", stats, methods=["GET"]),
    ])


def _sse(event: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class FakeUpstream:
    """The server in this event loop on 127.0.0.1:`port` (tests): `async with FakeUpstream(port) as fake`."""

    def __init__(self, port: int, state: State | None = None) -> None:
        self.port = port
        self.state = state or State()
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> FakeUpstream:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--mode", default="ok", choices=["ok", "fail", "stall", "busy"])
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--stall-s", type=float, default=5.0)
    args = parser.parse_args()
    state = State(mode=args.mode, token_delay_ms=args.token_delay_ms, stall_s=args.stall_s)
    uvicorn.run(create_app(state), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
