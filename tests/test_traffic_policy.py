"""Istio's traffic policy with Envoy's semantics, one rule per test: routes,
weights, retries and back-off, outlier detection, and the files' checks."""

import random

import pytest
import yaml

from services.common.traffic import (
    OutlierDetector,
    OutlierPolicy,
    PolicyError,
    backoff_s,
    load_policy_files,
    parse_destination_rule,
    parse_duration,
    parse_virtual_service,
)

pytestmark = pytest.mark.unit

VIRTUAL_SERVICE = """
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: model-server}
spec:
  hosts: [model-server]
  http:
  - name: vip
    match:
    - headers: {x-user-tier: {exact: vip}}
    route:
    - destination: {host: model-server, subset: vip}
  - name: canary-testers
    match:
    - headers: {x-canary: {prefix: "yes"}}
    - headers: {x-team: {regex: "ml-.*"}}
    route:
    - destination: {host: model-server, subset: green}
  - name: default
    retries: {attempts: 2, perTryTimeout: 2s, retryOn: "unavailable,cancelled,gateway-error"}
    route:
    - destination: {host: model-server, subset: blue}
      weight: 75
    - destination: {host: model-server, subset: green}
      weight: 25
"""
DESTINATION_RULE = """
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: model-server}
spec:
  host: model-server
  subsets:
  - {name: blue, labels: {version: blue}}
  - {name: green, labels: {version: green}}
  - {name: vip, labels: {pool: vip}}
  trafficPolicy:
    outlierDetection: {consecutive5xxErrors: 5, interval: 10s, baseEjectionTime: 30s, maxEjectionPercent: 50}
"""


def vs(text: str = VIRTUAL_SERVICE):
    return parse_virtual_service(yaml.safe_load(text), "vs.yaml")


def test_routes_apply_in_order_and_the_first_match_wins():
    service = vs()
    assert service.route({"x-user-tier": "vip", "x-canary": "yes"}).name == "vip"
    assert service.route({"x-canary": "yes-please"}).name == "canary-testers"  # prefix
    assert service.route({"x-team": "ml-search"}).name == "canary-testers"  # any match block will do
    assert service.route({"x-team": "xml-search"}).name == "default"  # a regex matches the whole value
    assert service.route({"x-user-tier": "VIP"}).name == "default"  # exact is exact
    assert service.route({}).name == "default"


def test_weights_are_relative_and_each_call_is_one_pick():
    route = vs().route({})
    rng = random.Random(7)
    picks = [route.pick(rng).subset for _ in range(8000)]
    assert abs(picks.count("blue") / len(picks) - 0.75) < 0.02
    doubled = vs(VIRTUAL_SERVICE.replace("weight: 75", "weight: 150").replace("weight: 25", "weight: 50"))
    rng = random.Random(7)
    assert [doubled.route({}).pick(rng).subset for _ in range(8000)] == picks  # only the ratio matters


def test_a_zero_weight_destination_is_never_picked():
    route = vs(VIRTUAL_SERVICE.replace("weight: 75", "weight: 100").replace("weight: 25", "weight: 0")).route({})
    rng = random.Random(1)
    assert {route.pick(rng).subset for _ in range(2000)} == {"blue"}


