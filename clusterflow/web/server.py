"""python -m clusterflow.dashboard PATH [PATH ...] [--host 127.0.0.1] [--port 0]

The web server (Starlette under uvicorn, the ``[dashboard]`` extra): pages, their data, the live
streams (server-sent events), the one action (cancel), behind ``guard.py``'s checks.

- The pages (``/``, ``/run/ID``) are shells that hold no data; their script asks ``/api/...``
  for everything, with the token in the ``X-Clusterflow-Token`` header (``guard.py``: the
  token, the Host header, the security headers, and why no cookie).
- Cancel needs the token in the header and the run's name typed back as confirmation.
- It binds 127.0.0.1 unless ``--host`` says otherwise; the token is required either way.
- Runs and sweeps are named by an id (``discover.ident``), never by a path: anything not found
  under the PATHs, ``..`` included, is a 404.
- A poll thread (``catalog.Catalog.poll``) reads the run dirs; the streams wake when it found
  something new and send each page only what changed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.manage import cancel as run_cancel
from clusterflow.observe import nvml
from clusterflow.web import views
from clusterflow.web.catalog import WATCHED_POLL_S, Catalog, Run, Snapshot, Sweep
from clusterflow.web.feeds import Delta
from clusterflow.web.guard import HEADER, WILDCARDS, Guard, Hosts

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

# The [dashboard] extra, imported when a dashboard starts (``build_app``) so that without it
# `clusterflow dashboard` says what to install in one line instead of a traceback.
EXTRA = ("starlette", "uvicorn", "sse_starlette", "jinja2")

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.dashboard runs/                 # every run and sweep below runs/\n"
    "  python -m clusterflow.dashboard runs/exp1 runs/sweep1\n"
    "  python -m clusterflow.dashboard runs/ --port 8765     # a fixed port (default: a free one)\n"
    "  python -m clusterflow.dashboard runs/ --host 0.0.0.0  # reachable from other hosts;\n"
    "                                                        # the token is still required\n"
)
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
OWN_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PING_S = 15.0
# A run's id in an address (discover.ident): anything else is no run's page.
RUN_ID = re.compile(r"^[0-9a-f]{12}$")


def missing_extra() -> list[str]:
    return [m for m in EXTRA if importlib.util.find_spec(m) is None]


def plotly_js() -> str | None:
    """plotly.min.js as plotly's wheel ships it (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "package_data", "plotly.min.js")
        if os.path.isfile(path):
            return path
    return None


# -- the poll thread and the streams' wake-up ---------------------------------------------------


