"""meshctl tenants: the tenant registry's keys and settings.

    meshctl tenants init              # var/tenants.yaml with development tenants
    meshctl tenants add acme --tier vip --rate-per-s 200
    meshctl tenants list
    meshctl tenants hash              # a key read from stdin, as the registry stores it

A key is shown once, when it is made: the registry keeps only its SHA-256. A
running router reads the file again within a few seconds of a change.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from services.common import identity
from services.common.tier import BY_LABEL

DEFAULT_REGISTRY = pathlib.Path("var/tenants.yaml")


class TenantsError(Exception):
    """Refused: the message says why."""


def add_commands(commands) -> None:
    tenants = commands.add_parser("tenants", help="the tenant registry: init, add, list, hash")
    tenants.add_argument("--registry", type=pathlib.Path, default=DEFAULT_REGISTRY, help="the registry YAML")
    actions = tenants.add_subparsers(dest="action", required=True)
    init = actions.add_parser(
        "init", help="a registry with a VIP, a standard and an admin development tenant; prints their keys once"
    )
    init.add_argument("--if-missing", action="store_true", help="do nothing (and succeed) if the registry exists")
    add = actions.add_parser("add", help="a new tenant with a new key (printed once)")
    add.add_argument("name")
    add.add_argument("--tier", choices=list(BY_LABEL), default="standard")
    add.add_argument("--admin", action="store_true", help="may call the control RPCs")
    add.add_argument("--rate-per-s", type=float, help="rows a second through the router")
    add.add_argument("--burst", type=float, help="rows the rate's bucket holds")
    add.add_argument("--weight", type=float, help="its share against other tenants of its tier")
    add.add_argument("--certificate", action="append", default=[], help="a client certificate CN or SAN it owns")
    actions.add_parser("list", help="tenants, tiers and limits (never keys)")
    actions.add_parser("hash", help="the stored form of a key read from stdin")


def run(args) -> int:
    if args.action == "hash":
        key = sys.stdin.readline().strip()
        if not key:
            raise TenantsError("no key on stdin")
        print(identity.hash_key(key))
        return 0
    if args.action == "init":
        if args.registry.exists():
            if args.if_missing:
                print(f"tenant registry {args.registry} exists; kept")
                return 0
            raise TenantsError(f"{args.registry} exists: add tenants with 'tenants add', or remove it first")
        doc, keys = identity.development_registry()
        identity.write_registry(args.registry, doc)
        print(f"wrote the tenant registry {args.registry}; these keys are shown once (the file keeps their hashes):")
        for name, key in keys.items():
            body = doc["tenants"][name]
            print(
                f"  {name:<14} {body['tier']:<9}{' admin' if body.get('admin') else '':<7}authorization: Bearer {key}"
            )
        return 0
    doc = _load(args.registry)
    if args.action == "list":
        tenants = doc.get("tenants") or {}
        print(f"{'tenant':<20} {'tier':<9} {'admin':<6} {'keys':>4} {'rate/s':>8} {'burst':>8} {'weight':>6}")
        for name, body in tenants.items():
            body = body or {}
            print(
                f"{name:<20} {body.get('tier', 'standard'):<9} {'yes' if body.get('admin') else 'no':<6} "
                f"{len(body.get('keys') or []):>4} {body.get('rate_per_s', '-'):>8} {body.get('burst', '-'):>8} "
                f"{body.get('weight', 1):>6}"
            )
        print(f"anonymous callers: {doc.get('anonymous', 'standard')}")
        return 0
    # add
    tenants = doc.setdefault("tenants", {}) or {}
    doc["tenants"] = tenants
    if args.name in tenants:
        raise TenantsError(f"tenant {args.name!r} exists in {args.registry}")
    key = identity.new_key()
    body = {"tier": args.tier, "keys": [identity.hash_key(key)]}
    if args.admin:
        body["admin"] = True
    for field in ("rate_per_s", "burst", "weight"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    if args.certificate:
        body["certificates"] = args.certificate
    tenants[args.name] = body
    try:
        identity.write_registry(args.registry, doc, replace=True)
    except identity.RegistryError as exc:
        raise TenantsError(str(exc)) from None
    print(f"added tenant {args.name!r} ({args.tier}) to {args.registry}; its key, shown once:")
    print(f"  authorization: Bearer {key}")
    return 0


def _load(path: pathlib.Path) -> dict:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise TenantsError(f"{path} does not exist: 'tenants init' makes one") from None
    identity.Registry.from_document(doc, str(path))  # refuse to edit what the router would refuse
    return doc


def parse_and_run(argv: list[str]) -> int:
    """For tests and tools: `argv` after 'tenants'."""
    parser = argparse.ArgumentParser(prog="meshctl")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["tenants", *argv]))