def test_weight_layouts_istio_accepts():
    def route(*weights):
        destinations = [{"destination": {"host": "model-server", "subset": subset}} for subset in ("blue", "green")]
        # A route of fewer weights than subsets is a route of that many destinations.
        for destination, weight in zip(destinations, weights, strict=False):
            if weight is not None:
                destination["weight"] = weight
        doc = {
            "kind": "VirtualService",
            "metadata": {"name": "m"},
            "spec": {"hosts": ["model-server"], "http": [{"route": destinations[: len(weights)]}]},
        }
        return parse_virtual_service(doc, "vs.yaml").routes[0]

    rng = random.Random(5)
    omitted = route(100, None)  # an omitted weight is 0 when there are several destinations
    assert [d.weight for d in omitted.destinations] == [100, 0]
    assert {omitted.pick(rng).subset for _ in range(500)} == {"blue"}
    for lone in (route(0), route(None), route(30)):  # a lone destination takes everything, whatever its weight
        assert [(d.subset, d.weight) for d in lone.destinations] == [("blue", 100)]
        assert lone.pick(rng).subset == "blue"
    assert [d.weight for d in route(300, 100).destinations] == [300, 100]  # relative, no need to add up to 100
    for refused in ((0, 0), (None, None), (0, None)):  # Istio: "total destination weight = 0"
        with pytest.raises(PolicyError, match=r"spec.http\[0\]: the weights of its destinations add up to 0"):
            route(*refused)
    with pytest.raises(PolicyError, match="field 'weight' must be an integer >= 0, got -5"):
        route(-5)


def test_retry_on_names_which_grpc_statuses_are_retried():
    retries = vs().route({}).retries
    assert retries.attempts == 2 and retries.per_try_timeout_s == 2.0
    assert retries.retries("UNAVAILABLE") and retries.retries("CANCELLED")
    assert not retries.retries("INTERNAL") and not retries.retries("DEADLINE_EXCEEDED")
    assert not retries.retries("RESOURCE_EXHAUSTED") and not retries.retries("INVALID_ARGUMENT")


def test_http_conditions_see_only_failed_connections_as_envoy_does():
    # To Envoy a gRPC error status is an HTTP 200: "5xx" and "gateway-error" match
    # only what fails below gRPC (a refused connection, a reset stream).
    fives = vs(VIRTUAL_SERVICE.replace("unavailable,cancelled,gateway-error", "5xx")).route({}).retries
    assert not fives.retries("INTERNAL") and not fives.retries("UNAVAILABLE")
    assert fives.retries("UNAVAILABLE", transport_failure=True)
    gateway = vs().route({}).retries
    assert gateway.retries("DEADLINE_EXCEEDED", transport_failure=True)


def test_retries_without_retry_on_use_istios_default_conditions():
    route = vs(
        VIRTUAL_SERVICE.replace(
            'perTryTimeout: 2s, retryOn: "unavailable,cancelled,gateway-error"', "perTryTimeout: 2s"
        )
    ).route({})
    assert route.retries.attempts == 2 and route.retries.retries("UNAVAILABLE") and route.retries.retries("CANCELLED")
    no_retries_field = vs(
        VIRTUAL_SERVICE.replace(
            '    retries: {attempts: 2, perTryTimeout: 2s, retryOn: "unavailable,cancelled,gateway-error"}\n', ""
        )
    )
    assert no_retries_field.route({}).retries.attempts == 2  # Istio retries twice by default


def test_backoff_is_fully_jittered_exponential_and_capped():
    rng = random.Random(3)
    for retry, bound in ((1, 0.025), (2, 0.075), (3, 0.175), (4, 0.25), (9, 0.25)):
        samples = [backoff_s(retry, rng) for _ in range(500)]
        assert min(samples) >= 0 and max(samples) <= bound + 1e-12
        assert max(samples) > 0.8 * bound  # the whole range is used


def detector(hosts: int, **policy) -> OutlierDetector:
    return OutlierDetector(OutlierPolicy(**policy), [f"h{i}" for i in range(hosts)])


def test_consecutive_5xx_eject_a_host_and_other_answers_reset_the_count():
    od = detector(2, max_ejection_percent=50)
    for _ in range(4):
        assert not od.record("h0", "UNAVAILABLE", now=0.0)
    assert not od.record("h0", "OK", now=0.0)  # the streak is broken
    for _ in range(4):
        od.record("h0", "INTERNAL", now=0.0)
    assert od.record("h0", "DEADLINE_EXCEEDED", now=0.0)  # the fifth 5xx in a row
    assert od.ejected() == ["h0"]


