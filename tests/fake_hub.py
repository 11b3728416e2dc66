"""A stand-in for the Hugging Face hub on loopback: the endpoints huggingface_hub's downloads use (repo
info, the file tree, HEAD and ranged GET of a file), serving repositories from local folders. It can
cut a file's next downloads short, to test that a later one resumes it."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

COMMIT = "a" * 40


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos  # repo id -> folder whose files it holds
        self.cuts: dict[str, int] = {}  # "repo/file" -> how many of its next downloads stop halfway
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        app = Starlette(routes=[
            Route("/api/models/{org}/{name}", self.info),
            Route("/api/models/{org}/{name}/revision/{revision}", self.info),
            Route("/api/models/{org}/{name}/tree/{revision}", self.tree),
            Route("/{org}/{name}/resolve/{revision}/{path:path}", self.file, methods=["GET", "HEAD"]),
        ])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def _files(self, request: Request) -> tuple[str, dict[str, Path]] | Response:
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        if repo not in self.repos:
            return JSONResponse({"error": "Repository not found"}, 404, headers={"X-Error-Code": "RepoNotFound"})
        folder = self.repos[repo]
        return repo, {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}

    async def info(self, request: Request) -> Response:
        found = self._files(request)
        if isinstance(found, Response):
            return found
        repo, files = found
        return JSONResponse({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                             "siblings": [{"rfilename": f} for f in files]})

    async def tree(self, request: Request) -> Response:
        found = self._files(request)
        if isinstance(found, Response):
            return found
        _, files = found
        return JSONResponse([{"type": "file", "oid": _etag(p), "size": p.stat().st_size, "path": f}
                             for f, p in files.items()])

    async def file(self, request: Request) -> Response:
        found = self._files(request)
        if isinstance(found, Response):
            return found
        repo, files = found
        path = request.path_params["path"]
        self.requests.append((request.method, path, request.headers.get("range")))
        if path not in files:
            return JSONResponse({"error": "Entry not found"}, 404, headers={"X-Error-Code": "EntryNotFound"})
        data = files[path].read_bytes()
        headers = {"ETag": f'"{_etag(files[path])}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        start = 0
        if request.headers.get("range", "").startswith("bytes="):
            start = int(request.headers["range"][6:].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(data) - start)
        status = 206 if start else 200
        if request.method == "HEAD":
            return Response(status_code=200, headers={**headers, "Content-Length": str(len(data))})
        key = f"{repo}/{path}"
        if self.cuts.get(key):
            self.cuts[key] -= 1

            async def half():
                yield data[start: start + (len(data) - start) // 2]
                await asyncio.sleep(0.2)  # the half reaches the client before the connection drops
                raise ConnectionResetError("the fake hub cut this download short")

            return StreamingResponse(half(), status, headers=headers)
        return Response(data[start:], status, headers=headers)


def _etag(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()