class Hub:
    """Wakes every stream when the poll found something new (``notify`` from the poll thread,
    through the event loop)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def notify(self) -> None:
        old, self.event = self.event, asyncio.Event()
        old.set()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)


class Poller:
    """The thread that polls the catalog every ``catalog.WATCHED_POLL_S``."""

    def __init__(self, catalog: Catalog, hub: Hub, loop: asyncio.AbstractEventLoop) -> None:
        self.catalog, self.hub, self.loop = catalog, hub, loop
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="clusterflow-dashboard", daemon=True)
        self.wake = threading.Event()  # a page asks for a run now

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                changed = self.catalog.poll()
            except Exception as exc:  # noqa: BLE001 - the server must outlive any run dir
                print(f"dashboard: poll failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                changed = False
            if changed:
                self.loop.call_soon_threadsafe(self.hub.notify)
            self.wake.wait(WATCHED_POLL_S)
            self.wake.clear()


# -- pages and streams --------------------------------------------------------------------------


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Dashboard:
    """The app's state and its handlers (bound to routes by :func:`build_app`)."""

    def __init__(self, catalog: Catalog) -> None:
        # The [dashboard] extra (EXTRA), imported once a dashboard is built: without it,
        # `clusterflow dashboard` says what to install in one line (serve).
        import jinja2
        from sse_starlette.sse import EventSourceResponse
        from starlette import exceptions, responses

        self.responses, self.events = responses, EventSourceResponse
        self.not_found = exceptions.HTTPException
        self.catalog = catalog
        self.hub: Hub | None = None
        self.poller: Poller | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
            autoescape=True,
        )
        self.plotly = plotly_js()
        self.version = str(int(time.time()))  # static files' cache key

    # lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.hub, self.loop = Hub(), asyncio.get_running_loop()
        self.poller = Poller(self.catalog, self.hub, self.loop)
        self.poller.thread.start()
        try:
            yield
        finally:
            self.poller.stop.set()
            self.poller.wake.set()

    def stop_streams(self) -> None:
        """End every open stream (from any thread): a server stopped from inside a process
        rather than by a signal, which uvicorn and sse-starlette see themselves."""
        if self.loop is not None and self.hub is not None:
            self.loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        self.stopping = True
        if self.hub is not None:
            self.hub.notify()

    def _page(self, template: str, **context: object) -> Response:
        """A page's shell: no data (its script asks for that, with the token), so it needs
        none."""
        html = self.templates.get_template(template).render(
            version=self.version, plotly=self.plotly is not None, **context
        )
        return self.responses.HTMLResponse(html, headers={"cache-control": "no-store"})

    def _run(self, request: Request) -> Run:
        run = self.catalog.runs.get(request.path_params["run_id"])
        if run is None:
            raise self.not_found(404, "no such run under the dashboard's paths")
        return run

    async def runs_page(self, request: Request) -> Response:
        return self._page("runs.html")

    async def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not RUN_ID.match(run_id):
            raise self.not_found(404, "no such run under the dashboard's paths")
        return self._page("run.html", run_id=run_id)

    async def runs_json(self, request: Request) -> Response:
        return self.responses.JSONResponse(views.runs_page(self.catalog))

    async def run_json(self, request: Request) -> Response:
        return self.responses.JSONResponse(views.detail(self._run(request)))

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        cache = {"cache-control": "private, max-age=31536000, immutable"}
        if name == "plotly.min.js" and self.plotly:
            return self.responses.FileResponse(
                self.plotly, media_type="text/javascript", headers=cache
            )
        if name not in OWN_FILES:
            raise self.not_found(404, "no such file")
        return self.responses.FileResponse(
            os.path.join(STATIC, name), media_type=OWN_FILES[name], headers=cache
        )

    async def cancel(self, request: Request) -> Response:
        """POST {"run": id, "confirm": its name}, with the token in the header (an address a
        page could be made to open carries none): `clusterflow cancel` of that run or sweep."""

        if request.scope.get("state", {}).get("token_via") != "header":
            return self.responses.JSONResponse(
                {"error": f"cancel needs the token in the {HEADER} header"}, 403
            )
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return self.responses.JSONResponse(
                {"error": 'send {"run": ID, "confirm": NAME} as JSON'}, 400
            )
        entry = self.catalog.runs.get(str(body.get("run"))) or self.catalog.sweeps.get(
            str(body.get("run"))
        )
        if entry is None:
            return self.responses.JSONResponse(
                {"error": "no such run or sweep under the dashboard's paths"}, 404
            )
        if body.get("confirm") != entry.name:
            return self.responses.JSONResponse(
                {"error": f"to cancel, confirm with the name {entry.name!r}, typed in full"}, 400
            )
        try:
            lines = await asyncio.to_thread(run_cancel.cancel, entry.paths.root)
        except UserError as exc:
            return self.responses.JSONResponse({"error": str(exc)}, 400)
        if self.poller is not None:
            self.poller.wake.set()
        return self.responses.JSONResponse({"lines": lines})

    async def stream(self, request: Request) -> Response:
        """Server-sent events: the Runs page's rows, or (``?run=ID&rank=R``) a run's summary,
        metrics and rank R's log, each sent again only when it changed."""

        run_id = request.query_params.get("run")
        if run_id is None:
            return self.events(self._runs_events(), ping=PING_S)
        if run_id not in self.catalog.runs:
            raise self.not_found(404, "no such run under the dashboard's paths")
        rank_text = request.query_params.get("rank", "0")
        rank = int(rank_text) if rank_text.isdigit() and len(rank_text) < 8 else 0
        return self.events(self._run_events(run_id, rank), ping=PING_S)

    async def _runs_events(self) -> AsyncIterator[dict[str, str]]:
        """The Runs page: everything once (and again when runs come or go), then each row or
        sweep group whose content changed, and the GPUs when they did."""
        assert self.hub is not None
        seen: dict[str, int] = {}  # run or sweep id -> the version last looked at
        sent: dict[str, str] = {}  # ... -> the JSON last sent
        catalog_seen, gpus_sent = -1, ""
        while not self.stopping:
            cat = self.catalog
            runs, sweeps = dict(cat.runs), dict(cat.sweeps)
            if cat.version != catalog_seen:
                catalog_seen = cat.version
                page = views.runs_page(cat)
                seen = {i: e.version for i, e in [*runs.items(), *sweeps.items()]}
                sent = {r["id"]: _json(r) for r in page["runs"]}
                sent.update({g["id"]: _json(g) for g in page["sweeps"]})
                gpus_sent = _json(page["gpus"])
                yield {"event": "runs", "data": _json(page)}
            else:
                rows = _changed(
                    [r for r in runs.values() if seen.get(r.id) != r.version], views.row, sent
                )
                touched = {r["sweep"] for r in rows if r.get("sweep")}
                groups = _changed(
                    [s for s in sweeps.values() if seen.get(s.id) != s.version or s.id in touched],
                    functools.partial(views.sweep, runs=runs),
                    sent,
                )
                seen = {i: e.version for i, e in [*runs.items(), *sweeps.items()]}
                if rows or groups:
                    yield {"event": "rows", "data": _json({"runs": rows, "sweeps": groups})}
                # Who holds a GPU changes with the runs' heartbeats as much as with NVML's.
                gpus = _json(views.gpus(cat))
                if gpus != gpus_sent:
                    gpus_sent = gpus
                    yield {"event": "gpus", "data": gpus}
            await self.hub.wait(PING_S)

    async def _run_events(self, run_id: str, rank: int) -> AsyncIterator[dict[str, str]]:
        assert self.hub is not None
        cat = self.catalog
        cat.watch(run_id, rank, +1)
        if self.poller is not None:
            self.poller.wake.set()
        try:
            summary_seen, gpus_sent, detail_sent = -1, "", ""
            metrics_at, log_at = (-1, 0), (-1, 0)
            while not self.stopping:
                run = cat.runs.get(run_id)
                if run is None:
                    yield {"event": "gone", "data": "{}"}
                    return
                if run.version != summary_seen:
                    summary_seen = run.version
                    detail = _json(views.detail(run))
                    if detail != detail_sent:
                        detail_sent = detail
                        yield {"event": "summary", "data": detail}
                metrics, log = await asyncio.to_thread(self._feeds, run, rank, metrics_at, log_at)
                if metrics is not None:
                    metrics_at = (metrics.generation, metrics.version)
                    if metrics.items or metrics.reset:
                        yield {"event": "metrics", "data": _json(_delta(metrics))}
                if log is not None:
                    log_at = (log.generation, log.version)
                    if log.items or log.reset:
                        yield {"event": "log", "data": _json({"rank": rank, **_delta(log)})}
                gpus = _json(views.gpus(cat))
                if gpus != gpus_sent:
                    gpus_sent = gpus
                    yield {"event": "gpus", "data": gpus}
                await self.hub.wait(PING_S)
        finally:
            cat.watch(run_id, rank, -1)

    def _feeds(
        self, run: Run, rank: int, metrics_at: tuple[int, int], log_at: tuple[int, int]
    ) -> tuple[Delta | None, Delta | None]:
        with self.catalog.lock:
            metrics = run.metrics.since(*metrics_at) if run.metrics is not None else None
            feed = run.logs.get(rank)
            log = feed.since(*log_at) if feed is not None else None
        return metrics, log


