"""A sample of the protocol fuzzer's requests (tools/fuzz_oip.py runs the full
counts): no crash, no hang, every refusal a named status naming the field."""

import pytest

from services.router.limits import RequestLimits
from tests.conftest import fuzz_examples
from tools import fuzz_oip


def clean(tally: fuzz_oip.Tally) -> None:
    summary = tally.summary()
    assert (summary["crashes"], summary["hangs"], summary["unnamed_refusals"]) == (0, 0, 0), summary["examples"]
    assert summary["accepted"] > 0 and summary["refused"] > 0, summary


@pytest.mark.unit
def test_generated_requests_through_decode_and_validation():
    count = fuzz_examples(400)
    tally = fuzz_oip.run_in_process(count, RequestLimits(), seed=7, trace_every=50)
    clean(tally)
    assert tally.requests == count


@pytest.mark.e2e
def test_generated_requests_through_a_running_router():
    with fuzz_oip.running_router() as (address, pid):
        tally = fuzz_oip.run_against(address, 150, seed=11, router_pid=pid)
    clean(tally)
    assert tally.requests == 150
