"""A local HTTP server posing as the Hugging Face Hub (``HF_ENDPOINT``), on 127.0.0.1, for `umakit pull`'s tests.

It serves repos from local folders: the revision API (the file list), and each file with HEAD and ranged GET, as
the Hub's ``resolve`` URLs do. ``cut_after[name] = [n, ...]`` makes the next GETs of that file stop after n bytes
each (the connection closes mid-transfer), one entry a GET; ``ranges`` records the Range headers it was sent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "c" * 40


class FakeHub:
    def __init__(self, repos: dict[str, Path]):
        self.repos, self.cut_after, self.ranges = repos, {}, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()

    def _serve(self, h, body: bool):
        path = h.path.split("?")[0]
        for repo, folder in self.repos.items():
            if path.startswith(f"/api/models/{repo}/tree/"):
                tree = [{"type": "file", "path": f.name, "size": f.stat().st_size,
                         "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in sorted(folder.iterdir())]
                return self._send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
            if path.startswith(f"/api/models/{repo}/revision/") or path == f"/api/models/{repo}":
                info = {"id": repo, "sha": SHA, "siblings": [{"rfilename": f.name} for f in sorted(folder.iterdir())]}
                return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix):
                name = path[len(prefix):].split("/", 1)[1]
                f = folder / name
                if not f.is_file():
                    return self._send(h, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
                data = f.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                headers = {"X-Repo-Commit": SHA, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
                start = 0
                rng = h.headers.get("Range")
                if rng and body:
                    self.ranges.append((name, rng))
                    start = int(rng.split("=")[1].split("-")[0])
                status = 206 if start else 200
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                part = data[start:]
                cuts = self.cut_after.get(name) if body else None
                cut = cuts.pop(0) if cuts else None
                if cut is not None:  # announce it all, send some, then drop the connection
                    h.send_response(status)
                    for k, v in {**headers, "Content-Length": str(len(part))}.items():
                        h.send_header(k, v)
                    h.end_headers()
                    h.wfile.write(part[:cut])
                    h.wfile.flush()
                    h.close_connection = True
                    return
                return self._send(h, status, part, headers, body)
        return self._send(h, 404, b'{"error": "Repository not found"}',
                          {"X-Error-Code": "RepoNotFound"}, body)

    @staticmethod
    def _send(h, status, data: bytes, headers: dict, body: bool):
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)