def _changed(
    entries: list[Run] | list[Sweep],
    view: Callable[[Any], dict[str, Any]],
    sent: dict[str, str],
) -> list[dict[str, Any]]:
    """The views of ``entries`` whose JSON differs from what ``sent`` holds (updated)."""
    out = []
    for entry in entries:
        shown = view(entry)
        text = _json(shown)
        if sent.get(entry.id) != text:
            sent[entry.id] = text
            out.append(shown)
    return out


def _delta(d: Delta) -> dict[str, object]:
    return {"reset": d.reset, "items": views.clean(d.items)}


def build_app(catalog: Catalog, token: str, hosts: Hosts | None = None) -> tuple[Guard, Dashboard]:
    """The ASGI app (routes behind ``guard.py``'s checks; ``hosts``: the names it answers to, by
    default those of 127.0.0.1) and the dashboard it serves."""
    from starlette.applications import Starlette  # the [dashboard] extra: see EXTRA
    from starlette.routing import Route

    d = Dashboard(catalog)
    app = Starlette(
        routes=[
            Route("/", d.runs_page),
            Route("/run/{run_id}", d.run_page),
            Route("/api/runs", d.runs_json),
            Route("/api/run/{run_id}", d.run_json),
            Route("/api/stream", d.stream),
            Route("/api/cancel", d.cancel, methods=["POST"]),
            Route("/static/{name}", d.static),
        ],
        lifespan=d.lifespan,
    )
    return Guard(app, token, hosts or Hosts("127.0.0.1")), d


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port), refused in one line when it
    cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r} is not an address of this machine ({exc})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port, "
            "or --port 0 for a free one"
        ) from None
    sock.listen(128)
    return sock


def url_of(sock: socket.socket, host: str, token: str) -> str:
    port = sock.getsockname()[1]
    shown = socket.gethostname() if host in WILDCARDS else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/?token={token}"


def serve(paths: list[str], host: str, port: int, snapshot: Snapshot = nvml.read_snapshot) -> None:
    missing = missing_extra()
    if missing:
        raise UserError(
            f"the dashboard needs {', '.join(missing)}, which is not installed; "
            "pip install 'clusterflow[dashboard]'"
        )
    import uvicorn  # the [dashboard] extra: see EXTRA

    catalog = Catalog(paths, snapshot)
    token = secrets.token_urlsafe(24)
    sock = _bind(host, port)
    app, _ = build_app(catalog, token, Hosts(host))
    print(f"clusterflow dashboard: {url_of(sock, host, token)}", flush=True)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    uvicorn.Server(config).run(sockets=[sock])


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.dashboard",
        description="See runs and sweeps live in the browser (docs/dashboard.md).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="a run dir, a sweep dir, or a folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a port; choose 0 to 65535 (0: a free one)")
    serve(args.paths, args.host, args.port)
    return EXIT_OK
