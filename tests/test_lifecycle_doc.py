"""docs/architecture.md's request-lifecycle section names every place the
services refuse a request: each function that raises a domain error, with its
file, and each reason the refusal metrics count."""

import ast
import pathlib
import re

import pytest

from tools import monitoring

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"
# Not on a request's way: loading shard sets, the operator's CLI, the launcher, the domain errors themselves
# (the model build is outside services/, in tools/build_models).
ELSEWHERE = ("model_server/shards.py", "meshctl/", "launcher/", "common/errors.py")
ERRORS = {
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "ResourceExhausted",
    "FailedPrecondition",
    "Internal",
    "Unavailable",
    "PermissionDenied",
    "Unauthenticated",
    "Cancelled",
    "Unimplemented",
}


def _section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.search(r"^## Request lifecycle\n(.*?)^## ", text, re.S | re.M).group(1)


def refusals() -> set[tuple[str, str]]:
    """(file under services/, Class.method or function) of every domain error built
    outside ELSEWHERE; a nested function counts as the method around it."""
    found = set()
    for path in sorted(SERVICES.rglob("*.py")):
        relative = str(path.relative_to(SERVICES))
        if any(relative.startswith(prefix) for prefix in ELSEWHERE):
            continue
        tree = ast.parse(path.read_text())

        def visit(node, cls, function, relative=relative):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Call) and function is not None:
                    func = child.func
                    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                    if called in ERRORS:
                        found.add((relative, f"{cls}.{function}" if cls else function))
                if isinstance(child, ast.ClassDef) and cls is None and function is None:
                    visit(child, child.name, None)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and function is None:
                    visit(child, cls, child.name)
                else:
                    visit(child, cls, function)

        visit(tree, None, None)
    return found


@pytest.mark.unit
def test_the_lifecycle_names_every_function_that_refuses_a_request():
    lines = _section().splitlines()
    missing = []
    for relative, function in sorted(refusals()):
        name = function.rsplit(".", 1)[-1]
        if not any(
            relative in line and re.search(rf"(?<![\w.]){re.escape(function)}\b|`{re.escape(name)}`", line)
            for line in _paragraphs(lines)
        ):
            missing.append(f"{relative}: {function}")
    assert not missing, "refusals the request lifecycle does not name:\n" + "\n".join(missing)


def _paragraphs(lines: list[str]) -> list[str]:
    """Table rows one by one; the prose after them joined per paragraph."""
    out, prose = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            out.append(line)
        elif line.strip():
            prose.append(line)
        elif prose:
            out.append(" ".join(prose))
            prose = []
    return out


@pytest.mark.unit
def test_the_lifecycle_names_every_refusal_reason_the_metrics_count():
    section = _section()
    values = monitoring.label_values()
    for metric in ("services.batcher.metrics.REJECTIONS", "services.router.metrics.AUTH_REFUSALS"):
        reasons = values[metric, "reason"]
        assert reasons.known and not reasons.unread
        assert {r for r in reasons.known if f'"{r}"' not in section and f"`{r}`" not in section} == set()


@pytest.mark.unit
def test_the_check_sees_the_refusals_it_is_about():
    """The walk finds the refusals it must (so the test above cannot pass on an empty list)."""
    found = refusals()
    assert ("batcher/admission.py", "Admission.admit") in found
    assert ("router/limits.py", "too_many") in found
    assert ("batcher/server.py", "BatcherServicer._answer") in found  # a nested handler counts as its method
    assert len(found) > 60