def test_resource_exhausted_and_client_errors_never_eject():
    od = detector(2, max_ejection_percent=50)
    for code in ["RESOURCE_EXHAUSTED"] * 20 + ["INVALID_ARGUMENT", "NOT_FOUND", "CANCELLED"] * 5:
        assert not od.record("h0", code, now=0.0)
    assert od.ejected() == []


def test_max_ejection_percent_counts_the_host_about_to_go():
    # Istio's default 10%: with fewer than ten hosts, (0 + 1) / hosts > 10% and nothing is ejected.
    small = detector(3, max_ejection_percent=10)
    for _ in range(50):
        small.record("h0", "UNAVAILABLE", now=0.0)
    assert small.ejected() == []
    ten = detector(10, max_ejection_percent=10)
    for host in ("h0", "h1"):
        for _ in range(5):
            ten.record(host, "UNAVAILABLE", now=0.0)
    assert ten.ejected() == ["h0"]  # h1 would make it 20%


def test_ejection_time_grows_with_each_ejection_up_to_300s_and_checks_run_each_interval():
    od = detector(2, max_ejection_percent=50, base_ejection_s=30.0, interval_s=10.0)
    od.check(0.0)
    for _ in range(5):
        od.record("h0", "UNAVAILABLE", now=1.0)
    assert od.ejection_s("h0") == 30.0
    od.check(30.0)
    assert od.is_ejected("h0")  # the check at 30 s sees 29 s of ejection
    od.check(40.0)
    assert not od.is_ejected("h0")  # back at the first check after 30 s
    for _ in range(5):
        od.record("h0", "UNAVAILABLE", now=41.0)
    assert od.ejection_s("h0") == 60.0  # second ejection in a row: twice as long
    od.check(100.0)
    assert od.is_ejected("h0")
    od.check(110.0)
    assert not od.is_ejected("h0")
    t = 110.0
    for n in range(3, 13):  # fail again the moment it is back: each ejection is longer, up to 300 s
        while od.is_ejected("h0"):
            t += 10.0
            od.check(t)
        for _ in range(5):
            od.record("h0", "UNAVAILABLE", now=t + 0.5)
        assert od.ejection_s("h0") == min(30.0 * n, 300.0)


def test_the_multiplier_decays_while_the_host_stays_in_service():
    def second_ejection_after(healthy_checks: int) -> float:
        od = detector(2, max_ejection_percent=50, base_ejection_s=30.0, interval_s=10.0)
        od.check(0.0)
        for _ in range(5):
            od.record("h0", "UNAVAILABLE", now=1.0)
        od.check(40.0)  # back in service
        t = 40.0 + 10.0 * healthy_checks
        od.check(t)  # each check that finds it in service lowers the multiplier by one
        for _ in range(5):
            od.record("h0", "UNAVAILABLE", now=t + 0.5)
        return od.ejection_s("h0")

    assert second_ejection_after(0) == 60.0
    assert second_ejection_after(1) == 30.0


def test_a_host_comes_back_with_its_error_streaks_at_zero():
    # Batches in flight when the host was ejected fail afterwards; Envoy forgets
    # them when it brings the host back, so the next ejection needs a new streak.
    od = detector(
        2,
        max_ejection_percent=50,
        consecutive_5xx=3,
        consecutive_gateway=3,
        base_ejection_s=30.0,
        interval_s=5.0,
        split_local_origin=True,
        consecutive_local_origin=3,
    )
    od.check(0.0)
    for _ in range(3):
        od.record("h0", "UNAVAILABLE", now=1.0)
    assert od.ejected() == ["h0"]
    for _ in range(4):
        od.record("h0", "UNAVAILABLE", now=1.1)
        od.record("h0", "UNAVAILABLE", now=1.1, local_origin=True)
    assert not od.is_ejected("h0", now=35.0)
    assert not od.record("h0", "UNAVAILABLE", now=35.1)
    assert not od.record("h0", "UNAVAILABLE", now=35.1, local_origin=True)
    assert not od.record("h0", "UNAVAILABLE", now=35.2)
    assert od.record("h0", "UNAVAILABLE", now=35.3)  # three new ones in a row


