"""The Grafana dashboard and the alert rules name only what the services export:
series, labels and label values read from the services' metrics modules and the
code that sets them (tools/monitoring.py). Each check is also shown to catch the
mistake it exists for."""

import copy
import json

import prometheus_client
import pytest
import yaml

from services.common import errors
from services.common.tier import Tier
from tools import monitoring


def _rules() -> dict:
    (doc,) = [d for d in yaml.safe_load_all(monitoring.RULES.read_text()) if d]
    return doc


def _alerts(doc: dict) -> list[dict]:
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


@pytest.mark.unit
def test_the_dashboard_queries_only_what_the_services_export():
    assert monitoring.dashboard_problems(json.loads(monitoring.DASHBOARD.read_text())) == []


@pytest.mark.unit
def test_the_alert_rules_name_only_what_the_services_export_and_each_has_a_runbook():
    doc = _rules()
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitoring.rule_problems(doc) == []
    selected = set().union(*(monitoring.series_of(rule["expr"]) for rule in _alerts(doc)))
    # What issue 32 asks the alerts to watch: errors, the breaker, queue refusals, p99, readiness, restarts.
    assert {
        "infermesh_router_requests_total",
        "infermesh_router_breaker_state",
        "infermesh_batcher_rejections_total",
        "infermesh_router_request_duration_seconds_bucket",
        "infermesh_model_versions",
        "kube_pod_container_status_restarts_total",
    } <= selected


@pytest.mark.unit
def test_series_names_are_the_ones_prometheus_client_exposes():
    """The suffixes the check gives each type (_total, _bucket, _sum, _count) are the client's own."""
    exposed = set(prometheus_client.REGISTRY._names_to_collectors)
    assert set(monitoring.exported()) <= exposed
    assert {
        "infermesh_router_requests_total",
        "infermesh_router_request_duration_seconds_bucket",
        "infermesh_router_request_duration_seconds_count",
        "infermesh_router_breaker_state",
        "infermesh_gc_pause_seconds_sum",
    } <= set(monitoring.exported())
    assert "infermesh_router_requests" not in monitoring.exported()


@pytest.mark.unit
def test_label_values_are_read_where_the_code_sets_them():
    values = monitoring.label_values()
    assert values["services.router.metrics.REQUESTS", "tier"].known == {tier.label for tier in Tier}
    assert values["services.router.metrics.REQUESTS", "code"].known == (
        {"OK"} | {cls.code_name for cls in errors.BY_CODE.values()}
    )
    # The reasons the metric's help text promises are the ones the batcher sets.
    reasons = values["services.batcher.metrics.REJECTIONS", "reason"]
    assert reasons.known == {"queue_full", "would_miss_deadline", "no_time_left", "deadline", "cancelled"}
    assert not reasons.unread
    assert values["services.model_server.metrics.VERSIONS", "state"].known == {"serving", "unready", "standby"}


def _set(alert: str, **fields):
    def change(doc):
        next(r for r in _alerts(doc) if r.get("alert") == alert).update(fields)

    return change


def _drop(alert: str, field: str):
    def change(doc):
        next(r for r in _alerts(doc) if r.get("alert") == alert).pop(field)

    return change


