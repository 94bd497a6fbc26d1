"""Config helpers: every service has one frozen dataclass, filled from its
command line with environment variables as defaults, checked once in __main__."""

import argparse
import dataclasses
import json
import os
import pathlib
import typing


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, env_prefix: str) -> None:
    """Adds one --flag per field of `cls`; INFERMESH_<SERVICE>_<FIELD> sets its default."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        env = f"{env_prefix}{field.name.upper()}"
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{field.name} has no default, which its flag needs")
        if env in os.environ:
            default = _parse(kind, os.environ[env])
        flag = "--" + field.name.replace("_", "-")
        help_text = (field.metadata.get("help", "") + f" (env {env}, default {default!r})").strip()
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(
                flag, default=default, type=lambda s: tuple(x for x in s.split(",") if x), help=help_text
            )
        else:
            parser.add_argument(flag, default=default, type=kind, help=help_text)


def _parse(kind, raw: str):
    if kind is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    if typing.get_origin(kind) is tuple:
        return tuple(x for x in raw.split(",") if x)
    return kind(raw)


def from_arguments(cls, namespace: argparse.Namespace):
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def require(condition: bool, message: str) -> None:
    """Config check: raises ValueError with a message that prints the values."""
    if not condition:
        raise ValueError(message)


# Checked reading of JSON and YAML documents (model configs, golden probes,
# shard manifests, traffic policies): errors name the file, the field and the
# value, raised as the caller's own ValueError subclass.


def typed(value, key: str, kind, where: str, error: type[ValueError] = ValueError):
    """`value` if it is of `kind` (a type or a tuple of types; a bool is no number)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in kinds)
        raise error(f"{where}: field '{key}' must be {names}, got {value!r}")
    return value


def field(doc, key: str, kind, where: str, error: type[ValueError] = ValueError):
    """doc[key], which must be present and of `kind`."""
    if not isinstance(doc, dict) or key not in doc:
        raise error(f"{where}: missing field '{key}'")
    return typed(doc[key], key, kind, where, error)


def read_json_object(path: pathlib.Path, error: type[ValueError] = ValueError, missing: str = "missing") -> dict:
    """A JSON file that must hold an object; `missing` says what to do when it is absent."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: must hold a JSON object")
    return doc
