"""Where the server is: the URL forms of a shared tier's `url` (`parse_url`, `redact_url`).

URL forms (`ClientOptions.url`, options.py):

- `redis://HOST[:PORT][/DB]`: one server over TCP (port 6379 when left out, database 0 by default);
- `rediss://HOST[:PORT][/DB]`: the same over TLS (`tls_*` options);
- `unix:///PATH/TO/SOCKET`: one server on a local Unix socket (database 0);
- `cluster://HOST:PORT,HOST:PORT,...`: a cluster, given by one or more seed nodes (the client reads the
  slot map from the first that answers); `clusters://...` is the same over TLS. Cluster mode has no
  database number. Servers should run with `cluster-require-full-coverage no`, so a dead shard does not
  take the others' keys down with it.

IPv6 hosts go in brackets (`redis://[::1]:6379`). Credentials never go in the URL (a URL is logged and
shown by `config check`): pass `username` / `password` (the tier resolves them from an environment
variable or a file). A bad value raises `ValueError` naming the field and what would be right; the
message never echoes a password.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix", "cluster", "clusters")


@dataclass(frozen=True)
class Endpoint:
    """One server: a TCP host and port, or a Unix socket path."""

    host: str = ""
    port: int = DEFAULT_PORT
    unix_path: str = ""

    @property
    def name(self) -> str:
        if self.unix_path:
            return f"unix:{self.unix_path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ParsedUrl:
    cluster: bool
    tls: bool
    endpoints: tuple[Endpoint, ...]  # one for a single server; the seeds of a cluster
    db: int = 0


def _host_port(text: str, where: str) -> Endpoint:
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{where}: {text!r} opens '[' without ']' (IPv6 form: [::1]:6379)")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{where}: unexpected {rest!r} after the IPv6 host (form: [::1]:6379)")
        port_text = rest[1:] if rest else ""
    else:
        host, sep, port_text = text.partition(":")
        if sep and not port_text:
            raise ValueError(f"{where}: {text!r} has ':' but no port (form: HOST:PORT)")
        if ":" in port_text:
            raise ValueError(f"{where}: {text!r} has more than one ':' (IPv6 hosts go in brackets: [::1]:6379)")
    if not host:
        raise ValueError(f"{where}: no host in {text!r} (form: HOST[:PORT])")
    if any(c.isspace() or c in "/?#@," for c in host):
        raise ValueError(f"{where}: host {host!r} has a character that is not allowed in a host name")
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{where}: port {port_text!r} is not a number from 1 to 65535")
        port = int(port_text)
    return Endpoint(host=host, port=port)


def redact_url(url: str) -> str:
    """`url` fit to print: userinfo (`user:pw@`), query and fragment replaced by `<redacted>`."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        rest = rest[:cut] + rest[cut] + "<redacted>"
    userinfo, at, host = rest.rpartition("@")
    if at:
        rest = "<redacted>@" + host
    return scheme + sep + rest


def parse_url(url: str, where: str = "url") -> ParsedUrl:
    """Parse one of the URL forms of the module docstring; `where` names the field in errors."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: expected a non-empty string such as redis://127.0.0.1:6379, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"{where}: the URL must start with one of {', '.join(s + '://' for s in SCHEMES)}"
                         f" (got {scheme + sep if sep else 'no scheme'})")
    if "@" in rest:  # the credentials are not echoed
        raise ValueError(f"{where}: credentials are not accepted in the URL; pass username and password "
                         "(password_env or password_file in the tier's config)")
    if any(c in rest for c in "?#") or any(c.isspace() for c in rest):
        raise ValueError(f"{where}: {redact_url(url)!r} has a query, a fragment or a space; none is accepted "
                         "(credentials go in username and password_env or password_file)")
    if scheme == "unix":
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"{where}: unix:// needs an absolute socket path, e.g. unix:///run/valkey/valkey.sock")
        return ParsedUrl(cluster=False, tls=False, endpoints=(Endpoint(unix_path=rest),))
    tls = scheme in ("rediss", "clusters")
    if scheme in ("cluster", "clusters"):
        if "/" in rest:
            raise ValueError(f"{where}: a cluster URL has no path or database (form: {scheme}://HOST:PORT,HOST:PORT)")
        seeds = rest.split(",")
        endpoints = tuple(_host_port(s, f"{where} (seed {i})") for i, s in enumerate(seeds))
        return ParsedUrl(cluster=True, tls=tls, endpoints=endpoints)
    hostport, _, path = rest.partition("/")
    if "," in hostport:
        raise ValueError(f"{where}: several hosts need the cluster form ({'clusters' if tls else 'cluster'}://H:P,H:P)")
    db = 0
    if path:
        if not path.isdigit():
            raise ValueError(f"{where}: the path must be a database number (e.g. /0); it is not one "
                             "(not shown: it may hold a secret)")
        if len(path) > 10 or int(path) >= 1 << 31:
            raise ValueError(f"{where}: database number {path[:12] + ('...' if len(path) > 12 else '')} is "
                             f"above the largest a server accepts (2147483647; the server's `databases`, 16 "
                             f"by default, is the real limit)")
        db = int(path)
    return ParsedUrl(cluster=False, tls=tls, endpoints=(_host_port(hostport, where),), db=db)
