"""The Prometheus endpoint (`[metrics] listen`): scraped over real HTTP with
urllib, parsed with the official parsers of the Prometheus Python client
(`prometheus_client.parser` for the text format, and the stricter
`prometheus_client.openmetrics.parser` for what the daemon declares it serves).
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from conftest import Daemon, H5Data, poll

#: Bytes of one sample of the default dataset: x f32[4, 3], y u8, label i32.
SAMPLE_BYTES = 4 * 3 * 4 + 1 + 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_metrics(start_daemon: Callable[..., Daemon], **kwargs: Any) -> tuple[Daemon, str]:
    port = free_port()
    extra = kwargs.pop("extra", "") + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    return start_daemon(extra=extra, **kwargs), f"http://127.0.0.1:{port}"


def scrape(base: str) -> tuple[str, str]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], resp.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """`{(sample name, labels): value}` as the Prometheus text parser reads it."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in parsed, f"{name}{labels} not in {sorted(k for k in parsed if k[0] == name)}"
    return parsed[key]


def test_metrics_are_served_and_move(start_daemon: Callable[..., Daemon], stoker: Any, data: H5Data) -> None:
    daemon, base = with_metrics(start_daemon, datasets={"train": data})
    loader = stoker.Loader("train", batch_size=10, shuffle=False, socket=daemon.socket)
    batches = iter(loader)
    for _ in range(3):
        next(batches)

    content_type, text = scrape(base)
    assert content_type.startswith("application/openmetrics-text"), content_type
    families = {f.name: f for f in parse_openmetrics(text)}
    expected = {
        "stoker_build_info": "gauge",
        "stoker_clients": "gauge",
        "stoker_streams": "gauge",
        "stoker_worker_threads": "gauge",
        "stoker_worker_busy_seconds": "counter",
        "stoker_chunk_cache_hits": "counter",
        "stoker_chunk_cache_misses": "counter",
        "stoker_chunk_cache_bytes": "gauge",
        "stoker_chunk_cache_capacity_bytes": "gauge",
        "stoker_chunk_cache_entries": "gauge",
        "stoker_dataset_batches": "counter",
        "stoker_dataset_read_bytes": "counter",
        "stoker_dataset_decode_seconds": "counter",
        "stoker_dataset_errors": "counter",
        "stoker_dataset_skipped_samples": "counter",
        "stoker_dataset_open_files": "gauge",
        "stoker_stream_batches": "counter",
        "stoker_stream_delivered_bytes": "counter",
        "stoker_stream_data_wait_seconds": "counter",
        "stoker_stream_slots_filled": "gauge",
        "stoker_stream_slots_leased": "gauge",
        "stoker_stream_slots": "gauge",
        "stoker_hdf5_helpers": "gauge",
        "stoker_hdf5_helper_deaths": "counter",
    }
    assert {name: families[name].type for name in expected if name in families} == expected

    m = samples(text)
    # Stream series carry the client's job ($SLURM_JOB_ID, "-" without) and
    # uid (issue 24, item 9: which Slurm job is stalled?).
    stream = {"dataset": "train", "rank": "0", "slurm_job": os.environ.get("SLURM_JOB_ID") or "-",
              "uid": str(os.getuid())}
    (stream_id,) = {dict(k[1])["stream"] for k in m if k[0] == "stoker_stream_batches_total"}
    stream["stream"] = stream_id
    assert value(m, "stoker_build_info", version=daemon.status()["version"]) == 1
    # The named dataset's files were opened by the named datasets' helper.
    assert value(m, "stoker_hdf5_helpers") == 1
    assert value(m, "stoker_hdf5_helper_deaths_total") == 0
    assert value(m, "stoker_stream_batches_total", **stream) == 3
    assert value(m, "stoker_stream_delivered_bytes_total", **stream) == 3 * 10 * SAMPLE_BYTES
    assert value(m, "stoker_stream_data_wait_seconds_total", **stream) >= 0
    assert value(m, "stoker_stream_slots", **stream) == 4
    assert value(m, "stoker_clients") == 1
    assert value(m, "stoker_streams") == 1
    assert value(m, "stoker_worker_threads") == 2
    assert value(m, "stoker_chunk_cache_capacity_bytes") == 512 << 20
    produced = value(m, "stoker_dataset_batches_total", dataset="train")
    assert produced >= 3
    assert value(m, "stoker_dataset_read_bytes_total", dataset="train") >= 3 * 10 * SAMPLE_BYTES
    assert value(m, "stoker_dataset_decode_seconds_total", dataset="train") > 0
    assert value(m, "stoker_dataset_errors_total", dataset="train") == 0
    assert value(m, "stoker_dataset_skipped_samples_total", dataset="train") == 0
    assert value(m, "stoker_dataset_open_files", dataset="train") >= 1
    assert value(m, "stoker_worker_busy_seconds_total") >= value(m, "stoker_dataset_decode_seconds_total", dataset="train")

    for _ in range(2):
        next(batches)
    m2 = samples(scrape(base)[1])
    assert value(m2, "stoker_stream_batches_total", **stream) == 5
    assert value(m2, "stoker_stream_delivered_bytes_total", **stream) == 5 * 10 * SAMPLE_BYTES
    assert value(m2, "stoker_dataset_batches_total", dataset="train") >= produced
    del batches
    loader.close()

    # The stream's series end with it; the dataset's counters stay (they only grow).
    m3 = samples(scrape(base)[1])
    assert not [k for k in m3 if k[0] == "stoker_stream_batches_total"]
    assert value(m3, "stoker_streams") == 0
    assert value(m3, "stoker_dataset_batches_total", dataset="train") >= value(
        m2, "stoker_dataset_batches_total", dataset="train"
    )