def test_the_multiplier_stops_growing_one_step_past_the_maximum_ejection_time():
    # Envoy raises it only while base x multiplier < max + base: at most 11 for 30 s and 300 s.
    od = detector(2, max_ejection_percent=50, consecutive_5xx=3, base_ejection_s=30.0, interval_s=5.0)
    t = 0.0
    od.check(t)
    for _ in range(20):  # a host that fails again the moment it is back
        for _ in range(3):
            od.record("h0", "INTERNAL", now=t)
        while od.is_ejected("h0", now=t):
            t += 0.5
        t += 0.1
    assert od.ejection_s("h0") == 300.0
    t += 11 * 5.0  # then in service for eleven checks: the multiplier is back to 0
    od.check(t)
    for _ in range(3):
        od.record("h0", "INTERNAL", now=t)
    assert od.ejected() == ["h0"] and od.ejection_s("h0") == 30.0
    long = detector(2, max_ejection_percent=50, consecutive_5xx=1, base_ejection_s=600.0)
    long.record("h0", "INTERNAL", now=0.0)
    assert long.ejection_s("h0") == 600.0  # a base above 300 s is the maximum itself


def test_gateway_errors_have_their_own_streak():
    od = detector(2, max_ejection_percent=50, consecutive_5xx=0, consecutive_gateway=3)
    od.record("h0", "UNAVAILABLE", now=0.0)
    od.record("h0", "DEADLINE_EXCEEDED", now=0.0)
    od.record("h0", "INTERNAL", now=0.0)  # a 500 is no gateway error: the streak restarts
    od.record("h0", "UNAVAILABLE", now=0.0)
    assert not od.record("h0", "UNAVAILABLE", now=0.0)
    assert od.record("h0", "UNAVAILABLE", now=0.0)


def test_without_split_mode_a_deadline_run_out_at_the_caller_counts_as_a_504():
    od = detector(2, max_ejection_percent=50, consecutive_5xx=3)
    for _ in range(2):
        od.record("h0", "DEADLINE_EXCEEDED", now=0.0, local_origin=True)
    assert od.record("h0", "DEADLINE_EXCEEDED", now=0.0, local_origin=True)


def test_split_mode_counts_failures_at_the_caller_on_their_own_streak():
    od = detector(2, max_ejection_percent=50, consecutive_5xx=3, split_local_origin=True, consecutive_local_origin=4)
    for _ in range(3):  # a busy host's timeouts: no 5xx streak
        assert not od.record("h0", "DEADLINE_EXCEEDED", now=0.0, local_origin=True)
    od.record("h0", "RESOURCE_EXHAUSTED", now=0.0)  # any answer from the host resets the local streak
    for _ in range(3):
        assert not od.record("h0", "UNAVAILABLE", now=0.0, local_origin=True)
    assert od.record("h0", "UNAVAILABLE", now=0.0, local_origin=True)  # the fourth in a row
    od2 = detector(2, max_ejection_percent=50, consecutive_5xx=3, split_local_origin=True)
    od2.record("h0", "INTERNAL", now=0.0)
    od2.record("h0", "DEADLINE_EXCEEDED", now=0.0, local_origin=True)  # neither breaks nor extends the 5xx streak
    od2.record("h0", "INTERNAL", now=0.0)
    assert od2.record("h0", "INTERNAL", now=0.0)


def test_local_origin_failures_need_split_mode_as_istio_says():
    doc = yaml.safe_load(DESTINATION_RULE)
    doc["spec"]["trafficPolicy"]["outlierDetection"]["consecutiveLocalOriginFailures"] = 10
    with pytest.raises(PolicyError, match="needs 'splitExternalLocalOriginErrors: true'"):
        parse_destination_rule(doc, "dr.yaml")
    doc["spec"]["trafficPolicy"]["outlierDetection"]["splitExternalLocalOriginErrors"] = True
    outlier = parse_destination_rule(doc, "dr.yaml").outlier
    assert outlier.split_local_origin and outlier.consecutive_local_origin == 10


