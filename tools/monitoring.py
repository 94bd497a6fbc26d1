"""Checks the Grafana dashboard's queries and the alert rules against what the
services export:  python -m tools.monitoring

Each PromQL expression is parsed (promql-parser, PromQL's grammar and function
table), then: every series it selects is one our services export (read from
their metrics modules) or one of the other exporters' series named in EXTERNAL;
every label it groups by, matches on or filters is one that series has; every
label value it matches is one the code emits, found where the code sets it (the
string literals at each metric's call sites, the dicts they index, the error
table's codes); rate() and increase() read counters only. A dashboard query
of a series whose samples carry exemplars shows them. Each alert has a `for`,
a severity, a summary and a description that names an existing section of
docs/. The Grafana data sources link each exemplar label to a tracing data
source that is provisioned beside them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import json
import pathlib
import re
import sys

import grpc
import prometheus_client
import promql_parser
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"
DASHBOARD = ROOT / "mesh" / "kubernetes" / "base" / "grafana" / "infermesh-dashboard.json"
DATASOURCES = tuple(sorted((ROOT / "mesh" / "kubernetes" / "base" / "grafana").glob("*-datasource.yaml")))
RULES = ROOT / "mesh" / "kubernetes" / "monitoring" / "infermesh-alerts.yaml"
MANIFESTS = ROOT / "mesh" / "kubernetes" / "base"
# Where metrics are declared: each service's metrics module, and the GC's.
METRICS_MODULES = (
    *tuple(sorted(f"services.{p.parent.name}.metrics" for p in SERVICES.glob("*/metrics.py"))),
    "services.common.collector",
)
# Added to every series when Prometheus scrapes a pod (the kubernetes-pods job);
# their values are the deployment's, not the code's.
SCRAPE_LABELS = frozenset({"namespace", "pod", "instance", "job", "container", "node"})
SEVERITIES = ("critical", "warning", "info")
COUNTER_FUNCTIONS = {"rate", "irate", "increase"}
# Series whose samples carry exemplars (OpenMetrics exposition only), and the
# label that names each one's trace: the router records an answer's duration
# with the id of that request's trace.
EXEMPLARS = {"infermesh_router_request_duration_seconds_bucket": "trace_id"}
TRACE_DATASOURCES = ("jaeger", "tempo", "zipkin")  # Grafana data source types that open a trace by id
PLAIN_ALTERNATION = re.compile(r"^[A-Za-z0-9_-]+(\|[A-Za-z0-9_-]+)*$")
DOC_SECTION = re.compile(r"\b(docs/[\w./-]+\.md)#([\w-]+)")


def _pod_templates() -> list[dict]:
    """The pod templates of the workloads in mesh/kubernetes/base (and in its patches)."""
    templates = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            template = (doc.get("spec") or {}).get("template") if isinstance(doc, dict) else None
            if isinstance(template, dict):
                templates.append(template)
    return templates


def _containers() -> frozenset[str]:
    return frozenset(
        c["name"] for t in _pod_templates() for c in (t.get("spec") or {}).get("containers") or [] if "name" in c
    )


def _pod_apps() -> frozenset[str]:
    return frozenset(((t.get("metadata") or {}).get("labels") or {}).get("app") for t in _pod_templates()) - {None}


# Series of other exporters that the dashboard and the rules read: their labels,
# and where the values of the labels they match on come from.
EXTERNAL: dict[str, tuple[frozenset[str], dict]] = {
    # Istio's sidecars (the standard metric labels).
    "istio_requests_total": (
        frozenset(
            {
                "reporter",
                "source_workload",
                "source_workload_namespace",
                "source_principal",
                "source_app",
                "source_version",
                "source_cluster",
                "source_canonical_service",
                "source_canonical_revision",
                "destination_workload",
                "destination_workload_namespace",
                "destination_principal",
                "destination_app",
                "destination_version",
                "destination_service",
                "destination_service_name",
                "destination_service_namespace",
                "destination_cluster",
                "destination_canonical_service",
                "destination_canonical_revision",
                "request_protocol",
                "response_code",
                "grpc_response_status",
                "response_flags",
                "connection_security_policy",
            }
        ),
        {
            "grpc_response_status": lambda: frozenset(str(code.value[0]) for code in grpc.StatusCode),
            "destination_app": _pod_apps,
        },
    ),
    # kube-state-metrics.
    "kube_pod_container_status_restarts_total": (
        frozenset({"namespace", "pod", "container", "uid"}),
        {"container": _containers},
    ),
}


@dataclasses.dataclass(frozen=True)
class Series:
    """One series name a service exports: its labels, its metric's type, and
    the module and variable that declare the metric."""

    labels: frozenset[str]
    type: str
    module: str
    variable: str


@functools.cache
def exported() -> dict[str, Series]:
    """Every series name our services export, by the suffixes Prometheus gives each type."""
    names: dict[str, Series] = {}
    for module in METRICS_MODULES:
        for variable, value in vars(importlib.import_module(module)).items():
            if not isinstance(value, prometheus_client.metrics.MetricWrapperBase):
                continue
            # prometheus_client keeps a metric's declared labels, name and type private.
            labels, base, kind = frozenset(value._labelnames), value._name, value._type  # noqa: SLF001
            suffixes = {
                "counter": {"_total": labels},
                "gauge": {"": labels},
                "info": {"_info": labels},
                "histogram": {"_bucket": labels | {"le"}, "_sum": labels, "_count": labels},
                "summary": {"_sum": labels, "_count": labels, "": labels | {"quantile"}},
            }[kind]
            for suffix, its_labels in suffixes.items():
                names[base + suffix] = Series(its_labels, kind, module, variable)
    return names


# ---------------------------------------------------------------- label values, from the code


@dataclasses.dataclass
class Values:
    """What the code may set a label to: `known` values, and where it sets values the check cannot read."""

    known: set[str] = dataclasses.field(default_factory=set)
    unread: list[str] = dataclasses.field(default_factory=list)


def _error_codes() -> set[str]:
    from services.common import errors

    return {cls.code_name for cls in errors.BY_CODE.values()} | {errors.InfermeshError.code_name}


class _Resolver:
    """The string values an expression of one source file can take: literals,
    conditional expressions of them, a module-level dict indexed, an error's
    `code_name`, and a local name through its assignments in the function."""

    def __init__(self, path: pathlib.Path, tree: ast.Module):
        self.path, self.tree = path, tree
        self.module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def function_of(self, node: ast.AST):
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return self.tree

    def assignments(self, name: str, at: ast.AST) -> list[ast.AST] | None:
        """The values assigned to `name` in the function around `at`; None for a parameter or a loop variable."""
        scope = self.function_of(at)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = scope.args
            if name in {a.arg for a in arguments.args + arguments.kwonlyargs + arguments.posonlyargs}:
                return None
        found = []
        for node in ast.walk(scope):
            if (
                isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            ) or (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name):
                found.append(node.value)
            elif isinstance(node, (ast.For, ast.comprehension, ast.With, ast.NamedExpr)):
                targets = [node.target] if not isinstance(node, ast.With) else [i.optional_vars for i in node.items]
                if any(isinstance(n, ast.Name) and n.id == name for t in targets if t for n in ast.walk(t)):
                    return None
        return found or None

    def values(self, node: ast.AST) -> set[str] | None:
        """The strings `node` may evaluate to; None where this cannot tell."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            body, orelse = self.values(node.body), self.values(node.orelse)
            return None if body is None or orelse is None else body | orelse
        if isinstance(node, ast.Attribute) and node.attr == "code_name":
            return _error_codes()
        if isinstance(node, ast.Attribute) and node.attr == "label":  # a Tier's (services/common/tier.py)
            from services.common.tier import Tier

            return {tier.label for tier in Tier}
        if isinstance(node, ast.Subscript):
            table = self.constant(node.value)
            if isinstance(table, dict) and all(isinstance(v, str) for v in table.values()):
                return set(table.values())
            return None
        if isinstance(node, ast.Name):
            assigned = self.assignments(node.id, node)
            if assigned is None:
                return None
            found: set[str] = set()
            for value in assigned:
                more = self.values(value)
                if more is None:
                    return None
                found |= more
            return found
        return None

    def constant(self, node: ast.AST):
        """A module-level object a Name or dotted Attribute names, by importing the file's module."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        value = importlib.import_module(self.module_name)
        for part in [node.id, *reversed(parts)]:
            value = getattr(value, part, None)
            if value is None:
                return None
        return value

    def positions(self, key: ast.AST) -> list[ast.AST] | None:
        """The label values of a Children key (`X_BY[a, b]`, `X_BY[labels]`) in order."""
        if isinstance(key, ast.Tuple):
            return list(key.elts)
        if isinstance(key, ast.Name):
            assigned = self.assignments(key.id, key)
            if assigned and len(assigned) == 1 and isinstance(assigned[0], ast.Tuple):
                return list(assigned[0].elts)
        return [key]


@functools.cache
def label_values() -> dict[tuple[str, str], Values]:
    """(module.variable of a metric, label) -> the values the services set it to."""
    from services.common.metrics import Children

    # service package -> variable -> (module.variable of the metric, its labels, whether a Children of it)
    by_package: dict[str, dict[str, tuple[str, list[str], bool]]] = {}
    for module in METRICS_MODULES:
        package = module.split(".")[1]
        names = by_package.setdefault(package, {})
        for variable, value in vars(importlib.import_module(module)).items():
            if isinstance(value, prometheus_client.metrics.MetricWrapperBase):
                names[variable] = (f"{module}.{variable}", list(value._labelnames), False)  # noqa: SLF001
            elif isinstance(value, Children):
                declared = next(v for v, m in vars(importlib.import_module(module)).items() if m is value.metric)
                names[variable] = (f"{module}.{declared}", list(value.metric._labelnames), True)  # noqa: SLF001
    found: dict[tuple[str, str], Values] = {}
    for path in sorted(SERVICES.rglob("*.py")):
        package = path.relative_to(SERVICES).parts[0]
        # A service's own metrics, and the shared ones, which every service uses.
        visible = {**by_package.get("common", {}), **by_package.get(package, {})}
        tree = ast.parse(path.read_text(), str(path))
        resolver = None
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "labels":
                target, children = node.func.value, False
                arguments = list(node.args)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                target, children, arguments = node.value, True, None
            else:
                continue
            name = (
                target.attr
                if isinstance(target, ast.Attribute)
                else target.id
                if isinstance(target, ast.Name)
                else None
            )
            if name not in visible or visible[name][2] != children:
                continue
            metric, labels, _ = visible[name]
            resolver = resolver or _Resolver(path, tree)
            if children:
                arguments = resolver.positions(node.slice)
            if arguments is None or any(isinstance(a, ast.Starred) for a in arguments):
                for label in labels:
                    found.setdefault((metric, label), Values()).unread.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                continue
            # Positional values name the first labels; the rest come by keyword.
            positional = list(zip(labels, arguments, strict=False))
            pairs = positional + [(k.arg, k.value) for k in getattr(node, "keywords", [])]
            for label, argument in pairs:
                values = found.setdefault((metric, label), Values())
                resolved = resolver.values(argument)
                if resolved is None:
                    values.unread.append(f"{path.relative_to(ROOT)}:{argument.lineno}")
                else:
                    values.known |= resolved
    return found


# ---------------------------------------------------------------- expressions


def _selectors(expr) -> list:
    found = []
    promql_parser.walk(
        expr, pre_visit=lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None
    )
    return found


def series_of(expr: str) -> set[str]:
    """The series names a PromQL expression selects."""
    return {s.name for s in _selectors(promql_parser.parse(expr)) if s.name}


def _labels_of(selector) -> frozenset[str] | None:
    name = selector.name
    if name in exported():
        return exported()[name].labels
    if name in EXTERNAL:
        return EXTERNAL[name][0]
    return None


def expression_problems(expr: str, where: str) -> list[str]:
    """What is wrong with one PromQL expression, each problem starting with `where`."""
    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        return [f"{where}: does not parse as PromQL: {exc}"]
    found = []
    for selector in _selectors(tree):
        name = selector.name
        labels = _labels_of(selector)
        if labels is None:
            found.append(
                f"{where}: {name} is not a series our services export"
                + (
                    ""
                    if name and name.startswith("infermesh_")
                    else " (nor one of the other exporters' series in tools/monitoring.py EXTERNAL)"
                )
            )
            continue
        for matcher in selector.matchers.matchers:
            if matcher.name == "__name__":
                continue
            if matcher.name not in labels | SCRAPE_LABELS:
                found.append(f"{where}: {name} has no label {matcher.name!r} (it has {sorted(labels)})")
                continue
            found += [f"{where}: {p}" for p in _value_problems(name, matcher)]
    found += [f"{where}: {p}" for p in _grouping_problems(tree)]
    found += [f"{where}: {p}" for p in _counter_problems(tree)]
    return found


def _value_problems(series: str, matcher) -> list[str]:
    """The value a matcher compares with is one the label takes (for a regex, each of its alternatives)."""
    sources = EXTERNAL[series][1] if series in EXTERNAL else {}
    if "$" in matcher.value or matcher.name == "le" or (matcher.name in SCRAPE_LABELS and matcher.name not in sources):
        return []  # a Grafana variable; or the deployment's
    regex = matcher.op in (promql_parser.MatchOp.Re, promql_parser.MatchOp.NotRe)
    if regex and not PLAIN_ALTERNATION.match(matcher.value):
        return [f"{series}{{{matcher}}}: a regex the check cannot read; match an alternation of values (a|b)"]
    wanted = matcher.value.split("|") if regex else [matcher.value]
    if series in EXTERNAL:
        source = sources.get(matcher.name)
        if source is None:
            return [f"{series}{{{matcher}}}: tools/monitoring.py EXTERNAL names no source of {matcher.name}'s values"]
        values = Values(set(source()))
    else:
        declared = exported()[series]
        values = label_values().get((f"{declared.module}.{declared.variable}", matcher.name), Values())
    problems = []
    for value in wanted:
        if value in values.known:
            continue
        if values.unread:
            problems.append(
                f"{series}{{{matcher}}}: cannot tell whether {matcher.name} is ever {value!r}: the code "
                f"sets it where the check cannot read it ({', '.join(values.unread[:3])})"
            )
        else:
            problems.append(
                f"{series}{{{matcher}}}: {matcher.name} is never {value!r}; its values are {sorted(values.known)}"
            )
    return problems


def _grouping_problems(tree) -> list[str]:
    """Each label an aggregation groups by, or a binary operation matches on, is a label of a series under it."""
    found = []

    def visit(node):
        modifier_labels = []
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            modifier_labels = list(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                modifier_labels += list(node.modifier.matching.labels)
            modifier_labels += list(node.modifier.group_labels or [])
        known = [_labels_of(s) for s in _selectors(node)]
        if modifier_labels and None not in known:  # an unknown series is reported already, its labels unknown
            under = set(SCRAPE_LABELS).union(*known)
            for label in modifier_labels:
                if label not in under:
                    found.append(
                        f"groups or matches by {label!r}, which no series under it has "
                        f"({', '.join(sorted({s.name for s in _selectors(node)}))})"
                    )

    promql_parser.walk(tree, pre_visit=visit)
    return found


def _counter_problems(tree) -> list[str]:
    found = []

    def visit(node):
        if isinstance(node, promql_parser.Call) and node.func.name in COUNTER_FUNCTIONS:
            for selector in _selectors(node):
                series = exported().get(selector.name)
                if series is not None and series.type == "gauge":
                    found.append(f"{node.func.name}() of {selector.name}, a gauge (it reads counters only)")

    promql_parser.walk(tree, pre_visit=visit)
    return found


# ---------------------------------------------------------------- the dashboard and the rules


def dashboard_problems(dashboard: dict) -> list[str]:
    """Every panel's queries and every template variable's, checked as above."""
    found = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop(0)
        panels += panel.get("panels", [])  # a collapsed row holds its panels
        for target in panel.get("targets", []):
            if target.get("expr"):
                found += expression_problems(target["expr"], f"panel {panel.get('title')!r}")
                try:
                    with_exemplars = sorted(series_of(target["expr"]) & EXEMPLARS.keys())
                except ValueError:
                    continue  # reported above
                if with_exemplars and target.get("exemplar") is not True:
                    found.append(
                        f"panel {panel.get('title')!r}: reads {', '.join(with_exemplars)}, whose samples carry "
                        'trace exemplars, without "exemplar": true: the panel would not link to the traces'
                    )
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else ""
        values_of = re.match(r"^\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*$", query)
        if values_of:
            where = f"variable {variable.get('name')!r}"
            found += expression_problems(values_of.group(1), where)
            try:
                selectors = _selectors(promql_parser.parse(values_of.group(1)))
            except ValueError:
                continue
            for selector in selectors:
                labels = _labels_of(selector)
                if labels is not None and values_of.group(2) not in labels | SCRAPE_LABELS:
                    found.append(f"{where}: {selector.name} has no label {values_of.group(2)!r}")
    return found


def datasource_problems(provisioning: list[dict]) -> list[str]:
    """Grafana data source provisioning documents (apiVersion 1), read together as
    Grafana reads a folder of them: every Prometheus data source links each label of
    EXEMPLARS to a tracing data source, by the uid of one provisioned among them;
    uids are unique; no value has a `$` Grafana would expand from its own environment."""
    found = []
    datasources = []
    for doc in provisioning:
        if doc.get("apiVersion") != 1:
            found.append(f"provisioning apiVersion {doc.get('apiVersion')!r} is not 1")
        datasources += doc.get("datasources") or []
        found += [f"{p}: Grafana expands $NAME from its environment; write $$ for a $" for p in _dollars(doc, "")]
    by_uid: dict[str, dict] = {}
    for datasource in datasources:
        where = f"data source {datasource.get('name')!r}"
        for field in ("name", "uid", "type", "url"):
            if not datasource.get(field):
                found.append(f"{where}: no {field}")
        if datasource.get("uid") in by_uid:
            found.append(f"{where}: uid {datasource['uid']!r} is also {by_uid[datasource['uid']].get('name')!r}'s")
        by_uid.setdefault(datasource.get("uid"), datasource)
    for datasource in (d for d in datasources if d.get("type") == "prometheus"):
        where = f"data source {datasource.get('name')!r}"
        destinations = (datasource.get("jsonData") or {}).get("exemplarTraceIdDestinations") or []
        linked = {d.get("name") for d in destinations}
        for label in sorted(set(EXEMPLARS.values()) - linked):
            found.append(
                f"{where}: no exemplarTraceIdDestinations entry for the label {label!r} that "
                f"{', '.join(s for s, name in EXEMPLARS.items() if name == label)} exemplars carry (it links {sorted(linked)})"
            )
        for destination in destinations:
            uid = destination.get("datasourceUid")
            if uid is None:
                if not destination.get("url"):
                    found.append(
                        f"{where}: exemplar link {destination.get('name')!r} has neither datasourceUid nor url"
                    )
            elif uid not in by_uid:
                found.append(
                    f"{where}: exemplar link {destination.get('name')!r} names data source uid {uid!r}, which is "
                    f"not provisioned beside it ({sorted(u for u in by_uid if u)})"
                )
            elif by_uid[uid].get("type") not in TRACE_DATASOURCES:
                found.append(
                    f"{where}: exemplar link {destination.get('name')!r} goes to {by_uid[uid].get('name')!r}, "
                    f"a {by_uid[uid].get('type')} data source, which cannot open a trace"
                )
    return found


def _dollars(value, where: str) -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _dollars(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _dollars(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and "$" in value.replace("$$", "") else []


@functools.cache
def _anchors(doc: pathlib.Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors, fenced = set(), False
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).lower())
            anchors.add(text.replace(" ", "-"))
    return frozenset(anchors)


def rule_problems(rule_doc: dict) -> list[str]:
    """What is wrong with a PrometheusRule's alerts."""
    found = []
    for group in (rule_doc.get("spec") or {}).get("groups") or []:
        for rule in group.get("rules") or []:
            name = rule.get("alert") or rule.get("record")
            where = f"{group.get('name')}/{name}"
            found += expression_problems(str(rule.get("expr", "")), where)
            if "record" in rule:
                continue
            if "for" not in rule:
                found.append(f"{where}: no `for` (one evaluation's blip would fire it)")
            severity = (rule.get("labels") or {}).get("severity")
            if severity not in SEVERITIES:
                found.append(f"{where}: severity {severity!r} is not one of {SEVERITIES}")
            annotations = rule.get("annotations") or {}
            for needed in ("summary", "description"):
                if not annotations.get(needed):
                    found.append(f"{where}: no {needed} annotation")
            sections = DOC_SECTION.findall(annotations.get("description", ""))
            if not sections:
                found.append(f"{where}: its description names no section of docs/ (docs/x.md#section) to act on")
            for doc, anchor in sections:
                if not (ROOT / doc).is_file():
                    found.append(f"{where}: its description names {doc}, which does not exist")
                elif anchor not in _anchors(ROOT / doc):
                    found.append(f"{where}: {doc} has no section #{anchor}")
    return found


def main() -> int:
    found = [f"{DASHBOARD.name}: {p}" for p in dashboard_problems(json.loads(DASHBOARD.read_text()))]
    found += [
        f"{DASHBOARD.parent.name}/*-datasource.yaml: {p}"
        for p in datasource_problems([yaml.safe_load(path.read_text()) for path in DATASOURCES])
    ]
    for doc in yaml.safe_load_all(RULES.read_text()):
        if doc and doc.get("kind") == "PrometheusRule":
            found += [f"{RULES.name}: {p}" for p in rule_problems(doc)]
    for problem in found:
        print(f"  - {problem}")
    print(
        f"{len(found)} problem(s)"
        if found
        else "the dashboard and the alerts name what the services export; the data sources link their exemplars"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
