"""A collective's latency, counted from its messages: the rounds on its critical path.

Bytes say what a collective costs in bandwidth; its latency is how many messages stand one after another
between the first send and the last receive -- each pays the network's ``alpha`` before its bytes flow.  The
ring all-reduce has ``2(N-1)`` of them, a binomial tree ``2 ceil(log2 N)``; a chain (rank to rank, N-1 hops up
and N-1 down) sends as few bytes per rank as the tree and has the ring's latency.  Only the order of the
messages tells them apart, so that is what is recorded.

:func:`recorded` watches every point-to-point call a rank makes inside one kind of collective (``dist.send``,
``recv``, ``isend``, ``irecv``: whatever helper the learner's code calls, it comes down to these), in program
order.  :func:`critical_path` then replays every rank's list in the alpha-beta model's **one-port, full-duplex**
rule: per round a rank sends at most one message and receives at most one (a ring step does both at once); a
message is received no earlier than the round it left in; a blocking ``send`` or ``recv`` finishes before the
rank's next message leaves, an ``isend`` does not hold the rank back.  Sends are buffered: a sender never waits
for its receiver.  The last round any rank sends or receives in is the critical path.
"""
from __future__ import annotations

from collections import defaultdict, deque
from contextlib import contextmanager

import torch.distributed as dist

CALLS = ("send", "isend", "recv", "irecv")
SENDS = ("send", "isend")


@contextmanager
def recorded(comm, kind: str):
    """Yields a list that fills with ``(call, peer, nbytes)`` -- ``call`` one of ``send``, ``isend``, ``recv``,
    ``irecv``, ``peer`` a global rank -- for each point-to-point call ``comm`` makes while it runs a collective of
    ``kind`` (not the fingerprint exchange before it).  Messages of no bytes are not messages: they are left out."""
    events: list[tuple[str, int, int]] = []
    originals = {name: getattr(dist, name) for name in CALLS}

    def watched(name):
        original = originals[name]

        def call(tensor, peer=None, *args, **kwargs):
            if getattr(comm._local, "kind", None) == kind and tensor.numel():
                where = peer if peer is not None else kwargs.get("dst", kwargs.get("src"))
                events.append((name, where, tensor.numel() * tensor.element_size()))
            return original(tensor, peer, *args, **kwargs)

        return call

    for name in CALLS:
        setattr(dist, name, watched(name))
    try:
        yield events
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def critical_path(events: list[list[tuple[str, int, int]]]) -> int | None:
    """The rounds on the critical path of every rank's ``events`` (``events[r]``: rank r's, in program order) under
    the one-port, full-duplex rule; None if some receive has no matching send (the k-th receive at b from a
    matches the k-th send from a to b)."""
    n = len(events)
    sent, received, ready, at = [0] * n, [0] * n, [0] * n, [0] * n  # last round of each port; of the last wait
    in_flight: dict[tuple[int, int], deque] = defaultdict(deque)  # (from, to) -> rounds their messages left in
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while at[r] < len(events[r]):
                call, peer, _ = events[r][at[r]]
                if call in SENDS:
                    sent[r] = max(sent[r], ready[r]) + 1
                    in_flight[r, peer].append(sent[r])
                    if call == "send":
                        ready[r] = sent[r]
                else:
                    waiting = in_flight[peer, r]
                    if not waiting:
                        break  # its sender has not got there yet: the other ranks go on
                    received[r] = ready[r] = max(received[r] + 1, ready[r] + 1, waiting.popleft())
                at[r] += 1
                moved = True
    if any(at[r] < len(events[r]) for r in range(n)):
        return None
    return max([*sent, *received], default=0)