def test_destination_rules_give_subsets_and_outlier_policy():
    rule = parse_destination_rule(yaml.safe_load(DESTINATION_RULE), "dr.yaml")
    assert rule.subset_of({"version": "green", "app": "model-server"}) == ["green"]
    assert rule.outlier == OutlierPolicy(
        consecutive_5xx=5, consecutive_gateway=0, interval_s=10.0, base_ejection_s=30.0, max_ejection_percent=50.0
    )


def test_a_subsets_own_outlier_detection_replaces_the_rules_as_a_whole():
    doc = yaml.safe_load(DESTINATION_RULE)
    doc["spec"]["subsets"][0]["trafficPolicy"] = {
        "outlierDetection": {"consecutive5xxErrors": 1},
        "connectionPool": {"tcp": {"maxConnections": 8}},
    }
    rule = parse_destination_rule(doc, "dr.yaml")
    assert rule.outlier_for("blue") == OutlierPolicy(consecutive_5xx=1)  # Istio's defaults, not the rule's 50%
    assert rule.outlier_for("green") == rule.outlier_for("") == rule.outlier
    del doc["spec"]["trafficPolicy"]
    rule = parse_destination_rule(doc, "dr.yaml")
    assert rule.outlier_for("blue") == OutlierPolicy(consecutive_5xx=1) and rule.outlier_for("green") is None


@pytest.mark.parametrize(
    "edit, complaint",
    [
        ({"consecutive5xxError": 1}, "unknown field(s) ['consecutive5xxError']; Istio's are"),
        ({"baseEjectionTme": "5m", "interval": "1s"}, "unknown field(s) ['baseEjectionTme']"),
        ({"failurePercentageThreshold": 50}, "not supported outside Kubernetes: 'failurePercentageThreshold'"),
        (
            {"outlierDetectionHttpErrorCodes": [503]},
            "not supported outside Kubernetes: 'outlierDetectionHttpErrorCodes'",
        ),
        ({"consecutiveErrors": 3}, "'consecutiveErrors' (deprecated by Istio; use consecutive5xxErrors"),
        ({"minHealthPercent": 101}, "field 'minHealthPercent' must be an integer 0..100, got 101"),
    ],
)
def test_outlier_detection_fields_are_istios_own_and_applied_or_refused_by_name(edit, complaint):
    for where in ("top", "subset"):
        doc = yaml.safe_load(DESTINATION_RULE)
        if where == "top":
            doc["spec"]["trafficPolicy"]["outlierDetection"].update(edit)
            at = "dr.yaml: spec.trafficPolicy.outlierDetection: "
        else:
            doc["spec"]["subsets"][1]["trafficPolicy"] = {"outlierDetection": edit}
            at = "dr.yaml: spec.subsets[1].trafficPolicy.outlierDetection: "
        with pytest.raises(PolicyError) as raised:
            parse_destination_rule(doc, "dr.yaml")
        assert str(raised.value).startswith(at) and complaint in str(raised.value)


def test_outlier_detection_per_port_is_refused():
    doc = yaml.safe_load(DESTINATION_RULE)
    doc["spec"]["trafficPolicy"]["portLevelSettings"] = [
        {"port": {"number": 8001}, "outlierDetection": {"consecutive5xxErrors": 1}}
    ]
    with pytest.raises(PolicyError, match=r"portLevelSettings\[0\]: outlierDetection per port is not supported"):
        parse_destination_rule(doc, "dr.yaml")


