"""The benchmarks' reading of a service's histograms, against a real
prometheus_client registry served over HTTP."""

import math

import prometheus_client
import pytest

from bench.report import bucket_quantile, cpu_times, steal_share
from services.common.metrics import scrape


@pytest.fixture
def served():
    registry = prometheus_client.CollectorRegistry()
    histogram = prometheus_client.Histogram(
        "t_seconds", "test", ["code"], buckets=(0.001, 0.005, 0.01, 0.1), registry=registry
    )
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield histogram, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.service
def test_quantiles_count_only_what_happened_between_the_two_scrapes(served):
    histogram, url = served
    for _ in range(100):
        histogram.labels("OK").observe(0.05)  # before: must not count
    before = scrape(url)
    for seconds in [0.0005] * 98 + [0.008, 0.008]:
        histogram.labels("OK").observe(seconds)
    histogram.labels("UNAVAILABLE").observe(0.5)  # another label: must not count
    after = scrape(url)
    assert bucket_quantile(before, after, "t_seconds", 0.5, code="OK") == 0.001
    assert bucket_quantile(before, after, "t_seconds", 0.98, code="OK") == 0.001
    assert bucket_quantile(before, after, "t_seconds", 0.99, code="OK") == 0.01
    assert bucket_quantile(before, after, "t_seconds", 0.99, code="UNAVAILABLE") == math.inf
    assert math.isnan(bucket_quantile(after, after, "t_seconds", 0.99, code="OK"))


@pytest.mark.unit
def test_steal_is_the_hypervisors_share_of_the_cpu_time_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 1 2 3\n")
    before = cpu_times(stat)
    stat.write_text("cpu  160 0 70 900 0 0 0 70 0 0\ncpu0 1 2 3\n")
    assert steal_share(before, cpu_times(stat)) == 20 / 200
    assert steal_share(before, before) == 0.0
    assert cpu_times(tmp_path / "missing") is None and steal_share(None, before) is None


@pytest.mark.unit
def test_this_machines_cpu_times_read_and_only_grow():
    before = cpu_times()  # Linux, as every test here that reads /proc
    assert before is not None, "this machine's /proc/stat could not be read"
    sum(i * i for i in range(200_000))
    after = cpu_times()
    assert len(before) == 8 and all(b >= a for a, b in zip(before, after, strict=True)) and sum(after) > sum(before)
    assert 0.0 <= steal_share(before, after) <= 1.0
