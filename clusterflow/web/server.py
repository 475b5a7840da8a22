"""python -m clusterflow.dashboard PATH [PATH ...] [--host 127.0.0.1] [--port 0]
       [--root-path PREFIX] [--token-file F];  python -m clusterflow.dashboard --list

The web server (Starlette under uvicorn, the ``[dashboard]`` extra): pages, their data, the live
streams (server-sent events), the one action (cancel), behind ``guard.py``'s checks.

- The pages (``/``, ``/run/ID``) are shells that hold no data; their script asks ``/api/...``
  for everything, with the token in the ``X-Clusterflow-Token`` header (``guard.py``: the
  token, the Host header, the security headers, and why no cookie).
- Cancel needs the token in the header and the run's name typed back as confirmation.
- It binds 127.0.0.1 unless ``--host`` says otherwise; the token is required either way.
- ``--root-path PREFIX``: served under PREFIX for a reverse proxy (Open OnDemand, JupyterHub's
  proxies), whether the proxy passes the prefix on or strips it (:class:`RootPath`); every
  address the pages make starts with it.
- ``--token-file F``: the token read from F (the user's own file, which nobody else may read)
  rather than a new random one; ``--list`` prints the addresses of this user's dashboards on
  this host (``running.py``).
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
import stat
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.manage import cancel as run_cancel
from clusterflow.observe import nvml
from clusterflow.storage import confined
from clusterflow.web import running, views
from clusterflow.web.catalog import WATCHED_POLL_S, Catalog, RunEntry, Snapshot, Sweep
from clusterflow.web.feeds import Delta
from clusterflow.web.guard import HEADER, WILDCARDS, Asgi, Guard, Hosts, Receive, Scope, Send

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
    "  python -m clusterflow.dashboard runs/ --root-path /node/gpu1/8765  # behind a proxy\n"
    "  python -m clusterflow.dashboard --list                # the addresses of yours here\n"
)
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
OWN_FILES = {
    "dashboard.js": "text/javascript",
    "charts.js": "text/javascript",
    "compare.js": "text/javascript",
    "dashboard.css": "text/css",
}
PING_S = 15.0
# A run's id in an address (discover.ident): anything else is no run's page.
RUN_ID = re.compile(r"^[0-9a-f]{12}$")
# A compare page's list of ids is read this far at most.
MAX_IDS = 256
# What --root-path may be: path segments of URL-safe characters.
ROOT_PATH = re.compile(r"^(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)*$")
# What a token given in --token-file may hold: it travels in an address (?token=).
TOKEN_TEXT = re.compile(r"^[A-Za-z0-9._~-]{16,512}$")


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


# -- behind a reverse proxy -----------------------------------------------------------------------


class RootPath:
    """ASGI middleware: ``--root-path PREFIX``. A request under PREFIX has it taken off (a proxy
    that passes the whole path, as Open OnDemand's does); one without is served as it is (a
    proxy that strips the prefix, as jupyter-server-proxy does). The pages make every address
    with PREFIX, so the browser always goes through the proxy."""

    def __init__(self, app: Asgi, root: str) -> None:
        self.app, self.root = app, root

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            self.root
            and scope["type"] == "http"
            and (path == self.root or path.startswith(self.root + "/"))
        ):
            scope = dict(scope)
            scope["path"] = path[len(self.root) :] or "/"
            scope["raw_path"] = scope["path"].encode("utf-8", "surrogateescape")
        await self.app(scope, receive, send)


def _decoded(segment: str) -> str:
    """A path segment as a proxy or a browser may read it: percent-decoded until nothing changes
    (``%252e`` is ``%2e`` once decoded, ``.`` twice)."""
    for _ in range(8):
        plain = urllib.parse.unquote(segment)
        if plain == segment:
            break
        segment = plain
    return segment


def root_path(text: str) -> str:
    """``--root-path`` as the pages use it: "" or "/a/b" (no trailing slash). No segment is
    ``.`` or ``..``, as written or percent-decoded (``%2e%2e``, ``a%2f..``)."""
    root = "/" + text.strip().strip("/") if text.strip().strip("/") else ""
    fix = "give it as the proxy addresses the dashboard, e.g. --root-path /node/gpu1/8765"
    if not ROOT_PATH.match(root):
        raise UserError(f"--root-path {text!r} is not a path a proxy serves under; {fix}")
    for segment in root.split("/")[1:]:
        plain = _decoded(segment)
        if {".", ".."} & set(re.split(r"[/\\]", plain)):
            said = "" if plain == segment else f" (read as {plain!r} once percent-decoded)"
            raise UserError(
                f"--root-path {text!r} holds the segment {segment!r}{said}, which steps out of "
                f"the path instead of naming a folder of it; {fix}"
            )
    return root


def read_token(path: str) -> str:
    """The token in ``path`` (``--token-file``): a file of this user's that nobody else may
    read, holding 16 to 512 URL-safe characters (letters, digits, ``._~-``). Opened as a run
    dir's records are (``storage/confined.py``), at the place its links lead to: a FIFO, a
    device or a folder is refused from its ``stat`` before it is opened, never waited on."""
    try:
        with confined.open_file(os.path.realpath(path)) as f:
            st = os.fstat(f.fileno())
            text = f.read(4096).decode("utf-8", errors="replace").strip()
    except confined.Refused as exc:
        raise UserError(f"--token-file {path!r} {exc.why}; give a file holding the token") from None
    except OSError as exc:
        raise UserError(f"--token-file {path!r} cannot be read ({exc.strerror})") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        owner = "another user's" if st.st_uid != os.getuid() else "readable by others"
        raise UserError(
            f"--token-file {path!r} is {owner} (mode {stat.S_IMODE(st.st_mode):o}): the token "
            f"opens every run the dashboard shows; keep it yours alone: chmod 600 {path}"
        )
    if not TOKEN_TEXT.match(text):
        raise UserError(
            f"--token-file {path!r} holds {len(text)} character(s) that are not a token: it "
            "needs 16 to 512 letters, digits or ._~- on one line (e.g. python -c 'import "
            f"secrets; print(secrets.token_urlsafe(24))' > {path})"
        )
    return text


# -- pages and streams --------------------------------------------------------------------------


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Dashboard:
    """The app's state and its handlers (bound to routes by :func:`build_app`)."""

    def __init__(self, catalog: Catalog, root: str = "") -> None:
        # The [dashboard] extra (EXTRA), imported once a dashboard is built: without it,
        # `clusterflow dashboard` says what to install in one line (serve).
        import jinja2
        from sse_starlette.sse import EventSourceResponse
        from starlette import exceptions, responses

        self.responses, self.events = responses, EventSourceResponse
        self.not_found = exceptions.HTTPException
        self.catalog, self.root = catalog, root
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
            version=self.version, plotly=self.plotly is not None, root=self.root, **context
        )
        return self.responses.HTMLResponse(html, headers={"cache-control": "no-store"})

    def _run(self, request: Request) -> RunEntry:
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

    async def compare_page(self, request: Request) -> Response:
        return self._page("compare.html")

    async def compare_json(self, request: Request) -> Response:
        ids, sweep = _compared(request.query_params.get("runs"), request.query_params.get("sweep"))
        return self.responses.JSONResponse(views.compare(self.catalog, ids, sweep))

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
        metrics and rank R's log, or (``?compare=ID,ID...`` or ``?sweep=ID``) the compare page's
        runs and their metrics, each sent again only when it changed."""

        query = request.query_params
        if "compare" in query or "sweep" in query:
            ids, sweep = _compared(query.get("compare"), query.get("sweep"))
            if sweep is not None and sweep not in self.catalog.sweeps:
                raise self.not_found(404, "no such sweep under the dashboard's paths")
            return self.events(self._compare_events(ids, sweep), ping=PING_S)
        run_id = query.get("run")
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

    async def _compare_events(
        self, ids: list[str], sweep: str | None
    ) -> AsyncIterator[dict[str, str]]:
        """The compare page: its runs (names, states, the keys that tell them apart) when they
        change, and each run's metrics as they grow; the runs are followed as a run's page
        follows its own while the page is open."""
        assert self.hub is not None
        cat = self.catalog
        watched: list[str] = []
        at: dict[str, tuple[int, int]] = {}
        sent, seen = "", None
        try:
            while not self.stopping:
                versions = (cat.version, *(e.version for e in _entries(cat, ids, sweep)))
                if versions != seen:
                    seen = versions
                    shown = views.compare(cat, ids, sweep)
                    now = [r["id"] for r in shown["runs"]]
                    for run_id in set(now) - set(watched):
                        cat.watch(run_id, None, +1, follow=True)
                    for run_id in set(watched) - set(now):
                        cat.watch(run_id, None, -1, follow=True)
                        at.pop(run_id, None)
                    if set(now) - set(watched) and self.poller is not None:
                        self.poller.wake.set()
                    watched = now
                    text = _json(shown)
                    if text != sent:
                        sent = text
                        yield {"event": "compare", "data": text}
                for run_id in watched:
                    run = cat.runs.get(run_id)
                    if run is None:
                        continue
                    metrics, _ = await asyncio.to_thread(
                        self._feeds, run, -1, at.get(run_id, (-1, 0)), (-1, 0)
                    )
                    if metrics is not None:
                        at[run_id] = (metrics.generation, metrics.version)
                        if metrics.items or metrics.reset:
                            yield {
                                "event": "metrics",
                                "data": _json({"run": run_id, **_delta(metrics)}),
                            }
                await self.hub.wait(PING_S)
        finally:
            for run_id in watched:
                cat.watch(run_id, None, -1, follow=True)

    def _feeds(
        self, run: RunEntry, rank: int, metrics_at: tuple[int, int], log_at: tuple[int, int]
    ) -> tuple[Delta | None, Delta | None]:
        with self.catalog.lock:
            metrics = run.metrics.since(*metrics_at) if run.metrics is not None else None
            feed = run.logs.get(rank)
            log = feed.since(*log_at) if feed is not None else None
        return metrics, log


def _changed(
    entries: list[RunEntry] | list[Sweep],
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


def _compared(ids: str | None, sweep: str | None) -> tuple[list[str], str | None]:
    """A compare page's runs (``?runs=`` or ``?compare=``: ids, comma-separated) or sweep, as
    ids: anything that is no id (a path, ``..``) is no run under the dashboard's paths."""
    if sweep is not None:
        return [], sweep if RUN_ID.match(sweep) else "-"
    given = (ids or "").split(",", MAX_IDS)[:MAX_IDS]
    return [i for i in given if RUN_ID.match(i)], None