def test_below_min_health_percent_a_subset_panics_and_calls_go_to_every_host():
    hosts = ["h0", "h1", "h2", "h3"]

    def after_ejecting(count: int, min_health_percent: float) -> list[str]:
        od = detector(4, max_ejection_percent=100, consecutive_5xx=1, min_health_percent=min_health_percent)
        for host in hosts[:count]:
            od.record(host, "INTERNAL", now=0.0)
        assert len(od.ejected()) == count
        return od.routable(hosts, now=0.0)

    assert after_ejecting(2, 50) == ["h2", "h3"]  # 50% healthy is not below 50%
    assert after_ejecting(3, 50) == hosts  # 25%: panic, every host, ejected or not
    assert after_ejecting(4, 0) == []  # Istio's default 0 never panics: no healthy upstream
    # Envoy counts a subset as fully available from 100 / 1.4 = 71.4% healthy on: no panic there.
    assert after_ejecting(1, 80) == ["h1", "h2", "h3"]
    assert after_ejecting(2, 80) == hosts
    text = DESTINATION_RULE.replace("maxEjectionPercent: 50", "maxEjectionPercent: 50, minHealthPercent: 30")
    rule = parse_destination_rule(yaml.safe_load(text), "dr.yaml")
    assert rule.outlier.min_health_percent == 30.0


@pytest.mark.parametrize(
    "edit, complaint",
    [
        (("weight: 25", "weight: -1"), "field 'weight' must be an integer >= 0"),
        (("gateway-error", "gateway-errors"), "unknown condition(s) ['gateway-errors']"),
        (("perTryTimeout: 2s", "perTryTimeout: 2 seconds"), "is not a duration"),
        (("{exact: vip}", "{exakt: vip}"), "expected one of exact, prefix, regex"),
        (('{regex: "ml-.*"}', '{regex: "ml-(("}'), "regex 'ml-(('"),
    ],
)
def test_malformed_virtual_services_are_refused_by_field(edit, complaint):
    with pytest.raises(PolicyError) as raised:
        vs(VIRTUAL_SERVICE.replace(*edit))
    assert complaint in str(raised.value) and "vs.yaml: spec.http" in str(raised.value)


def test_every_subset_a_route_names_must_exist(tmp_path):
    (tmp_path / "vs.yaml").write_text(VIRTUAL_SERVICE)
    (tmp_path / "dr.yaml").write_text(DESTINATION_RULE.replace("  - {name: vip, labels: {pool: vip}}\n", ""))
    with pytest.raises(PolicyError, match="names subset 'vip' of model-server, which no DestinationRule defines"):
        load_policy_files(tmp_path / "vs.yaml", tmp_path / "dr.yaml")
    (tmp_path / "dr.yaml").write_text(DESTINATION_RULE)
    services, rules = load_policy_files(tmp_path / "vs.yaml", tmp_path / "dr.yaml")
    assert [s.name for s in services] == ["model-server"] and [r.name for r in rules] == ["model-server"]


@pytest.mark.parametrize(
    "text",
    [
        "just a string",
        "kind: VirtualService\nmetadata: {name: x}\nspec: {hosts: [a], http: [{match: [headers], route: []}]}",
        "kind: DestinationRule\nmetadata: {name: x}\nspec: {host: a, trafficPolicy: {outlierDetection: 5}}",
    ],
)
def test_any_malformed_shape_is_a_policy_error(tmp_path, text):
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(PolicyError):
        load_policy_files(tmp_path / "p.yaml")


def test_an_ejected_host_comes_back_even_when_nothing_is_recorded():
    od = detector(1, max_ejection_percent=100, base_ejection_s=1.0, interval_s=1.0)
    od.check(0.0)
    for _ in range(5):
        od.record("h0", "UNAVAILABLE", now=0.5)
    assert od.is_ejected("h0", now=1.0)
    assert not od.is_ejected("h0", now=2.0)  # the interval checks run on asking, not only on answers


def test_durations():
    assert parse_duration("250ms", "x") == 0.25 and parse_duration("10s", "x") == 10.0
    assert parse_duration("1.5s", "x") == 1.5 and parse_duration("2m", "x") == 120.0
    assert parse_duration("1m30s", "x") == 90.0 and parse_duration("500us", "x") == 0.0005  # Go's grammar, as Istio's
    with pytest.raises(PolicyError):
        parse_duration("10", "x")
    with pytest.raises(PolicyError):
        parse_duration("1m 30s", "x")
