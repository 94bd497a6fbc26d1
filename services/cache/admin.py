"""Cache administration: python -m services.cache.admin purge MODEL.

Finds the cache service of a `make run` mesh through var/run/mesh.json unless
--cache names it; the token comes from --token or INFERMESH_CACHE_ADMIN_TOKEN.
Over mutual TLS it presents --cert-file (by default, for a `make run TLS=1`
mesh, the admin-dev certificate of its folder) and verifies by --ca-file.
"""

import argparse
import json
import os
import pathlib
import sys

import grpc
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc

from services.common import tls

MESH_FILE = pathlib.Path("var/run/mesh.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["purge"])
    parser.add_argument("model")
    parser.add_argument("--cache", help="cache service host:port (default: from --run-file)")
    parser.add_argument("--run-file", type=pathlib.Path, default=MESH_FILE, help="written by 'make run'")
    parser.add_argument("--token", default=os.environ.get("INFERMESH_CACHE_ADMIN_TOKEN", ""))
    parser.add_argument("--ca-file", default="", help="CA that verifies the cache service (mutual TLS)")
    parser.add_argument("--cert-file", default="", help="client certificate to present (with --key-file)")
    parser.add_argument("--key-file", default="")
    args = parser.parse_args()
    address = args.cache
    if not address:
        if not args.run_file.exists():
            parser.error(f"--cache not given and {args.run_file} not found: is 'make run' running here?")
        run = json.loads(args.run_file.read_text())
        address = run["cache"]
    if not args.cache and not args.ca_file and run.get("tls_dir"):  # the run file's mesh is on mutual TLS
        folder = pathlib.Path(run["tls_dir"])
        args.ca_file, args.cert_file, args.key_file = (
            str(folder / n) for n in ("ca.pem", "admin-dev.pem", "admin-dev.key")
        )
    credentials = tls.channel_credentials(args.ca_file, args.cert_file, args.key_file) if args.ca_file else None
    with tls.channel(address, credentials) as channel:
        try:
            response = cache_pb2_grpc.CacheStub(channel).Purge(
                cache_pb2.PurgeRequest(model=args.model),
                metadata=(("authorization", f"Bearer {args.token}"),),
                timeout=10,
            )
        except grpc.RpcError as exc:
            print(f"purge failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"purged model {args.model}: generation {response.generation}, {response.l2_deleted} L2 entries dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