def _entries(cat: Catalog, ids: Iterable[str], sweep: str | None) -> list[RunEntry | Sweep]:
    """What a compare page shows, as the catalog holds it now (their versions say when to send
    the page's runs again)."""
    entry = cat.sweeps.get(sweep) if sweep else None
    if entry is not None:
        members = [r for r in cat.runs.values() if r.found.sweep == entry.found.root]
        return [entry, *members]
    return [cat.runs[i] for i in ids if i in cat.runs]


def build_app(
    catalog: Catalog, token: str, hosts: Hosts | None = None, root: str = ""
) -> tuple[RootPath, Dashboard]:
    """The ASGI app (routes behind ``guard.py``'s checks; ``hosts``: the names it answers to, by
    default those of 127.0.0.1; ``root``: ``--root-path``) and the dashboard it serves."""
    from starlette.applications import Starlette  # the [dashboard] extra: see EXTRA
    from starlette.routing import Route

    d = Dashboard(catalog, root)
    app = Starlette(
        routes=[
            Route("/", d.runs_page),
            Route("/run/{run_id}", d.run_page),
            Route("/compare", d.compare_page),
            Route("/api/runs", d.runs_json),
            Route("/api/run/{run_id}", d.run_json),
            Route("/api/compare", d.compare_json),
            Route("/api/stream", d.stream),
            Route("/api/cancel", d.cancel, methods=["POST"]),
            Route("/static/{name}", d.static),
        ],
        lifespan=d.lifespan,
    )
    return RootPath(Guard(app, token, hosts or Hosts("127.0.0.1")), root), d


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


