"""A loopback HTTP server that streams scripted chat-completion chunks: the ways other
OpenAI-compatible servers differ (reasoning deltas, chunks without choices, usage only when
asked, [DONE] before a finish reason, a stream cut off midway), which `miniapp serve` and
llama.cpp's server do not produce. It records each request body it receives."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "scripted-model"


def chunk(
    content: str | None = None,
    reasoning: str | None = None,
    finish: str | None = None,
    choices: bool = True,
    usage: dict | None = None,
    tool_call: dict | None = None,
) -> dict:
    """One chat.completion.chunk."""
    delta: dict = {"tool_calls": [tool_call]} if tool_call else {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [choice] if choices else [],
    }
    if usage is not None:
        body["usage"] = usage
    return body


class ScriptedServer:
    """Answers GET /v1/models and POST /v1/chat/completions with `script`: the chunks to
    stream, then [DONE] unless `drop` (cut the connection instead, mid-stream)."""

    def __init__(
        self,
        script: list[dict],
        drop: bool = False,
        usage: dict | None = None,
        vision: bool | None = None,
    ):
        """`vision`: what its /props says of the model's pictures (None: no /props, as on
        most servers)."""
        self.script, self.drop, self.usage, self.vision = script, drop, usage, vision
        self.requests: list[dict] = []
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.root = f"http://127.0.0.1:{self._http.server_address[1]}"  # the API under /v1

    def __enter__(self) -> ScriptedServer:
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_) -> None:
        self._http.shutdown()
        self._http.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_):  # quiet
                pass

            def do_GET(self):
                if self.path == "/props" and server.vision is not None:  # llama-server's
                    return self._send(200, {"modalities": {"vision": server.vision}})
                if self.path.rstrip("/") != "/v1/models":
                    return self._send(404, {"error": {"message": "not found"}})
                entry = {"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}
                self._send(200, {"object": "list", "data": [entry]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                events = list(server.script)
                include_usage = (body.get("stream_options") or {}).get("include_usage")
                if server.usage is not None and include_usage:  # as OpenAI: only when asked
                    events.append(chunk(choices=False, usage=server.usage))
                for event in events:
                    self._chunk(f"data: {json.dumps(event)}\n\n")
                if server.drop:  # cut off: no [DONE], no final empty chunk
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, text: str) -> None:
                data = text.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
