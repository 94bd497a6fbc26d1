"""Each kind of fault of bench/chaos.py once, short, under mixed load: every
request sent is answered exactly once, and every checked answer is right."""

import pytest

from bench.chaos import FAULTS, MUST_BE_ZERO, Chaos, run_schedule
from bench.chaos_load import LoadConfig
from services.launcher.supervisor import RestartPolicy

pytestmark = pytest.mark.e2e


async def test_every_fault_of_the_schedule_leaves_every_request_answered_once(tmp_path):
    chaos = Chaos(tmp_path, RestartPolicy(base_delay_s=0.2), stop_s=2.0, delay_s=2.0, stall_s=1.0).start()
    try:
        result = await run_schedule(
            chaos, list(FAULTS), gap_s=4.0, warm_s=3.0, config=LoadConfig(callers=6), say=lambda line: None
        )
    finally:
        chaos.stop()
    totals = result["totals"]
    assert totals["sent"] > 0 and totals["checked"] > 0
    assert {key: totals[key] for key in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), result["faults"]
    # status_lost: on a stream that ended in error whose status the client library lost (grpc/grpc#36066).
    answered = (
        sum(totals["by_status"].values())
        + sum(totals["stream_failed"].values())
        + totals["unsent"]
        + totals["status_lost"]
    )
    assert answered == totals["sent"]
    assert [row["fault"] for row in result["faults"]] == list(FAULTS)
    for row in result["faults"]:  # each fault's stretch is accounted for on its own too
        assert row["sent"] > 0 and not any(row[key] for key in MUST_BE_ZERO), row
    # The supervisor brought back what the faults stopped (the kills and the drains).
    restarted = {message.split(" ", 1)[0] for _, message in result["events"] if " is back " in message}
    assert {"batcher", "model_server-0", "router", "cache", "redis", "model_server-1"} <= restarted, result["events"]
