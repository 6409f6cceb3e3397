"""The byte ledger: what each rank sent, per collective kind.

It is an observer attached to a :class:`~minizero.comm.base.Comm` from the
outside -- no stage contains a line of accounting.  With the ring backend it
counts the bytes of every ``isend``/``send`` that actually happened; with the
native backend, the bytes the ring algorithm would send for the same call.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager


class Ledger:
    def __init__(self):
        self.sent: Counter[str] = Counter()  # kind -> bytes
        self.messages: Counter[str] = Counter()  # kind -> number of sends
        self.by_link: Counter[tuple[str, str]] = Counter()  # (kind, "intra" / "inter") -> bytes, on a cluster of nodes
        self._lock = threading.Lock()  # the comm thread and the main thread may both report

    def __call__(self, kind: str, nbytes: int, link: str | None = None) -> None:
        with self._lock:
            self.sent[kind] += nbytes
            self.messages[kind] += 1
            if link is not None:
                self.by_link[kind, link] += nbytes

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def reset(self) -> None:
        with self._lock:
            self.sent.clear()
            self.messages.clear()
            self.by_link.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.sent)

    def links(self, kind: str | None = None) -> dict[str, int]:
        """Bytes per link class so far, of one collective ``kind`` or of all but the fingerprints' (``check``);
        empty on a flat network."""
        out: Counter[str] = Counter()
        with self._lock:
            for (k, link), nbytes in self.by_link.items():
                if k == kind or kind is None and k != "check":
                    out[link] += nbytes
        return dict(out)

    @contextmanager
    def attached(self, comm):
        """Count what ``comm`` sends inside the ``with`` block."""
        comm.add_observer(self)
        try:
            yield self
        finally:
            comm.remove_observer(self)
