"""Cache administration: python -m services.cache.admin purge MODEL.

Finds the cache service of a `make run` mesh through var/run/mesh.json unless
--cache names it; the token comes from --token or INFERMESH_CACHE_ADMIN_TOKEN.
"""

import argparse
import json
import os
import pathlib
import sys

import grpc
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc

MESH_FILE = pathlib.Path("var/run/mesh.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["purge"])
    parser.add_argument("model")
    parser.add_argument("--cache", help="cache service host:port (default: from --run-file)")
    parser.add_argument("--run-file", type=pathlib.Path, default=MESH_FILE, help="written by 'make run'")
    parser.add_argument("--token", default=os.environ.get("INFERMESH_CACHE_ADMIN_TOKEN", ""))
    args = parser.parse_args()
    address = args.cache
    if not address:
        if not args.run_file.exists():
            parser.error(f"--cache not given and {args.run_file} not found: is 'make run' running here?")
        address = json.loads(args.run_file.read_text())["cache"]
    with grpc.insecure_channel(address) as channel:
        try:
            response = cache_pb2_grpc.CacheStub(channel).Purge(
                cache_pb2.PurgeRequest(model=args.model), metadata=(("authorization", f"Bearer {args.token}"),),
                timeout=10)
        except grpc.RpcError as exc:
            print(f"purge failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"purged model {args.model}: generation {response.generation}, {response.l2_deleted} L2 entries dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
