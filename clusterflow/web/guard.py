"""What stands in front of every request of the dashboard (ASGI middleware, :class:`Guard`).

- **The Host header** names this machine (:class:`Hosts`): an IP address, ``localhost``, the
  ``--host`` it listens on, and for ``--host 0.0.0.0`` (or ``::``) the machine's own names. A
  page of another site whose name was made to resolve to 127.0.0.1 (DNS rebinding) sends its own
  name, and gets 400 and nothing else.
- **The token** on everything that carries data (``/api/...``: the runs, a run, the streams,
  cancel), in the ``X-Clusterflow-Token`` header (what the pages send) or ``?token=`` (a script
  may): without it, 403 and one line saying where the address is. Cancel needs the header.
- **No cookie, ever.** Browsers send a host's cookies to every port of it: a cookie holding the
  token, or anything that opens the dashboard, would reach any other local service the user
  opens (a teammate's forwarded TensorBoard), and that service could replay it from the same
  login node. So the pages themselves are shells that hold no data and need no token; their
  script keeps the token in the page's own storage (``localStorage``: per scheme, host and
  port, which no page of another port can read), takes it out of the address bar at once, and
  sends it in the header with every request for data.
- **Headers on every response**: a Content-Security-Policy (scripts and connections only from
  this server, no frames, no forms, no plugins), ``Referrer-Policy: no-referrer`` (an address
  never leaves in a Referer), ``X-Frame-Options: DENY``, ``X-Content-Type-Options: nosniff``,
  ``Cross-Origin-Resource-Policy: same-origin``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

HEADER = "x-clusterflow-token"
# Where data is: everything else (the pages' shells, their script and styles) holds none.
API = "/api/"
NEEDS_TOKEN = (
    "this dashboard needs its token: open the address that `clusterflow dashboard` printed "
    "(it ends in ?token=...)"
)
# Plotly and the pages set styles inline (a bar's width); scripts only from here, and no eval.
# Images from blob: too: a chart's PNG is drawn from its SVG through one (Plotly's toImage).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; font-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    (b"content-security-policy", CSP.encode()),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
WILDCARDS = ("0.0.0.0", "::", "")


def _bare(host: str) -> str:
    """A Host header's name without its port, brackets or final dot, in lower case."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8080
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Hosts:
    """The names a request may give in its Host header for a dashboard listening on ``bound``
    (its ``--host``): any IP address (no DNS name is involved, so nothing to rebind),
    ``localhost``, ``bound`` itself, and for a wildcard ``bound`` this machine's own names."""

    def __init__(self, bound: str) -> None:
        names = {"localhost", _bare(bound)}
        if bound in WILDCARDS:
            hostname = socket.gethostname()
            names |= {hostname, hostname.split(".")[0], socket.getfqdn()}
        self.names = {n.lower().rstrip(".") for n in names if n}

    def allows(self, host: str) -> bool:
        name = _bare(host)
        return _is_address(name) or name in self.names

    def said(self) -> str:
        return ", ".join(sorted(self.names) + ["an IP address"])


class Guard:
    """The ASGI app ``app`` behind the Host check, the token and the security headers (see the
    module's docstring). ``scope["state"]["token_via"]`` tells a handler where the token came
    from (``header`` or ``query``)."""

    def __init__(self, app: Asgi, token: str, hosts: Hosts) -> None:
        self.app, self.token, self.hosts = app, token, hosts

    def _given(self, scope: Scope, headers: dict[str, str]) -> tuple[str, str]:
        """(the token the request carries, where: header or query)."""
        if headers.get(HEADER):
            return headers[HEADER], "header"
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("token"):
            return query["token"][0], "query"
        return "", ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self.hosts.allows(host):
            await _refuse(
                send,
                400,
                f"this dashboard does not answer to the name {host!r} (a page of another site "
                f"made to resolve here?); open the address it printed (names it answers to: "
                f"{self.hosts.said()})",
            )
            return
        if scope["path"].startswith(API):
            given, where = self._given(scope, headers)
            if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
                await _refuse(send, 403, NEEDS_TOKEN)
                return
            scope.setdefault("state", {})["token_via"] = where

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


async def _refuse(send: Send, status: int, why: str) -> None:
    """A response of ``status`` that says ``why``: as JSON (``{"error": why}``), which the pages
    read and a person reads as well."""
    body = (json.dumps({"error": f"{status}: {why}"}) + "\n").encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *SECURITY_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
