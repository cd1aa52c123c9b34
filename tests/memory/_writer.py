"""The durability test's writer (a child process): appends exchanges to one session through the real
store code and acknowledges each one on a pipe only after ``append`` returned (the commit is done)."""

from __future__ import annotations

from multiprocessing.connection import Connection


def write_forever(url: str, session_pk: int, ack: Connection, start: int) -> None:
    from memory.store import MemoryStore, open_engine

    store = MemoryStore(open_engine(url))  # each life opens (and migrates) the database like a gateway does
    ack.send_bytes(b"ready")
    i = start
    while True:
        got = store.append(session_pk, [("user", f"question {i}", 3, True), ("assistant", f"answer {i} " * 20, 40,
                                                                                     True)], f"req-{i}")
        ack.send_bytes(f"{got[0].seq}:{i}".encode())
        i += 1
