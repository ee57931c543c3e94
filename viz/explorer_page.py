"""`pagelab view`'s HTML: one self-contained file (every script and style inlined, no network), and the
localhost server of `--serve`, which also loads windows of the run folder on demand.

The page's charts are uPlot (MIT, vendored in viz/explorer_assets with its license, version pinned in
UPLOT_VERSION); the block maps and request lanes are drawn on canvases by explorer.js.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from pagelab.atomic import atomic_write_bytes
from viz.explorer import Window, default_window, page_data, window_detail
from viz.load import Run

ASSETS = Path(__file__).with_name("explorer_assets")
UPLOT_VERSION = "1.6.32"


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def _inline_json(data: dict) -> str:
    """JSON that cannot end the <script> element holding it."""
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def render_page(data: dict) -> str:
    """The page's HTML with `data` (viz.explorer.page_data) and every script and style inlined."""
    title = f"pagelab run: {data['label']}".replace("&", "&amp;").replace("<", "&lt;")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{title}</title>",
        f"<style>{_asset('uPlot.min.css')}\n{_asset('explorer.css')}</style>", "</head><body>",
        f'<script id="pagelab-data" type="application/json">{_inline_json(data)}</script>',
        f"<script>{_asset('uPlot.iife.min.js')}</script>", f"<script>{_asset('explorer.js')}</script>",
        "</body></html>", ""])


def write_page(run: Run, out: Path, windows: list[Window] | None = None, serve: bool = False) -> int:
    """Write the page of `run` at `out` (temporary name, then rename); return its size in bytes."""
    data = page_data(run, windows)
    data["serve"] = serve
    page = render_page(data).encode("utf-8")
    atomic_write_bytes(out, page)
    return len(page)


class _Handler(BaseHTTPRequestHandler):
    page: bytes = b""
    window_at: Callable[[float], dict] = staticmethod(lambda t: {})

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        """The page at /, a window's detail at /window?t=SECONDS."""
        url = urlparse(self.path)
        if url.path in ("/", "/index.html"):
            self._send(self.page, "text/html; charset=utf-8")
        elif url.path == "/window":
            try:
                t = float(parse_qs(url.query)["t"][0])
            except (KeyError, ValueError):
                self.send_error(400, "expected /window?t=SECONDS")
                return
            self._send(json.dumps(self.window_at(t)).encode(), "application/json")
        else:
            self.send_error(404)

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        """Quiet: the command prints the address once."""


def make_server(run: Run, page: bytes, port: int = 0) -> ThreadingHTTPServer:
    """A localhost server of `page` that loads a window (as wide as the default one) around any moment."""
    width = (lambda w: w.end - w.start)(default_window(run))
    lock = threading.Lock()  # the run's tables are read by one request at a time

    def window_at(t: float) -> dict:
        start = max(0.0, t - width / 2)
        with lock:
            return {"allocators": [window_detail(a, Window(start, start + width))
                                   for a in run.allocators.values()]}

    handler = type("Handler", (_Handler,), {"page": page, "window_at": staticmethod(window_at)})
    return ThreadingHTTPServer(("127.0.0.1", port), handler)


def set_page(server: ThreadingHTTPServer, page: bytes) -> None:
    """The page a server from `make_server` serves (one made before its page was written)."""
    server.RequestHandlerClass.page = page