def url_of(sock: socket.socket, host: str, token: str, root: str = "") -> str:
    port = sock.getsockname()[1]
    shown = socket.gethostname() if host in WILDCARDS else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}{root}/?token={token}"


def serve(
    paths: list[str],
    host: str,
    port: int,
    snapshot: Snapshot = nvml.read_snapshot,
    root: str = "",
    token: str | None = None,
) -> None:
    missing = missing_extra()
    if missing:
        raise UserError(
            f"the dashboard needs {', '.join(missing)}, which is not installed; "
            "pip install 'clusterflow[dashboard]'"
        )
    import uvicorn  # the [dashboard] extra: see EXTRA

    catalog = Catalog(paths, snapshot)
    token = token or secrets.token_urlsafe(24)
    sock = _bind(host, port)
    app, _ = build_app(catalog, token, Hosts(host), root)
    url = url_of(sock, host, token, root)
    listed = running.register(url, catalog.finder.roots)
    print(f"clusterflow dashboard: {url}", flush=True)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        running.unregister(listed)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.dashboard",
        description="See runs and sweeps live in the browser (docs/dashboard.md).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="a run dir, a sweep dir, or a folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    p.add_argument(
        "--root-path",
        default="",
        metavar="PREFIX",
        help="serve under PREFIX for a reverse proxy (Open OnDemand, JupyterHub)",
    )
    p.add_argument(
        "--token-file",
        metavar="F",
        help="the token from F (yours alone: chmod 600) instead of a new random one",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the addresses (with their tokens) of your dashboards on this host",
    )
    args = p.parse_args(argv)
    if args.list:
        if args.paths:
            raise UserError("--list takes no PATH: it lists the dashboards already running")
        print(running.render(running.running()))
        return EXIT_OK
    if not args.paths:
        raise UserError(
            "give the PATH of a run dir, a sweep dir or a folder of them "
            "(python -m clusterflow.dashboard runs/), or --list"
        )
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a port; choose 0 to 65535 (0: a free one)")
    root = root_path(args.root_path)
    token = read_token(args.token_file) if args.token_file else None
    serve(args.paths, args.host, args.port, root=root, token=token)
    return EXIT_OK
