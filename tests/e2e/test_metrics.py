"""The extractor's Ray metrics reach Ray's metrics endpoint (what Prometheus and the dashboard read)."""

from __future__ import annotations

import re
import time

import pytest
import requests

pytestmark = pytest.mark.slow


def _scrape(ray_session) -> str:
    node = ray_session.nodes()[0]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return requests.get(url, timeout=10).text


def _value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_actor_metrics_are_exported(ray_session, harvest_run):
    _, summary = harvest_run
    p = summary.this_run
    deadline = time.monotonic() + 60  # Ray exports actor metrics every few seconds
    text = ""
    while time.monotonic() < deadline:
        text = _scrape(ray_session)
        if (
            _value(text, "ray_harvest_samples_total", status="ok") >= p.ok
            and "ray_harvest_request_latency_seconds" in text
        ):
            break
        time.sleep(3)
    assert _value(text, "ray_harvest_samples_total", status="ok") >= p.ok > 0, text[:2000]
    assert _value(text, "ray_harvest_samples_total", status="error") >= p.errors
    assert _value(text, "ray_harvest_tokens_total") >= p.tokens > 0
    assert _value(text, "ray_harvest_bytes_written_total") >= p.bytes > 0
    assert re.search(r"ray_harvest_request_latency_seconds_bucket\{", text)