MISTAKES = {
    "a series no service exports": (
        _set("InfermeshBreakerOpen", expr="max by (namespace, model) (infermesh_router_breaker_open) > 0"),
        "infermesh-router/InfermeshBreakerOpen: infermesh_router_breaker_open is not a series our services export",
    ),
    "a counter without its _total": (
        _set("InfermeshErrorRatioHigh", expr="sum(rate(infermesh_router_requests[5m])) > 0"),
        "infermesh_router_requests is not a series our services export",
    ),
    "another exporter's series the check does not know": (
        _set("InfermeshServiceRestarting", expr="up == 0"),
        "up is not a series our services export (nor one of the other exporters' series",
    ),
    "a status code the router never sets": (
        _set(
            "InfermeshErrorRatioHigh",
            expr='sum(rate(infermesh_router_requests_total{code=~"INTERNAL|UNKNOWN"}[5m])) > 0',
        ),
        "code is never 'UNKNOWN'",
    ),
    "a tier that does not exist": (
        _set(
            "InfermeshLatencyP99OverObjective",
            expr=(
                'histogram_quantile(0.99, sum by (le) (rate(infermesh_router_request_duration_seconds_bucket{tier="gold"}'
                "[5m]))) > 0.5"
            ),
        ),
        "tier is never 'gold'; its values are ['standard', 'vip']",
    ),
    "a refusal reason the batcher never gives": (
        _set("InfermeshQueueRefusals", expr='sum(rate(infermesh_batcher_rejections_total{reason="too_busy"}[5m])) > 0'),
        "reason is never 'too_busy'",
    ),
    "a version state the model server never sets": (
        _set("InfermeshModelNotReady", expr='count(infermesh_model_versions{state="loaded"}) > 0'),
        "state is never 'loaded'; its values are ['serving', 'standby', 'unready']",
    ),
    "a value the check cannot find in the code": (
        _set("InfermeshBreakerOpen", expr='infermesh_router_breaker_state{model="minilm"} > 0'),
        "cannot tell whether model is ever 'minilm'",
    ),
    "a regex that is not an alternation of values": (
        _set("InfermeshErrorRatioHigh", expr='sum(rate(infermesh_router_requests_total{code=~"5.."}[5m])) > 0'),
        "a regex the check cannot read",
    ),
    "grouping by a label the series lacks": (
        _set("InfermeshErrorRatioHigh", expr="sum by (reason) (rate(infermesh_router_requests_total[5m])) > 0"),
        "groups or matches by 'reason', which no series under it has",
    ),
    "matching on a label the series lacks": (
        _set("InfermeshBreakerOpen", expr='infermesh_router_breaker_state{tier="vip"} > 0'),
        "infermesh_router_breaker_state has no label 'tier'",
    ),
    "rate() of a gauge": (
        _set("InfermeshBreakerOpen", expr="rate(infermesh_router_breaker_state[5m]) > 0"),
        "rate() of infermesh_router_breaker_state, a gauge",
    ),
    "an expression that does not parse": (
        _set("InfermeshBreakerOpen", expr="max by (model) (infermesh_router_breaker_state > 0"),
        "does not parse as PromQL",
    ),
    "a function PromQL does not have": (
        _set("InfermeshBreakerOpen", expr="maximum(infermesh_router_breaker_state) > 0"),
        "does not parse as PromQL: unknown function",
    ),
    "a container that is not ours": (
        _set(
            "InfermeshServiceRestarting",
            expr='increase(kube_pod_container_status_restarts_total{container=~"router|routr"}[15m]) > 2',
        ),
        "container is never 'routr'",
    ),
    "an alert without `for`": (_drop("InfermeshQueueRefusals", "for"), "InfermeshQueueRefusals: no `for`"),
    "an alert without a severity": (
        _set("InfermeshQueueRefusals", labels={"severity": "page"}),
        "severity 'page' is not one of",
    ),
    "an alert without a summary": (
        _set("InfermeshQueueRefusals", annotations={"description": "docs/alerts.md#alerts"}),
        "no summary annotation",
    ),
    "a description that names no runbook": (
        _set("InfermeshModelNotReady", annotations={"summary": "s", "description": "the model is not ready"}),
        "its description names no section of docs/",
    ),
    "a runbook section that does not exist": (
        _set("InfermeshModelNotReady", annotations={"summary": "s", "description": "docs/alerts.md#model-down"}),
        "docs/alerts.md has no section #model-down",
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_check_catches_its_mistake(mistake):
    doc = copy.deepcopy(_rules())
    break_it, expected = MISTAKES[mistake]
    break_it(doc)
    found = monitoring.rule_problems(doc)
    assert any(expected in p for p in found), "\n".join(found)


@pytest.mark.unit
def test_a_dashboard_panel_or_variable_on_what_no_service_exports_is_caught():
    dashboard = json.loads(monitoring.DASHBOARD.read_text())
    broken = copy.deepcopy(dashboard)
    broken["templating"]["list"][1]["query"]["query"] = "label_values(infermesh_router_requests_total, colour)"
    row = next(p for p in broken["panels"] if p.get("type") == "row")
    row["panels"] = [{"title": "collapsed", "targets": [{"expr": 'sum(infermesh_batcher_queue_length{tier="gold"})'}]}]
    found = monitoring.dashboard_problems(broken)
    assert "variable 'namespace': infermesh_router_requests_total has no label 'colour'" in found
    assert any(p.startswith("panel 'collapsed': ") and "tier is never 'gold'" in p for p in found), found


@pytest.mark.unit
def test_the_latency_panels_show_the_routers_exemplars():
    """Every query of the router's latency buckets asks Grafana for their exemplars
    (trace_id), and a query that does not is caught."""
    dashboard = json.loads(monitoring.DASHBOARD.read_text())
    targets = [
        target
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "infermesh_router_request_duration_seconds_bucket" in monitoring.series_of(target.get("expr", "up"))
    ]
    assert targets and all(target["exemplar"] is True for target in targets)
    targets[0].pop("exemplar")
    assert any('without "exemplar": true' in p for p in monitoring.dashboard_problems(dashboard))


def _datasources() -> list[dict]:
    return [yaml.safe_load(path.read_text()) for path in monitoring.DATASOURCES]


@pytest.mark.unit
def test_the_prometheus_data_source_links_trace_id_exemplars_to_jaeger():
    docs = _datasources()
    assert monitoring.datasource_problems(docs) == []
    by_uid = {d["uid"]: d for doc in docs for d in doc["datasources"]}
    (prometheus,) = [d for d in by_uid.values() if d["type"] == "prometheus"]
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id" == monitoring.EXEMPLARS["infermesh_router_request_duration_seconds_bucket"]
    assert by_uid[link["datasourceUid"]]["type"] == "jaeger"


def _link(**fields):
    def change(docs):
        for doc in docs:
            for datasource in doc["datasources"]:
                if datasource["type"] == "prometheus":
                    datasource["jsonData"]["exemplarTraceIdDestinations"][0].update(fields)

    return change


DATASOURCE_MISTAKES = {
    "an exemplar link by another label than the router's": (
        _link(name="traceID"),
        "no exemplarTraceIdDestinations entry for the label 'trace_id'",
    ),
    "an exemplar link to a data source that is not provisioned": (
        _link(datasourceUid="jaeger"),
        "names data source uid 'jaeger', which is not provisioned beside it",
    ),
    "an exemplar link to a data source that cannot open a trace": (
        _link(datasourceUid="infermesh-prometheus"),
        "a prometheus data source, which cannot open a trace",
    ),
    "a $ Grafana would expand from its environment": (
        _link(urlDisplayLabel="Trace ${__value.raw}"),
        "exemplarTraceIdDestinations[0].urlDisplayLabel: Grafana expands $NAME",
    ),
    "two data sources with one uid": (
        lambda docs: docs[0]["datasources"].append({**docs[0]["datasources"][0], "name": "again"}),
        "data source 'again': uid",
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("mistake", DATASOURCE_MISTAKES)
def test_each_data_source_check_catches_its_mistake(mistake):
    docs = copy.deepcopy(_datasources())
    break_it, expected = DATASOURCE_MISTAKES[mistake]
    break_it(docs)
    found = monitoring.datasource_problems(docs)
    assert any(expected in p for p in found), "\n".join(found)


@pytest.mark.unit
def test_an_escaped_dollar_is_left_alone():
    docs = copy.deepcopy(_datasources())
    _link(urlDisplayLabel="Trace $${__value.raw}")(docs)
    assert monitoring.datasource_problems(docs) == []
