"""Experiment trackers (MLflow, W&B) fed with the scalars TensorBoard gets, one tracker run per
clusterflow run.

- One run, every attempt: the tracker's run id is kept in ``RUN_DIR/trackers.json`` and reopened
  by each attempt, requeue, resume on other resources or from a moved run dir.
- Every step once: a tracker's history cannot be purged the way TensorBoard's is, so each
  attempt asks the tracker (or, for W&B, ``trackers.json``) for the last step it holds of each
  tag, sends only later points, and first sends what ``metrics.jsonl`` holds from earlier
  attempts beyond that (points a killed attempt logged but never delivered). Exact resume makes a
  point logged again equal to the one already there, so skipping it loses nothing.
- Never the run's failure: only rank 0 has trackers, and each one is fed by its own thread from
  a queue; a tracker that fails (server down) costs a warning and a retry with backoff, never a
  training step. The end of the run waits for the queue a bounded time.
- Submit checks the configuration (:func:`check`): a tracker whose package is missing, a
  tracking server that does not answer, or W&B online without an API key, is refused there
  (exit 2).

The backends (``mlflow_run.py``, ``wandb_run.py``) import their packages lazily: they are
optional extras (``pip install 'clusterflow[mlflow]'``, ``[wandb]``).
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
import queue
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from clusterflow.config.paths import check_local_dir
from clusterflow.config.sections import TrackersConfig
from clusterflow.errors import UserError
from clusterflow.observe.trackers.mlflow_run import MlflowBackend
from clusterflow.observe.trackers.state import StateFile
from clusterflow.observe.trackers.wandb_run import WandbBackend
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.states import State

log = logging.getLogger("clusterflow.trackers")

# The run's final states, as the trackers' own run statuses (a stop that will be resumed leaves
# the tracker run open).
ENDED = (State.COMPLETED, State.FAILED, State.CANCELLED)

Rows = list[tuple[int, dict[str, float]]]
# What a Pump's queue carries after its kind: "rows" Rows, "tag" (key, value), "finish" the
# outcome, "close" None.
_Item = Rows | tuple[str, str] | str | None


class Backend(Protocol):
    """One tracker. Every method may raise: the :class:`Pump` retries it."""

    name: str

    def open(self, state: StateFile, params: Mapping[str, str]) -> dict[str, int]:
        """Start the tracker run, or reopen the one ``state`` names (saving its id there before
        anything else). Returns the last step the tracker holds of each tag."""

    def log(self, rows: Rows) -> None:
        """Send points, in step order."""

    def tag(self, key: str, value: str) -> None: ...

    def finish(self, state: str) -> None:
        """The attempt ends: the run ended with ``state`` (one of ``ENDED``), or stopped to be
        resumed (anything else: the tracker run stays open)."""


def configured(cfg: TrackersConfig) -> list[str]:
    return [name for name in ("mlflow", "wandb") if getattr(cfg, name)]


def check(cfg: TrackersConfig, reach: bool = True) -> None:
    """Refuse, with one line, a tracker whose package is missing or (with ``reach``) whose server
    does not answer (submit and ``run`` call this before anything is written; ``run`` asks the
    server from rank 0 only)."""
    for name in configured(cfg):
        if importlib.util.find_spec(name) is None:
            raise UserError(
                f"trackers.{name} is configured but the {name} package is not installed in "
                f"{sys.executable}; pip install 'clusterflow[{name}]', or remove trackers.{name}"
            )
    uri = cfg.mlflow.get("uri", "")
    if not reach:
        return
    if cfg.wandb and cfg.wandb.get("mode", "online") == "online":
        _check_wandb_key(os.environ)
    if uri.startswith(("http://", "https://")):
        _check_server(uri)
    elif uri.startswith("sqlite:///"):
        folder = os.path.dirname(uri[len("sqlite:///") :]) or "."
        check_local_dir("trackers.mlflow.uri", folder)


def _check_server(uri: str, timeout_s: float = 10.0) -> None:
    """An MLflow tracking server answers its health check at ``uri``."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as reply:
            reply.read(64)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):  # a server behind authentication: it is there
            return
        raise UserError(
            f"trackers.mlflow.uri = {uri!r}: the tracking server answered HTTP {exc.code} to "
            f"its health check; check the URI (mlflow server --host HOST --port PORT serves it)"
        ) from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(
            f"trackers.mlflow.uri = {uri!r}: no tracking server answers there ({reason}); "
            f"start it (mlflow server --host HOST --port PORT) or fix the URI"
        ) from None


def _check_wandb_key(environ: Mapping[str, str]) -> None:
    """W&B online needs an API key: ``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes
    for the W&B host (``WANDB_BASE_URL``, api.wandb.ai by default). Without one the job would
    fail on its first attempt, after waiting in the queue."""
    if environ.get("WANDB_API_KEY"):
        return
    base = environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    host = urllib.parse.urlparse(base).hostname or base
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise UserError(
        f"trackers.wandb.mode = 'online' but no W&B API key is set for {host} (no WANDB_API_KEY, "
        f"no entry in {path}); run `wandb login` (it writes {path}, which the job's nodes read "
        "from the shared home), export WANDB_API_KEY, or set trackers.wandb.mode=offline and "
        "`wandb sync` the run later"
    )


