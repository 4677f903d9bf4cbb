"""chunkserve.launch's ports: distinct within a call and across calls, and a start that lost a
port to another process is retried on new ones (a CI run once failed when the HTTP front and
/metrics were handed the same port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkserve import launch


def test_free_ports_are_distinct_within_and_across_calls():
    first = launch.free_ports(40)
    assert len(set(first)) == 40
    again = launch.free_ports(40) + [launch.free_port() for _ in range(10)]
    assert len(set(again)) == 50 and not set(first) & set(again)


def test_free_ports_skips_a_port_the_kernel_offers_twice(monkeypatch):
    """What happened in CI: closed and asked for again, the same port came back."""
    offered = iter([41001, 41001, 41002, 41001, 41003])

    class FakeSocket:
        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(launch.socket, "socket", FakeSocket)
    monkeypatch.setattr(launch, "_HANDED_OUT", set())
    assert launch.free_ports(2) == [41001, 41002]
    assert launch.free_ports(1) == [41003]


def _starts(monkeypatch, outcomes):
    calls = []

    def start_once(tmp_dir, executor_args, scheduler_args, timeout):
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(launch, "_start_once", start_once)
    return calls


def test_a_start_that_lost_a_port_is_retried_on_new_ones(monkeypatch, tmp_path: Path):
    calls = _starts(monkeypatch, [launch.PortTaken("taken"), launch.PortTaken("taken"), "server"])
    assert launch.start_server(tmp_path, [], []) == "server" and len(calls) == 3


def test_a_third_lost_port_and_any_other_failure_are_raised(monkeypatch, tmp_path: Path):
    calls = _starts(monkeypatch, [launch.PortTaken("a"), launch.PortTaken("b"), launch.PortTaken("c"), "late"])
    with pytest.raises(launch.PortTaken, match="c"):
        launch.start_server(tmp_path, [], [])
    assert len(calls) == 3
    calls = _starts(monkeypatch, [RuntimeError("bad model"), "never"])
    with pytest.raises(RuntimeError, match="bad model"):
        launch.start_server(tmp_path, [], [])
    assert len(calls) == 1


@pytest.mark.slow  # two real server starts, ~20 s
def test_a_real_start_whose_metrics_port_was_taken_comes_up_on_new_ports(monkeypatch, tiny_model_path, tmp_path):
    """The CI failure, forced: the first ports handed out include one another process listens
    on (as /metrics binds, 0.0.0.0); the scheduler exits naming it, and the retry serves."""
    import socket

    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    real = launch.free_ports
    handed = []

    def ports(n):
        got = real(n)
        if not handed:
            got[2] = busy.getsockname()[1]  # start_server's metrics port
        handed.append(got)
        return got

    monkeypatch.setattr(launch, "free_ports", ports)
    try:
        server = launch.start_server(tmp_path, ["--model", str(tiny_model_path)], [])
        try:
            assert len(handed) == 2 and server.metrics_port == handed[1][2] != handed[0][2]
            assert server.info().num_device_blocks > 0
        finally:
            server.stop()
    finally:
        busy.close()
