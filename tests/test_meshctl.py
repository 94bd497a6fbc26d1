"""meshctl edits the traffic policy keeping everything but the weights as it
was, refuses edits that would not pass the policy checks, and rolls back."""

import http.server
import pathlib
import shutil
import threading

import pytest

from services.meshctl import __main__ as meshctl
from services.meshctl import core
from services.meshctl.live import weight_patch

POLICY = pathlib.Path(__file__).resolve().parent.parent / "mesh" / "istio" / "model-server-traffic.yaml"


@pytest.fixture
def policy(tmp_path) -> pathlib.Path:
    path = tmp_path / "traffic.yaml"
    shutil.copy(POLICY, path)
    return path


@pytest.mark.unit
def test_set_weights_changes_only_the_weights_and_records_the_old_ones(policy):
    before = policy.read_text().splitlines()
    assert meshctl.main(["--file", str(policy), "set-weights", "model-server", "blue=90", "green=10"]) == 0
    after = policy.read_text().splitlines()
    changed = [
        (a, b)
        for a, b in zip(
            before,
            [line for line in after if "annotations" not in line and "previous-weights" not in line],
            strict=True,
        )
        if a != b
    ]
    assert changed == [("      weight: 100", "      weight: 90"), ("      weight: 0", "      weight: 10")]
    assert len(after) == len(before) + 2  # the annotation's two lines
    assert all(line in after for line in before if line.lstrip().startswith("#"))  # every comment kept
    assert core.weights(policy, "model-server") == {"blue": 90, "green": 10}
    assert core.previous_weights(policy, "model-server") == {"blue": 100, "green": 0}


@pytest.mark.unit
def test_promote_and_rollback(policy):
    assert meshctl.main(["--file", str(policy), "set-weights", "model-server", "blue=50", "green=50"]) == 0
    assert meshctl.main(["--file", str(policy), "promote", "model-server", "green"]) == 0
    assert core.weights(policy, "model-server") == {"blue": 0, "green": 100}
    assert meshctl.main(["--file", str(policy), "rollback", "model-server"]) == 0
    assert core.weights(policy, "model-server") == {"blue": 50, "green": 50}


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, complaint",
    [
        (["set-weights", "model-server", "blue=90"], "give a weight for each of them"),
        (["set-weights", "model-server", "blue=0", "green=0"], "not all 0"),
        (["set-weights", "model-server", "blue=ninety", "green=10"], "weights are SUBSET=INTEGER"),
        (["set-weights", "model-server", "blue=90", "purple=10"], "give a weight for each of them"),
        (["set-weights", "search", "a=1", "b=2"], "no VirtualService for host 'search'"),
        (["promote", "model-server", "purple"], "has no subset 'purple'"),
        (["rollback", "model-server"], "no earlier weights"),
    ],
)
def test_bad_requests_change_nothing(policy, capsys, args, complaint):
    before = policy.read_text()
    assert meshctl.main(["--file", str(policy), *args]) == 2
    assert complaint in capsys.readouterr().err
    assert policy.read_text() == before


@pytest.mark.unit
def test_judge_fails_an_interval_without_evidence_and_one_over_its_thresholds():
    def scrape(total, ok, buckets):
        samples = {
            ("infermesh_batcher_upstream_requests_total", (("code", "OK"), ("subset", "green"))): ok,
            ("infermesh_batcher_upstream_requests_total", (("code", "UNAVAILABLE"), ("subset", "green"))): total - ok,
        }
        for le, count in buckets:
            samples[("infermesh_batcher_upstream_duration_seconds_bucket", (("le", str(le)), ("subset", "green")))] = (
                count
            )
        return samples

    checks = core.Checks(min_success_rate=0.99, max_p99_s=0.5)
    start = scrape(10, 10, [(0.1, 10), (0.5, 10), (1.0, 10)])
    assert core.judge(start, start, "green", checks)[0] is False  # no batches: no evidence
    good = scrape(110, 110, [(0.1, 109), (0.5, 110), (1.0, 110)])
    assert core.judge(start, good, "green", checks) == (True, "100 batches, success 100.00%, p99 <= 100 ms")
    slow = scrape(110, 110, [(0.1, 20), (0.5, 60), (1.0, 110)])
    assert core.judge(start, slow, "green", checks)[0] is False
    failing = scrape(110, 108, [(0.1, 110), (0.5, 110), (1.0, 110)])
    assert "need >= 99.00%" in core.judge(start, failing, "green", checks)[1]


@pytest.mark.unit
def test_a_rollout_whose_metrics_cannot_be_read_rolls_back_instead_of_stopping_half_way(policy, capsys):
    done = meshctl.main(
        [
            "--file",
            str(policy),
            "rollout",
            "model-server",
            "green",
            "--step",
            "10",
            "--interval-s",
            "0",
            "--metrics",
            "http://127.0.0.1:1/metrics",
        ]
    )
    said = capsys.readouterr().out.splitlines()
    assert done == 1
    assert said[0].startswith("green at 10%: cannot read the batcher's metrics at http://127.0.0.1:1/metrics")
    assert said[0].endswith(": FAILED") and said[1] == "rolled back: all traffic to blue"
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}


@pytest.mark.unit
def test_a_live_weight_patch_reaches_every_split_route_by_position_even_equal_ones():
    def split() -> dict:
        return {
            "name": "blue-green",
            "route": [
                {"destination": {"host": "model-server", "subset": "blue"}, "weight": 100},
                {"destination": {"host": "model-server", "subset": "green"}},
            ],
        }

    vip = {
        "name": "vip",
        "match": [{"headers": {"x-user-tier": {"exact": "vip"}}}],
        "route": [{"destination": {"host": "model-server", "subset": "vip"}}],
    }
    live = {"metadata": {"name": "model-server", "resourceVersion": "7"}, "spec": {"http": [vip, split(), split()]}}
    ops, old = weight_patch(live, {"blue": 90, "green": 10})
    assert old == {"blue": 100, "green": 0}
    assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "7"}
    assert [(op["path"], op["value"]) for op in ops if op["path"].endswith("/weight")] == [
        ("/spec/http/1/route/0/weight", 90),
        ("/spec/http/1/route/1/weight", 10),
        ("/spec/http/2/route/0/weight", 90),
        ("/spec/http/2/route/1/weight", 10),
    ]


@pytest.mark.service
def test_a_weight_given_to_a_subset_with_no_ready_replica_is_warned_of(policy, capsys):
    """make run has no green replica: shifting traffic there fails its share of batches."""
    text = (
        'infermesh_batcher_subset_ready_replicas{subset="blue"} 1.0\n'
        'infermesh_batcher_subset_ready_replicas{subset="green"} 0.0\n'
    )

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert (
            meshctl.main(
                ["--file", str(policy), "set-weights", "model-server", "blue=90", "green=10", "--metrics", url]
            )
            == 0
        )
        assert (
            "subset 'green' now takes 10 of the weight but the running batcher has no ready replica"
            in capsys.readouterr().err
        )
        assert meshctl.main(["--file", str(policy), "rollback", "model-server", "--metrics", url]) == 0
        assert "warning" not in capsys.readouterr().err  # all on blue again
    finally:
        server.shutdown()
