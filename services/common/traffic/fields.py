"""Checked reading of Istio resources: errors that name the file and field, durations."""

from __future__ import annotations

import re

from services.common.config import field


class PolicyError(ValueError):
    """A VirtualService or DestinationRule that cannot be applied; names file and field."""


DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
DURATION_PART = r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)"


def parse_duration(value, where: str) -> float:
    """Istio durations, Go's grammar: '10s', '250ms', '1.5s', '1m30s', '1h' -> seconds."""
    text = str(value).strip()
    if not re.fullmatch(f"(?:{DURATION_PART})+", text):
        raise PolicyError(f"{where}: {value!r} is not a duration such as '250ms', '10s' or '1m'")
    return sum(float(number) * DURATION_UNITS[unit] for number, unit in re.findall(DURATION_PART, text))


# ---------------------------------------------------------------- VirtualService


def require(doc, key: str, kind, where: str):
    return field(doc, key, kind, where, PolicyError)


def mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: expected a mapping, got {value!r}")
    return value


def sequence(value, where: str) -> list:
    if not isinstance(value, list):
        raise PolicyError(f"{where}: expected a list, got {value!r}")
    return value


def resource(doc, kind: str, where: str) -> tuple[str, dict]:
    """A Kubernetes resource of `kind`: its metadata.name and its spec."""
    mapping(doc, where)
    if doc.get("kind") != kind:
        raise PolicyError(f"{where}: kind is {doc.get('kind')!r}, expected {kind}")
    name = require(require(doc, "metadata", dict, where), "name", str, f"{where}: metadata")
    return name, require(doc, "spec", dict, where)
