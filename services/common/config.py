"""Config helpers: every service has one frozen dataclass, filled from its
command line with environment variables as defaults, checked once in __main__."""

import argparse
import dataclasses
import os
import typing


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, env_prefix: str) -> None:
    """Adds one --flag per field of `cls`; INFERMESH_<SERVICE>_<FIELD> sets its default."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        env = f"{env_prefix}{field.name.upper()}"
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if env in os.environ:
            default = _parse(kind, os.environ[env])
        flag = "--" + field.name.replace("_", "-")
        help_text = (field.metadata.get("help", "") + f" (env {env}, default {default!r})").strip()
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, default=default, type=lambda s: tuple(x for x in s.split(",") if x), help=help_text)
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
