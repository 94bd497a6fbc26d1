"""A closed-loop load generator for request sequences ghz cannot render cheaply
(a Zipf sequence over 10,000 texts): `concurrency` workers each send the next
pre-serialised ModelInfer request as soon as their previous one is answered."""

import asyncio
import itertools
import statistics
import time

import grpc

from tests.oip import text_request

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def serialise(texts: list[str], model: str = "minilm") -> list[bytes]:
    return [text_request([t], model=model).SerializeToString() for t in texts]


async def _drive(address: str, requests: list[bytes], concurrency: int, channels: int) -> dict:
    opened = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    calls = [c.unary_unary(METHOD) for c in opened]  # bytes in, bytes out: no client-side parsing
    pending = iter(enumerate(requests))
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def worker(call) -> None:
        for _, request in pending:
            started = time.perf_counter()
            try:
                await call(request, timeout=60)
                latencies.append(time.perf_counter() - started)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(call) for call, _ in zip(itertools.cycle(calls), range(concurrency))))
    elapsed = time.perf_counter() - started
    for channel in opened:
        await channel.close()
    latencies.sort()
    return {
        "rps": len(requests) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "errors": sum(errors.values()),
        "error_codes": errors,
    }


def run(address: str, requests: list[bytes], concurrency: int, channels: int = 4) -> dict:
    return asyncio.run(_drive(address, requests, concurrency, channels))
