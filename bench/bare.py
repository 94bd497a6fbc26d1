"""The bare grpc.aio server the benchmarks measure the mesh against: the Open
Inference Protocol's ModelInfer on a plain grpc.aio server (reflection so that
ghz finds it, no interceptor, no metrics), answering at once.

Model "refuse" is refused with RESOURCE_EXHAUSTED and a retry hint, as the
router sheds. Any other model is answered with no outputs, or with --echo
with each input returned as an output of the same datatype, shape and bytes
(OUTPUT0, OUTPUT1, ...): for `mlp` the very reply size of the real model.
With --forward ADDRESS it passes each call on to the server there and answers
with its reply: servers so chained are the floor under a mesh of as many
Python processes in series.

    python -m bench.bare [--echo | --forward ADDRESS]   # prints its port, serves until killed
"""

import argparse
import asyncio
import subprocess
import sys

REFUSE = "refuse"


def serve(echo: bool, forward: str | None) -> None:
    import grpc
    from inference import grpc_predict_v2_pb2 as pb
    from inference import grpc_predict_v2_pb2_grpc as pb_grpc

    from services.common import errors
    from services.common.serving import add_health_and_reflection

    class Bare(pb_grpc.GRPCInferenceServiceServicer):
        def __init__(self):
            self.next = pb_grpc.GRPCInferenceServiceStub(grpc.aio.insecure_channel(forward)) if forward else None

        async def ModelInfer(self, request, context):
            if self.next is not None:
                return await self.next.ModelInfer(request)
            if request.model_name == REFUSE:
                context.set_trailing_metadata(((errors.RETRY_AFTER_METADATA, "100"),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full; retry after about 100 ms")
            response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
            if echo:
                for i, tensor in enumerate(request.inputs):
                    response.outputs.add(name=f"OUTPUT{i}", datatype=tensor.datatype, shape=tensor.shape)
                response.raw_output_contents.extend(request.raw_input_contents)
            return response

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Bare(), server)
        add_health_and_reflection(server, [pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def start(root, echo: bool = False, forward: str | None = None) -> tuple[subprocess.Popen, str]:
    """The bare server as a child process, and its address."""
    options = ["--echo"] if echo else []
    if forward is not None:
        options = ["--forward", forward]
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.bare", *options], cwd=root, stdout=subprocess.PIPE, text=True
    )
    return process, f"127.0.0.1:{int(process.stdout.readline())}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--echo", action="store_true", help="answer each input as an output")
    parser.add_argument("--forward", metavar="ADDRESS", help="pass each call on to the server at ADDRESS")
    arguments = parser.parse_args()
    serve(arguments.echo, arguments.forward)
