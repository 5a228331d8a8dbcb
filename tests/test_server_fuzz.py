"""Fuzz: 10,000+ malformed, truncated, oversized and wrongly typed frames and params.

Each frame gets an error with a stable code, or (truncated / oversized) its
connection is closed; a well-behaved client is served between every batch, and
the memory traced in the process (the daemon runs in-process) stays flat.
"""

from __future__ import annotations

import gc
import random
import socket
import struct
import time
import tracemalloc

import msgpack

from codespec.daemon.client import Client
from codespec.daemon.service.protocol import ERROR_CODES, MAX_FRAME_BYTES, pack, unpack_body

JUNK = [None, True, -1, 2**70 // 2**7, 1.5, "", "x" * 300, b"\x00\xff", [], [1, "a"], {}, {"a": 1}]
METHODS = ["open", "change", "close", "complete", "edit", "generate", "cancel", "workspace"]
KEYS = ["uri", "text", "version", "changes", "position", "range", "max_tokens", "temperature",
        "top_p", "seed", "stop", "stream", "speculation", "prompt", "prompt_ids", "id",
        "folders", "multiline", "prediction", "instruction"]  # fmt: skip


def bad_body(rng: random.Random) -> tuple[bytes, bool]:
    """A frame body and whether the reply must be ``bad_frame`` (else any error code)."""
    kind = rng.randrange(7)
    if kind == 0:  # random bytes (not one msgpack map, or trailing data)
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) + b"\xc1", True
    if kind == 1:  # valid msgpack, not a map
        return msgpack.packb(rng.choice([1, "s", [1, 2], None, 3.5, b"b"])), True
    if kind == 2:  # a map without a usable id / method
        frame = {"id": rng.choice(JUNK[:2] + JUNK[4:]), "method": "hello"}
        if rng.random() < 0.5:
            frame = {"id": rng.randrange(1000), "method": rng.choice(JUNK[:5] + JUNK[7:])}
        return msgpack.packb(frame, use_bin_type=True), True
    if kind == 3:  # unknown method
        return msgpack.packb({"id": 1, "method": f"m{rng.randrange(10**6)}"}), False
    if kind == 4:  # params not a map
        return msgpack.packb({"id": 1, "method": "open", "params": rng.choice(JUNK[1:9])}), False
    if kind == 5:  # the empty frame
        return b"", True
    # kind 6: a real method with wrongly typed params (at least one required one broken)
    method = rng.choice(METHODS)
    params = {k: rng.choice(JUNK) for k in rng.sample(KEYS, rng.randrange(1, 6))}
    if method == "cancel":
        params["id"] = rng.choice(["x", 1.5, None, [], {}])
    if method == "workspace":
        params["folders"] = rng.choice([1, "x", [1], {"a": 1}])
    if method in ("open", "close", "change", "complete", "edit"):
        params["uri"] = rng.choice([None, 3, [], {}, b"x"])
    if method == "generate":
        params["prompt_ids"] = rng.choice([[-1], ["a"], 5, [2**40]])
    return msgpack.packb({"id": 7, "method": method, "params": params}, use_bin_type=True), False


def recv_frame(sock: socket.socket) -> dict | None:
    def exact(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exact(4)
    if head is None:
        return None
    body = exact(struct.unpack(">I", head)[0])
    return None if body is None else unpack_body(body)


def well_behaved(path: str, n: int) -> None:
    with Client(path) as c:
        uri = f"file:///good{n}.py"
        c.request("open", {"uri": uri, "text": "def add(a, b):\n    return a + b\n"})
        r = c.request("complete", {"uri": uri, "position": {"line": 1, "character": 11},
                                   "max_tokens": 2})  # fmt: skip
        assert isinstance(r["text"], str) and r["stats"]["tokens"] <= 2
        c.request("close", {"uri": uri})


def test_fuzz_frames(daemon):
    rng = random.Random(1234)
    path = daemon.socket_path
    sent = 0
    tracemalloc.start()
    baseline = None
    try:
        batch = 0
        while sent < 10_400:  # a daemon that stops answering fails a 10 s receive
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(path)
            bodies = [bad_body(rng) for _ in range(200)]
            sock.sendall(b"".join(struct.pack(">I", len(b)) + b for b, _ in bodies))
            for _, must_be_bad_frame in bodies:
                frame = recv_frame(sock)
                assert frame is not None, "the daemon closed a connection on a resyncable frame"
                code = frame["error"]["code"]
                assert code in ERROR_CODES
                if must_be_bad_frame:
                    assert code == "bad_frame"
            sent += len(bodies)
            # An oversized or truncated frame ends the connection.
            if batch % 2 == 0:
                sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1 + rng.randrange(10**6)))
                frame = recv_frame(sock)
                assert frame is not None and frame["error"]["code"] == "bad_frame"
                assert recv_frame(sock) is None  # closed
            else:
                good = pack({"id": 1, "method": "hello"})
                sock.sendall(good[: rng.randrange(1, len(good))])
            sent += 1
            sock.close()
            batch += 1
            if batch % 10 == 0:
                well_behaved(path, batch)
            if batch == 5:
                gc.collect()
                baseline = tracemalloc.get_traced_memory()[0]
        deadline = time.monotonic() + 10  # the daemon has let go of every fuzzing connection
        while daemon.server.connection_count:
            assert time.monotonic() < deadline, "the daemon kept a closed connection"
            time.sleep(0.01)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - (baseline or 0)
    finally:
        tracemalloc.stop()
    assert sent >= 10_000
    assert grown < 2_000_000, f"traced memory grew by {grown} bytes during the fuzz"
    well_behaved(path, -1)
    assert daemon.server.scheduler.idle
