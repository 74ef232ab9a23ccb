"""A loopback HTTP server that serves files in the Hugging Face Hub's layout, for
`miniapp models pull` tests: huggingface_hub talks to it over real HTTP (HF_ENDPOINT).

It answers the two requests a download makes: the repository listing
(GET /api/models/OWNER/NAME[/revision/REV]) and the file itself
(HEAD/GET /OWNER/NAME/resolve/REV/FILE, with byte ranges, so a download can resume).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubRepo:
    files: dict[str, bytes]
    wrong_hash: set[str] = field(default_factory=set)  # list a wrong SHA-256 for these
    # file -> (N, times): the next `times` downloads from the start break off after N bytes
    cut_after: dict[str, tuple[int, int]] = field(default_factory=dict)


class FakeHub:
    def __init__(self, repos: dict[str, HubRepo]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range header
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def listing(self, repo_id: str) -> dict:
        repo = self.repos[repo_id]
        siblings = []
        for name, data in repo.files.items():
            digest = hashlib.sha256(data).hexdigest()
            if name in repo.wrong_hash:
                digest = "0" * 64
            lfs = {"size": len(data), "sha256": digest, "pointerSize": 134}
            siblings.append(
                {"rfilename": name, "size": len(data), "blobId": digest[:40], "lfs": lfs}
            )
        return {
            "id": repo_id,
            "modelId": repo_id,
            "sha": COMMIT,
            "siblings": siblings,
            "private": False,
        }

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    return self._listing("/".join(parts[2:4]), body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file("/".join(parts[:2]), "/".join(parts[4:]), body)
                self._reply(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)

            def _listing(self, repo_id: str, body: bool) -> None:
                if repo_id not in hub.repos:
                    self._reply(
                        404,
                        b'{"error":"Repository not found"}',
                        {"X-Error-Code": "RepoNotFound"},
                        body,
                    )
                    return
                data = json.dumps(hub.listing(repo_id)).encode()
                self._reply(200, data, {"Content-Type": "application/json"}, body)

            def _file(self, repo_id: str, name: str, body: bool) -> None:
                repo = hub.repos.get(repo_id)
                if repo is None or name not in repo.files:
                    self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                    return
                data = repo.files[name]
                etag = hashlib.sha256(data).hexdigest()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
                start = 0
                wanted = self.headers.get("Range")
                if wanted and wanted.startswith("bytes="):
                    start = int(wanted[6:].split("-")[0] or 0)
                status = 206 if start else 200
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                chunk = data[start:]
                cut = self._cut(repo, name) if body and not start else None
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                if not body:
                    return
                if cut is not None:  # an interrupted transfer: part of the body, then gone
                    self.wfile.write(chunk[:cut])
                    self.wfile.flush()
                    self.connection.close()
                    return
                self.wfile.write(chunk)

            def _cut(self, repo: HubRepo, name: str) -> int | None:
                limit, times = repo.cut_after.get(name, (0, 0))
                if times <= 0:
                    return None
                repo.cut_after[name] = (limit, times - 1)
                return limit

            def _reply(self, status: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
