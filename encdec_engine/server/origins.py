"""Which `Host` and `Origin` headers the server answers: no web page may use it through a visitor's browser.

A page on any site can make the browser of someone who runs `encdec serve` send it requests, two ways:

    DNS rebinding   the page's own name (evil.example) is re-resolved to 127.0.0.1, and the page calls the
                    server as its own origin: it reads /v1/models, sends uploads, reads transcripts. The
                    browser sends `Host: evil.example:8000`. Refused: only this machine's names (localhost,
                    *.localhost), IP addresses (no name to rebind) and `--allowed-hosts` are served.
    cross-site      the page posts a form (a multipart upload is a transcription) or opens a websocket
                    (/v1/realtime: websockets ignore CORS) to http://127.0.0.1:8000. The browser names the
                    page in `Origin`. Refused: only pages of this machine (http(s)://localhost, *.localhost,
                    127.0.0.1, [::1], any port), the server's own pages (same origin) and
                    `--allowed-origins` are served.

Clients that are not browsers (the openai client, curl) send no `Origin` and the `Host` they were given,
so they pass. This is what Ollama does since CVE-2024-28224, and Jupyter. A refusal is a 403 (as theirs,
Vite's and webpack-dev-server's), not 421 Misdirected Request: 421 invites a client to retry on another
connection, and the request is not misdirected but unwelcome. A leaf: stdlib and the error type only.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from encdec_engine.server.errors import APIError

ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address, without port; `[::1]` or `::1`) always means this machine."""
    name = _name(host)
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: never sent to DNS
        return True
    ip = _ip(name)
    return ip is not None and ip.is_loopback


def check_host_entry(entry: str) -> None:
    """ValueError unless `entry` is one `--allowed-hosts` value: `*`, a name, `.name` (it and its
    subdomains) or an IP address; without port (every port is served)."""
    name = entry.strip()
    if name == ANY:
        return
    bare = name.removeprefix(".")
    if not bare or "/" in bare or (":" in bare and _ip(_name(bare)) is None):
        raise ValueError(f"allowed host {entry!r} is not a host name: write the name alone, without scheme or port "
                         "(e.g. 'myserver.lan', '.example.com' for it and its subdomains, '*' for any)")


def origin_key(origin: str) -> str:
    """`origin` as browsers write it (`scheme://host[:port]`, lower case, no default port); ValueError if it
    is not one."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:  # a bad port or IPv6 address
        parts = port = None
    if (parts is None or not parts.scheme or not parts.hostname or parts.path not in ("", "/") or parts.query
            or parts.fragment):
        raise ValueError(f"allowed origin {origin!r} is not an origin: write scheme://host[:port], as a browser "
                         "sends it (e.g. 'https://app.example.com', '*' for any)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    shown = "" if port in (None, _DEFAULT_PORTS.get(parts.scheme)) else f":{port}"
    return f"{parts.scheme}://{host}{shown}"


def refusal(headers: dict[bytes, bytes], allowed_hosts: tuple[str, ...] | None,
            allowed_origins: tuple[str, ...]) -> APIError | None:
    """The 403 for a request whose `Host` or `Origin` header is not served (None: it is). `allowed_hosts`:
    the names served besides this machine's and IP addresses (None: none more); `allowed_origins`: the
    pages served besides this machine's and the server's own."""
    host = headers.get(b"host", b"").decode("latin-1")
    allowed_hosts = allowed_hosts or ()
    named = host_is_named(host, allowed_hosts)
    if host and not named and ANY not in allowed_hosts:
        name = _name(_without_port(host))
        return APIError(403, f"Host {host!r} is not served here: a name other than this machine's (localhost, "
                             "127.0.0.1, [::1]) or an IP address may be a web page's, pointed here by DNS "
                             f"rebinding; to serve it, start the server with --allowed-hosts {name}")
    origin = headers.get(b"origin")
    if origin is None or ANY in allowed_origins:
        return None
    origin = origin.decode("latin-1")
    try:
        key = origin_key(origin)
    except ValueError:  # `null` (a sandboxed page, a file://), or not an origin at all
        key = None
    if key is not None and _origin_served(key, host if named else None, allowed_origins):
        return None
    fix = key or "'*' (a page without an origin of its own, such as a sandboxed frame or a file, has no other way)"
    return APIError(403, f"Origin {origin!r} is not allowed: this server answers web pages only from this machine "
                         "(http(s)://localhost, 127.0.0.1 or [::1], any port) and its own; to let this page call "
                         f"it, start the server with --allowed-origins {fix}")


def _origin_served(key: str, host: str | None, allowed_origins: tuple[str, ...]) -> bool:
    """Whether the page `key` (an `origin_key`) may call: it is listed, it is this machine's, or it is the
    server's own (its /docs) under the `Host` it was reached by (None: a Host served only by the wildcard)."""
    if key in {origin_key(o) for o in allowed_origins}:
        return True
    parts = urlsplit(key)
    if parts.scheme in ("http", "https") and is_loopback(parts.hostname):
        return True
    return host is not None and parts.netloc == host.lower()


def host_is_named(host: str, allowed_hosts: tuple[str, ...]) -> bool:
    """Whether a `Host` header's name (port aside) is this machine's, an IP address, or one of
    `allowed_hosts` by name (`.name`: it and its subdomains); the wildcard `*` names none."""
    name = _name(_without_port(host))
    if is_loopback(name) or _ip(name) is not None:
        return True
    for entry in allowed_hosts:
        if entry == ANY:
            continue
        entry = _name(entry)
        if name == entry.removeprefix(".") or (entry.startswith(".") and name.endswith(entry)):
            return True
    return False


def _without_port(host: str) -> str:
    """`host:port` -> `host`; `[::1]:8000` -> `[::1]`."""
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else host


def _name(host: str) -> str:
    """A host name for comparing: lower case, no brackets, no trailing dot, an IP address in its short form."""
    name = host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    ip = _ip(name)
    return str(ip) if ip is not None else name


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None
