"""Apache's Java SDK example AsyncSimpleConsumerExample (receiveAsync in a loop, no bound, 30-second long polls),
done with the official Python SDK (its SimpleConsumer.receive_async), beside a second client that must be served.

The SDK runs in a virtual environment of its own (tests/sdkenv.py) and in subprocesses (tests/sdk/python_scenario.py);
the broker is a real `txmq broker start --rocketmq-port` process with its default bounds (limits.py).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import arun
from sdkenv import create_topics, python_scenario, python_sdk_python, start_rocketmq_broker
from wireclient import RawClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build the SDK environment

FLOOD = 1500  # receive_async calls at once
PER_CLIENT = 1024  # limits.LONG_POLLS_PER_CLIENT: the ones that wait


def counters(address: str) -> dict:
    async def go() -> dict:
        c = await RawClient.open(address)
        try:
            return (await c.ok("stats"))["counters"]
        finally:
            await c.close()

    return arun(go())


def test_python_sdk_receiving_without_bound_is_told_to_try_later_and_another_client_is_served(tmp_path):
    sdk_python = python_sdk_python()
    b, endpoint = start_rocketmq_broker(tmp_path / "broker")
    release = tmp_path / "release"
    excess = FLOOD - PER_CLIENT
    try:
        create_topics(b, "PySdkFlood", "PySdkOther")
        with ThreadPoolExecutor(1) as pool:
            flood = pool.submit(python_scenario, sdk_python, "flood", tmp_path / "home-flood", "--endpoint", endpoint,
                                "--topic", "PySdkFlood", "--group", "py-flood", "--count", str(FLOOD),
                                "--expect-refused", str(excess), "--await-duration", "30", "--until-file", str(release),
                                "--seconds", "120", "--deadline", "300", timeout=360)
            try:
                end = time.monotonic() + 180  # only says when to give up on a broken broker
                while counters(b.address).get("refused_rocketmq_busy", 0) < excess:
                    assert not flood.done(), flood.result()
                    assert time.monotonic() < end, f"the broker refused {counters(b.address)} of the flood"
                    time.sleep(0.2)
                # while the flood's 1,024 long polls wait: another process's producer (its route query, its sends)
                # and simple consumer are served
                sent = python_scenario(sdk_python, "send", tmp_path / "home-send", "--endpoint", endpoint, "--topic", "PySdkOther",
                                       "--count", "2", "--body", "other")
                got = python_scenario(sdk_python, "receive", tmp_path / "home-recv", "--endpoint", endpoint, "--topic", "PySdkOther",
                                      "--group", "py-other", "--expect", "2", "--await-duration", "3", "--settle", "0")
                in_flight = counters(b.address)
            finally:
                release.touch()
            r = flood.result()
    finally:
        b.stop()
    assert sorted(m["body"] for m in got["received"]) == sorted(x["body"] for x in sent["sent"])
    # the excess was answered at once with TOO_MANY_REQUESTS (the SDK's TooManyRequestsException), the rest waited
    assert r["outcomes"] == {"TooManyRequestsException": excess, "pending": PER_CLIENT}, r
    assert r["examples"]["TooManyRequestsException"].startswith("42900, polling full: "), r["examples"]
    assert in_flight["refused_rocketmq_busy"] == excess
    # logged: a line naming the peer and the reason, throttled (one per 10 s at most, with the count)
    log = b.log.read_text(errors="replace")
    refused = [ln for ln in log.splitlines() if "event=refused frontend=rocketmq kind=busy" in ln]
    assert refused and len(refused) <= 2 + r["answered_s"] / 10, refused
    assert "peer=ipv4:127.0.0.1:" in refused[0] and f"reason='polling full: {PER_CLIENT} long polls open for client " in refused[0]