def test_ad_hoc_dataset_paths_never_reach_the_labels(
    start_daemon: Callable[..., Daemon], stoker: Any, make_h5: Callable[..., H5Data], tmp_path: Any
) -> None:
    """Finding 14 of issue 22: anyone who can reach the endpoint saw other
    users' ad-hoc file paths. Ad-hoc datasets are labelled `adhoc-` and a
    hash of the path; the text stays valid OpenMetrics."""
    data = make_h5(tmp_path / 'odd "name" \\ dir', lengths=(20,))
    daemon, base = with_metrics(start_daemon)
    loader = stoker.Loader(data.spec(stoker), batch_size=5, socket=daemon.socket)
    next(iter(loader))
    text = scrape(base)[1]
    list(parse_openmetrics(text))  # strict: raises on a malformed label
    m = samples(text)
    labels = {dict(k[1]).get("dataset") for k in m if k[0] == "stoker_dataset_batches_total"}
    assert 'odd "name"' not in text and str(tmp_path) not in text
    assert any(label and re.fullmatch(r"adhoc-[0-9a-f]{16}", label) for label in labels), labels
    loader.close()


def test_wrong_paths_and_methods(start_daemon: Callable[..., Daemon]) -> None:
    _, base = with_metrics(start_daemon)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/", timeout=30)
    assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/metrics/x", timeout=30)
    assert e.value.code == 404
    for method in ("POST", "PUT", "DELETE"):
        req = urllib.request.Request(base + "/metrics", data=b"x" if method != "DELETE" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 405, method
        assert "GET" in e.value.headers["Allow"]
    with urllib.request.urlopen(urllib.request.Request(base + "/metrics", method="HEAD"), timeout=30) as resp:
        assert resp.status == 200 and resp.read() == b""
        assert int(resp.headers["Content-Length"]) > 0


def raw_request(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_slow_and_garbage_clients_do_not_block_scrapes(start_daemon: Callable[..., Daemon]) -> None:
    daemon, base = with_metrics(start_daemon)
    port = int(base.rsplit(":", 1)[1])
    # Clients that start a request and never finish it.
    stalled = []
    for i in range(8):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /metr" if i % 2 else b"\x00\xff\x13garbage")
        stalled.append(s)
    try:
        # Answered at once while they hang.
        for _ in range(3):
            _, text = scrape(base)
            assert "stoker_build_info" in text
        assert raw_request(port, b"\x16\x03\x01 not http at all\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert raw_request(port, b"GET /metrics HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 505 ")
        # A request head past the bound is refused, not buffered.
        head = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20000
        assert raw_request(port, head).startswith(b"HTTP/1.1 431 ")
        # A stalled client is answered and closed by the daemon's deadline.
        stalled[1].settimeout(30)
        assert stalled[1].recv(100).startswith(b"HTTP/1.1 408 ")
    finally:
        for s in stalled:
            s.close()
    assert daemon.alive()
    assert "stoker_build_info" in scrape(base)[1]


def test_metrics_listen_must_be_an_address(start_daemon: Callable[..., Daemon], tmp_path: Any) -> None:
    import subprocess

    from conftest import stoker_bin

    config = tmp_path / "bad.toml"
    config.write_text('[metrics]\nlisten = "localhost"\n')
    res = subprocess.run([str(stoker_bin()), "validate", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "[metrics] listen" in res.stderr and "localhost" in res.stderr, res.stderr


def test_skipped_samples_are_counted_and_kept(
    start_daemon: Callable[..., Daemon], stoker: Any, tmp_path: Any
) -> None:
    import numpy as np

    from lmdb_data import key, npy_bytes, write_env

    n = 12
    items = {key(i): npy_bytes(np.full((3,), i, dtype=np.int32)) for i in range(n)}
    items[key(5)] = b"not an npy value"
    env = write_env(tmp_path / "vals", items)
    daemon, base = with_metrics(start_daemon)
    spec = stoker.lmdb({"v": env}, fields={"v": "npy"}, on_error="skip")
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=daemon.socket)
    served = [int(row[0]) for batch in loader for row in np.asarray(batch["v"])]
    assert 5 not in served and len(served) == n

    def skipped(text: str) -> float:
        m = samples(text)
        values = [v for (name, _), v in m.items() if name == "stoker_dataset_skipped_samples_total"]
        assert len(values) == 1, values
        return values[0]

    def open_files(text: str) -> list[float]:
        return [v for (name, _), v in samples(text).items() if name == "stoker_dataset_open_files"]

    def closed() -> str | None:
        text = scrape(base)[1]
        return text if open_files(text) in ([], [0.0]) else None

    before = scrape(base)[1]
    assert skipped(before) >= 1
    assert open_files(before) not in ([], [0.0]), "the LMDB environment is open while a stream reads it"
    loader.close()
    # The source itself closes [limits] idle_close_s after its last stream.
    after = poll(closed, timeout=60)
    assert after is not None, f"the source is still open: {open_files(scrape(base)[1])}"
    assert skipped(after) >= 1, "the count must outlive the source"


def test_idle_connections_cannot_lock_the_scraper_out(start_daemon: Callable[..., Daemon]) -> None:
    """Finding 14 of issue 22: 16 connections that never send a request took
    every slot of the endpoint, and the real scraper was turned away until
    they timed out (and again whenever they came back). A full endpoint now
    drops the connection that has waited longest without a request."""
    daemon, base = with_metrics(start_daemon)
    port = int(base.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(32)]
    try:
        for _ in range(5):
            start = time.monotonic()
            assert "stoker_build_info" in scrape(base)[1]
            assert time.monotonic() - start < 2.5
            # And the idle ones keep coming back.
            idle.extend(socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(16))
    finally:
        for s in idle:
            s.close()
    assert daemon.alive()


def test_alert_rules_and_dashboard_name_metrics_the_daemon_exports(
    start_daemon: Callable[..., Daemon], stoker: Any, data: H5Data
) -> None:
    """Issue 24, item 10: the shipped Prometheus alerting rules pass
    `promtool check rules`, and every `stoker_*` metric named by them or by
    the Grafana dashboard is one a real daemon exports (a renamed metric
    would silently empty a panel or never fire an alert)."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    rules = repo / "config" / "prometheus" / "stoker-alerts.yml"
    dashboard = repo / "config" / "grafana" / "stoker-dashboard.json"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/setup.sh installs Debian's prometheus package)")
    res = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    exprs = re.findall(r"expr:\s*(\|[\s\S]*?(?=\n\s*for:|\n\s*labels:)|.*)", rules.read_text())
    board = json.loads(dashboard.read_text())
    exprs += [t["expr"] for p in board["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\bstoker_[a-z0-9_]+", e)}
    assert len(wanted) >= 10, wanted

    d, base = with_metrics(start_daemon, datasets={"train": data})
    loader = stoker.Loader("train", batch_size=10, shuffle=False, socket=d.socket)
    next(iter(loader))
    names = {k[0] for k in samples(scrape(base)[1])}
    loader.close()
    assert wanted <= names, f"named but not exported: {sorted(wanted - names)}"
