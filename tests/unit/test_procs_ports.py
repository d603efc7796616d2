"""Port picking for child servers (loadgen.procs): outside the ephemeral range, never handed out twice."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from loadgen.procs import PortPicker, ephemeral_port_range, free_port


def test_picker_stays_in_range_and_never_repeats() -> None:
    picker = PortPicker(low=23000, high=23099, rng=random.Random(7))
    ports = [picker.pick() for _ in range(60)]
    assert len(set(ports)) == 60
    assert all(23000 <= p <= 23099 for p in ports)


def test_picker_skips_a_port_that_is_bound() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        picker = PortPicker(low=port, high=port, rng=random.Random(0))
        with pytest.raises(RuntimeError, match=f"no free TCP port in {port}-{port}"):
            picker.pick(tries=5)


def test_picker_raises_when_range_is_exhausted() -> None:
    # A one-port range on a port the OS just gave us (ephemeral: the xdist workers' fleets pick from
    # 20000-32767, so a fixed port there could be bound by a sibling test, as CI of stop 37 saw).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    picker = PortPicker(low=port, high=port, rng=random.Random(1))
    assert picker.pick() == port
    # free to bind, but handed out already: never twice
    with pytest.raises(RuntimeError, match=f"no free TCP port in {port}-{port}"):
        picker.pick(tries=20)


def test_ephemeral_range_is_read_from_proc_format(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ephemeral_port_range(f) == (32768, 60999)
    f.write_text("garbage")
    assert ephemeral_port_range(f) is None
    assert ephemeral_port_range(tmp_path / "missing") is None


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    span = ephemeral_port_range()
    port = free_port()
    if span is not None and span[0] > 11024:
        assert port < span[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
