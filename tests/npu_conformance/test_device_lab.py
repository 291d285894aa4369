"""``DeviceLab.server`` hands a scenario a healthy server: one an earlier scenario left dead or
unhealthy (a vendor engine that died on a request, a server wedged by hostile input) is stopped
and started anew. Real processes and sockets: a tiny HTTP server whose ``/health`` answers the
status written in a file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from npu_conformance import vllm_server as vs
from npu_conformance.devices.base import DeviceLab

_HEALTH = r'''
import http.server, sys
status_file = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(int(open(status_file).read()))
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def _fake_server(tmp_path: Path, n: int) -> tuple[vs.Server, Path]:
    status = tmp_path / f"status-{n}"
    status.write_text("200")
    port = vs.free_port()
    proc = subprocess.Popen([sys.executable, "-c", _HEALTH, str(port), str(status)])
    srv = vs.Server(proc, f"http://127.0.0.1:{port}", "m", tmp_path / f"log-{n}")
    deadline = time.monotonic() + 30
    while not srv.healthy() and time.monotonic() < deadline:
        time.sleep(0.1)
    return srv, status


def test_healthy_reads_health_and_the_process(tmp_path):
    srv, status = _fake_server(tmp_path, 0)
    try:
        assert srv.healthy()
        status.write_text("503")
        assert srv.alive() and not srv.healthy()
    finally:
        srv.stop()
    assert not srv.alive() and not srv.healthy()


def test_the_lab_replaces_a_server_left_unhealthy_or_dead(tmp_path, monkeypatch):
    started: list[tuple[vs.Server, Path]] = []

    def start(self, artifact, args, log, **kw):
        started.append(_fake_server(tmp_path, len(started)))
        return started[-1][0]

    monkeypatch.setattr(DeviceLab, "start", start)
    lab = DeviceLab("mblt-sim", tmp_path)
    try:
        first = lab.server(Path("a"), ["--x"])
        assert lab.server(Path("a"), ["--x"]) is first and len(started) == 1
        started[0][1].write_text("503")          # its engine died: /health answers 503
        second = lab.server(Path("a"), ["--x"])
        assert second is not first and not first.alive() and len(started) == 2
        second.stop()                            # the process exited
        third = lab.server(Path("a"), ["--x"])
        assert third is not second and len(started) == 3 and third.healthy()
    finally:
        lab.close()
        for srv, _ in started:
            srv.stop()


def test_the_lab_keeps_its_pinned_server_and_the_most_recently_used_others(tmp_path, monkeypatch):
    started: list[tuple[vs.Server, Path]] = []

    def start(self, artifact, args, log, **kw):
        started.append(_fake_server(tmp_path, len(started)))
        return started[-1][0]

    monkeypatch.setattr(DeviceLab, "start", start)
    monkeypatch.setattr(DeviceLab, "keep_servers", 2)
    lab = DeviceLab("mblt-sim", tmp_path)
    try:
        pinned = lab.server(Path("std"), pin=True)
        a = lab.server(Path("a"))
        b = lab.server(Path("b"))
        assert lab.server(Path("a")) is a             # now the most recently used of the two
        c = lab.server(Path("c"))                     # a third unpinned one: b, the least recent, stops
        assert not b.alive() and a.alive() and c.alive() and pinned.alive()
        assert len(started) == 4 and sorted(map(id, lab.servers.values())) == sorted(map(id, (pinned, a, c)))
        assert lab.server(Path("std"), pin=True) is pinned   # never stopped to make room
        d = lab.server(Path("d"))
        assert not a.alive() and pinned.alive() and len(lab.servers) == 3
        assert lab.server(Path("b")) is not b and len(started) == 6  # b again: a new start (c made room)
        assert not c.alive() and d.alive()
    finally:
        lab.close()
        for srv, _ in started:
            srv.stop()