def params(config: Mapping[str, Any]) -> dict[str, str]:
    """The config as flat ``section.key`` parameters (mappings such as task.params one level
    deeper), as text."""
    out: dict[str, str] = {}
    for section, values in config.items():
        for key, value in values.items():
            if isinstance(value, Mapping) and value:
                for sub, v in value.items():
                    out[f"{section}.{key}.{sub}"] = str(v)
            else:
                out[f"{section}.{key}"] = str(value)
    return out


class Pump:
    """Feeds one backend from a queue on its own thread; retries with backoff on any error."""

    RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)

    def __init__(
        self,
        backend: Backend,
        state: StateFile,
        params: Mapping[str, str],
        backlog: Callable[[], Mapping[int, Mapping[str, float]]],
    ) -> None:
        self.backend, self._state, self._params, self._backlog = backend, state, params, backlog
        self._q: queue.Queue[tuple[str, _Item]] = queue.Queue()
        self._next: tuple[str, _Item] | None = None
        self._held: dict[str, int] = {}
        self._failures = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tracker-{backend.name}", daemon=True
        )
        self._thread.start()

    # -- the training side: never blocks ---------------------------------------------------
    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._q.put(("rows", [(step, {k: float(v) for k, v in values.items()})]))

    def tag(self, key: str, value: str) -> None:
        self._q.put(("tag", (key, value)))

    def close(self, outcome: str, timeout_s: float) -> None:
        """Send what is queued and how the attempt ended; wait at most ``timeout_s``."""
        self._q.put(("finish", outcome))
        self._q.put(("close", None))
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "tracker %s: %d updates not delivered after %.0f s; the next launch of this run "
                "sends the points (metrics.jsonl keeps them)",
                self.backend.name,
                self._q.qsize() + 1,
                timeout_s,
            )

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        if not self._retry(self._open):
            return
        while True:
            kind, item = self._next or self._q.get()
            self._next = None
            if kind == "close":
                return
            if kind == "rows":
                item = self._more_rows(item)
            if not self._retry(lambda k=kind, i=item: self._do(k, i)):
                return

    def _more_rows(self, rows: Rows) -> Rows:
        """Rows queued behind these, up to the next other update: one request for them all."""
        while len(rows) < 500:
            try:
                kind, item = self._q.get_nowait()
            except queue.Empty:
                break
            if kind != "rows":
                self._next = (kind, item)  # handled after these rows
                break
            rows.extend(item)
        return rows

    def _open(self) -> None:
        self._held = dict(self.backend.open(self._state, self._params))
        backlog = sorted(self._backlog().items())
        self._send(backlog)

    def _do(self, kind: str, item: _Item) -> None:
        if kind == "rows":
            self._send(item)
        elif kind == "tag":
            self.backend.tag(*item)
        elif kind == "finish":
            self.backend.finish(item)
            if self._held:
                self._state.record(self.backend.name, received_step=max(self._held.values()))

    def _send(self, rows: Rows) -> None:
        """The points the tracker does not hold yet (a later step than its last one per tag)."""
        new: Rows = []
        for step, values in rows:
            fresh = {k: v for k, v in values.items() if step > self._held.get(k, -1)}
            if fresh:
                new.append((step, fresh))
        if not new:
            return
        self.backend.log(new)
        first = not self._held
        for step, values in new:
            for k in values:
                self._held[k] = step
        if first and "received_step" not in self._state.section(self.backend.name):
            self._state.record(self.backend.name, fsync=False, received_step=new[-1][0])

    def _retry(self, action: Callable[[], None]) -> bool:
        """Run ``action`` until it succeeds; False when the run ends before it does."""
        while True:
            try:
                action()
                if self._failures:
                    log.warning("tracker %s: delivering again", self.backend.name)
                self._failures = 0
                return True
            except Exception as exc:  # noqa: BLE001 - a tracker must never fail the run
                wait = self.RETRY_S[min(self._failures, len(self.RETRY_S) - 1)]
                self._failures += 1
                log.warning(
                    "tracker %s failed (%s: %s); training goes on, retrying in %.0f s",
                    self.backend.name,
                    type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "",
                    wait,
                )
                if self._closing.is_set() and self._failures > 3:
                    return False
                self._closing.wait(wait)  # the end of the attempt cuts the wait short


def start(
    cfg: TrackersConfig,
    paths: RunPaths,
    config: Mapping[str, Any],
    backlog: Callable[[], Mapping[int, Mapping[str, float]]],
) -> list[Pump]:
    """One pump per configured tracker (rank 0 only)."""
    names = configured(cfg)
    if not names:
        return []
    state = StateFile(paths)
    flat = params(config)
    pumps = []
    for name in names:
        if name == "mlflow":
            backend: Backend = MlflowBackend(cfg.mlflow, config["run"]["name"])
        else:
            backend = WandbBackend(cfg.wandb, config["run"]["name"], paths)
        pumps.append(Pump(backend, state, flat, backlog))
    return pumps
