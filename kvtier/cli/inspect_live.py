"""`kvtier inspect --metrics URL`: a running engine's tiers, read from its Prometheus endpoint.

A file tier at rest keeps no retention (hints live in the running engine, a restart forgets
them), so what the sessions' hints keep is read where it lives: the standalone API's endpoint
(`KVTier.open(..., metrics_port=)`: `kvtier_tier_*`, `kvtier_retention_*`) or vLLM's `/metrics`
with kvtier's connector (`vllm:kvtier_*`, `vllm:kvtier_retention_*`, one set per engine). Per
tier: blocks resident, capacity, retained by sessions' hints, of ended sessions (evicted first);
then the retention's counters. Exit status 0; 2 when the URL cannot be read or serves no kvtier
metrics.
"""

from __future__ import annotations

import http.client
import math
import re
import threading
import urllib.error
import urllib.request
from typing import Any

from kvtier.cli.inspect import write_report
from kvtier.core.errors import KVTierError
from kvtier.core.quoting import clip

TIER_GAUGES = ("resident_blocks", "capacity_blocks", "retained_blocks", "ended_blocks")
MAX_BYTES = 32 << 20  # a metrics page larger than this is no kvtier endpoint's
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_TIER = re.compile(rf"^(?:vllm:kvtier_|kvtier_tier_)({'|'.join(TIER_GAUGES)})$")
_RETENTION = re.compile(r"^(?:vllm:kvtier_retention_|kvtier_retention_)([a-z_]+?)(_total)?$")


def read_metrics(url: str, timeout: float = 10.0) -> str:
    """The text `url` serves (http or https; at most `MAX_BYTES`), read within `timeout` seconds in
    all (a server that sends its headers or body byte by byte included); a `KVTierError` naming
    `--metrics` and the reason when it cannot be read: an error status, no HTTP, a page cut short
    of its Content-Length, too large, or not all there in time."""
    if not re.match(r"^https?://[^/\s]+", url):
        raise KVTierError(f"--metrics: {url!r} is no http(s) URL; give the endpoint, e.g. "
                          "http://127.0.0.1:9400/metrics (KVTier.open(metrics_port=)) or vLLM's http://HOST:8000/metrics")
    outcome: list[bytes | KVTierError] = []
    reader = threading.Thread(target=lambda: outcome.append(_fetch(url, timeout)), daemon=True,
                              name="kvtier-inspect-metrics")
    reader.start()
    reader.join(timeout)
    if not outcome:  # (the reader is left behind: this command ends soon after)
        raise KVTierError(f"--metrics: {url} did not send its whole page within {timeout:g} s")
    if isinstance(outcome[0], KVTierError):
        raise outcome[0]
    return outcome[0].decode("utf-8", errors="replace")


def _fetch(url: str, timeout: float) -> bytes | KVTierError:
    """`read_metrics`'s request, without its overall deadline: the body, or the error to raise."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_BYTES + 1)
            missing = response.length  # (bytes of a declared Content-Length not received: a read stops at EOF)
    except urllib.error.HTTPError as exc:
        return KVTierError(f"--metrics: {url} answered HTTP {exc.code} ({exc.reason})")
    except http.client.HTTPException as exc:  # (not HTTP, headers too long or too many, a chunk cut short)
        return KVTierError(f"--metrics: {url} did not answer in HTTP: {type(exc).__name__}: {clip(str(exc))}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return KVTierError(f"--metrics: cannot read {url}: {reason}")
    if len(body) > MAX_BYTES:
        return KVTierError(f"--metrics: {url} served more than {MAX_BYTES >> 20} MiB: no metrics page")
    if missing:
        return KVTierError(f"--metrics: {url} closed the connection {missing} bytes short of its Content-Length "
                           f"({len(body)} received): the page is incomplete")
    return body


def live_report(text: str) -> dict[str, Any]:
    """The kvtier numbers of a Prometheus text page: `tiers` (name -> `TIER_GAUGES`) and
    `retention` (counter -> value); under vLLM each name is prefixed with its engine
    (`engine 0/cpu`) when the page holds more than one engine."""
    tiers: dict[tuple[str, str], dict[str, float]] = {}
    retention: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or line.startswith("#"):
            continue
        name, labels_text, value_text = sample.groups()
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not math.isfinite(value):  # (NaN, +Inf: no count of blocks; JSON has no spelling for them)
            continue
        labels = dict(_LABEL.findall(labels_text or ""))
        engine = labels.get("engine", "")
        if (gauge := _TIER.match(name)) and "tier" in labels:
            tiers.setdefault((engine, labels["tier"]), {})[gauge.group(1)] = value
        elif (counter := _RETENTION.match(name)) and not name.endswith("_created"):
            retention.setdefault(engine, {})[counter.group(1)] = value
    several = len({engine for engine, _ in tiers} | set(retention)) > 1
    return {"tiers": {(f"engine {e}/{t}" if several else t): row for (e, t), row in tiers.items()},
            "retention": {(f"engine {e}" if several else "all"): row for e, row in retention.items()}}


def run_inspect_live(url: str, json_path: str | None) -> int:
    """Print (and with `json_path` write) the `live_report` of the endpoint at `url`."""
    report = {"url": url, **live_report(read_metrics(url))}
    if not report["tiers"] and not report["retention"]:
        raise KVTierError(f"--metrics: {url} serves no kvtier metrics (kvtier_tier_* or vllm:kvtier_*): is it "
                          "a KVTier's metrics_port, or vLLM's /metrics with kvtier's connector?")
    rows: list[tuple[str, ...]] = [("tier", "resident", "capacity", "retained", "ended")]
    rows += [(_printable(name), *(_count(row.get(g)) for g in TIER_GAUGES)) for name, row in report["tiers"].items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"tiers at {url} (retained: kept by sessions' hints; ended: of ended sessions, evicted first)")
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for where, counters in report["retention"].items():
        text = ", ".join(f"{name} {_count(value)}" for name, value in sorted(counters.items()))
        print(f"retention ({_printable(where)}): {text}")
    if not report["retention"]:
        print("retention: no hint given yet")
    if json_path:
        write_report(json_path, report)
    return 0


def _count(value: float | None) -> str:
    """A gauge or counter as printed: an integer without '.0', '-' when absent."""
    if value is None:
        return "-"
    return str(int(value)) if value.is_integer() else f"{value:g}"


def _printable(name: str) -> str:
    """A name from the page as printed: control characters escaped (the page is the server's text)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")
