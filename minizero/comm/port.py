"""A rank's port on a dialled network (:mod:`.network`): it holds every message ``alpha + bytes / bandwidth`` before
it leaves, and takes in at most ``bandwidth`` bytes a second from peers that send to it one at a time.

The wait is ``time.sleep`` on whichever thread runs the collective -- the communication thread, for the overlapped
ones -- which releases the GIL: backward goes on computing, exactly as it would while a NIC moved the bytes.  On a
cluster of nodes (:class:`NodeLinks`) the ranks of a node share one port to the slow link between nodes.
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import time

from .network import Network, TwoLevel
from .nodes import INTER


class Port:
    """One rank's connection to a dialled :class:`Network` (or :class:`TwoLevel` cluster).

    ``record=True`` keeps every message's wait as ``(start, end, kind, nbytes, thread)`` in
    :attr:`messages` -- the network's side of a timeline.  On a cluster the port is rank ``rank``'s and
    each message takes the wire of the link to its destination; a message between nodes also queues for
    its node's shared link (``links``)."""

    def __init__(self, network: "Network | TwoLevel", record: bool = False, rank: int = 0,
                 links: "NodeLinks | None" = None):
        self.network = network
        self.rank = rank
        self.links = links
        self.messages: list[tuple[float, float, str, int, str]] | None = [] if record else None
        self._inbound_done = float("-inf")  # when this port finished taking in the last message
        self.clock = None  # a DeviceClock under NCCL (.stream): a hold is then a wait on the current CUDA stream
        self.stands_for = 1  # one GPU standing for a ring of this many ranks (native backend, world size 1)

    def wire_to(self, peer: int | None) -> Network | None:
        """The wire a message to (or from) rank ``peer`` travels on."""
        if not isinstance(self.network, TwoLevel):
            return self.network
        return self.network.wire(self.network.nodes.link(self.rank, self.rank if peer is None else peer))

    def send(self, nbytes: int, kind: str, to: int | None = None) -> None:
        """Before a message to rank ``to`` leaves: hold it for ``alpha + nbytes/bandwidth`` of its wire.
        Between nodes the bytes go through the node's link one message after another, whichever of the
        node's ranks sent them: ``G`` ranks sending across at once each see ``1/G`` of the bandwidth."""
        wire = self.wire_to(to)
        if wire is None:
            return
        if self.links is not None and isinstance(self.network, TwoLevel) and \
                self.network.nodes.link(self.rank, to) == INTER:
            through = self.links.reserve(self.network.nodes.node_of(self.rank), nbytes / wire.bandwidth)
            self.hold(through + wire.alpha - time.perf_counter(), kind, nbytes)
        else:
            self.hold(wire.message_s(nbytes), kind, nbytes)

    def hold(self, seconds: float, kind: str, nbytes: int = 0) -> None:
        """Wait ``seconds`` of modelled network time (the native backend's critical paths use it directly)."""
        if self.clock is not None:  # queued on the device, where the collective's kernels run; the host goes on
            self.clock.sleep(seconds)
            return
        start = time.perf_counter()
        _sleep_until(start + seconds)
        if self.messages is not None:
            self.messages.append((start, time.perf_counter(), kind, nbytes, threading.current_thread().name))

    def receive(self, nbytes: int, source: int | None = None) -> None:
        """After a message arrived: a port takes in ``bandwidth`` bytes a second at most, so a message
        arriving while the last one still streams in waits its turn (the parameter server's root)."""
        wire = self.wire_to(source)
        if wire is None:
            return
        done = max(time.perf_counter(), self._inbound_done + nbytes / wire.bandwidth)
        _sleep_until(done)
        self._inbound_done = done

    def receive_all(self, start: float, sizes: list[int], sources: list[int] | None = None) -> None:
        """Messages sent towards this port from ``start`` on, while this rank sent its own (a star exchange:
        a parameter server's push or pull).  A port is full duplex: they stream in one after another, the
        first after ``alpha``, however long this rank's own messages held it."""
        wires = [self.wire_to(s) for s in (sources or [None] * len(sizes))]
        timed = [(w, n) for w, n in zip(wires, sizes, strict=True) if w is not None]
        if timed:
            first = min(w.alpha for w, _ in timed)
            done = max(start + first, self._inbound_done) + sum(n / w.bandwidth for w, n in timed)
            _sleep_until(done)
            self._inbound_done = done


class NodeLinks:
    """Each node's one link to the others, shared by the node's ranks -- which are processes.  A file of
    one ``double`` per node (``time.perf_counter`` is the machine's monotonic clock, the same in every
    process) says until when the link is busy; a rank sending across reserves the next free slot under a
    file lock.  A dialled cluster is simulated on one machine, so one file reaches every rank."""

    def __init__(self, path: str, nodes: int):
        self.path, self.nodes = path, nodes
        self._threads = threading.Lock()  # a file lock is the process's: its threads take turns here first
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < 8 * nodes:
            os.pwrite(self._fd, struct.pack(f"{nodes}d", *[0.0] * nodes), 0)

    def reserve(self, node: int, seconds: float) -> float:
        """Queue ``seconds`` of transfer on ``node``'s link; when those bytes are through."""
        with self._threads:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 8, 8 * node)
            try:
                (busy,) = struct.unpack("d", os.pread(self._fd, 8, 8 * node))
                through = max(time.perf_counter(), busy) + seconds
                os.pwrite(self._fd, struct.pack("d", through), 8 * node)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 8, 8 * node)
        return through

    def close(self) -> None:
        os.close(self._fd)


def _sleep_until(deadline: float) -> None:
    """Sleep, without using the CPU, until ``deadline`` (``time.perf_counter``)."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
