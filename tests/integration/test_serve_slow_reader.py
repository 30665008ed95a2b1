"""A real `kaon serve` and a client that asks for a long stream and never reads it: once the
socket's buffers are full, the connection is dropped after --write-timeout and the generation
aborted (kaon_num_requests_running back to 0 and the request counted as aborted) well before
max_tokens, instead of the stream holding its connection forever."""
from __future__ import annotations

import json
import socket
import time

import pytest

from support.server import MODEL, Server, small_send_buffer_launcher

MAX_TOKENS = 1800


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Large events (n=8 choices with 5 alternatives each) fill the socket's buffers in a few dozen
    # steps: the server's send buffer is held at 16 KiB (8192, doubled by Linux), where the kernel's
    # autotuning lets it grow to net.ipv4.tcp_wmem's 4 MB (hundreds of steps: 61 s in CI, 2026-11-29);
    # the log-probability cap is raised to let them through.
    srv = Server(tmp_path_factory.mktemp("serve-slow-reader"), "--write-timeout", "1",
                 "--max-logprob-entries", "100000000", launcher=small_send_buffer_launcher(8192))
    yield srv
    srv.stop()


def aborted(server: Server) -> float:
    try:
        return server.metric('kaon_requests_total{finish_reason="abort"}')
    except KeyError:
        return 0.0


def test_a_stream_nobody_reads_is_dropped_and_its_generation_aborted(server):
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "stream": True, "ignore_eos": True,
                       "max_tokens": MAX_TOKENS, "n": 8, "logprobs": 5}).encode()
    before = aborted(server)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", server.port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 240
    while server.metric("kaon_num_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    while server.metric("kaon_num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric("kaon_num_requests_running") == 0, "the generation still runs"
    assert aborted(server) == before + 1, "it ran to max_tokens instead of being aborted"
    client.settimeout(5)
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        while client.recv(1 << 20):  # the server reset the connection: nothing more comes
            pass
        raise ConnectionResetError  # an orderly end is a drop too
    client.close()
