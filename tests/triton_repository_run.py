"""Drives a model server's repository RPCs with tritonclient.grpc and prints what it saw as JSON.

A separate process because tritonclient's generated module and ours define
the same protobuf names. Usage: python tests/triton_repository_run.py ADDRESS ADMIN_KEY
"""

import json
import sys

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def main() -> int:
    client = grpcclient.InferenceServerClient(url=sys.argv[1])
    seen = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "index": client.get_model_repository_index(as_json=True).get("models", []),
    }
    admin = {"authorization": f"Bearer {sys.argv[2]}"}
    try:
        client.load_model("mlp")  # without the admin credential
    except InferenceServerException as exc:
        seen["anonymous_load"] = {"status": exc.status(), "message": exc.message()}
    client.load_model("mlp", config=json.dumps({"version_policy": {"specific": {"versions": [2]}}}), headers=admin)
    seen["ready_v2"] = client.is_model_ready("mlp", "2")
    seen["index_after_load"] = client.get_model_repository_index(as_json=True).get("models", [])
    try:
        client.load_model("mlp", config=json.dumps({"max_batch_size": -3}), headers=admin)
    except InferenceServerException as exc:
        seen["bad_load"] = {"status": exc.status(), "message": exc.message()}
    client.unload_model("mlp", headers=admin)
    seen["ready_after_unload"] = client.is_model_ready("mlp")
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
