"""A rank's port on a dialled network (:mod:`.network`): a message of ``n`` bytes arrives ``alpha + n / bandwidth``
after it left, one message after another out of each port, and a port takes in at most ``bandwidth`` bytes a second
from peers that send to it one at a time.

The dial is *faithful*: a message leaves at once, and its receiver waits until the moment the wire says it has
arrived -- its sender's deadline, which the sender posts in a :class:`Mailbox` the ranks share before the bytes
leave.  So loopback's own transfer runs under the dial's wait instead of on top of it: a message costs the larger
of the two, as on a real link where the NIC moves the bytes while the clock runs.  (An earlier dial held each
message before it left, and every message paid loopback on top: 1.4-3.5 ms of the lesson wire's 2 ms alpha.)

Every wait is ``time.sleep`` on whichever thread runs the collective -- the communication thread, for the overlapped
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

    ``record=True`` keeps every message's time on the wire as ``(start, end, kind, nbytes, thread)`` in
    :attr:`messages` -- the network's side of a timeline.  On a cluster the port is rank ``rank``'s and
    each message takes the wire of the link to its destination; a message between nodes also queues for
    its node's shared link (``links``).  Without a ``mailbox`` (a port on its own) nobody can read a
    deadline, so :meth:`send` waits for it on the sending side."""

    def __init__(self, network: "Network | TwoLevel", record: bool = False, rank: int = 0,
                 links: "NodeLinks | None" = None, mailbox: "Mailbox | None" = None):
        self.network = network
        self.rank = rank
        self.links = links
        self.mailbox = mailbox
        self.messages: list[tuple[float, float, str, int, str]] | None = [] if record else None
        self._outbound_done = float("-inf")  # when the last message out of this port is through
        self._inbound_done = float("-inf")  # when this port finished taking in the last message
        self._in_by = float("-inf")  # when everything this rank has taken in (or waits for) is in
        self.clock = None  # a DeviceClock under NCCL (.stream): a hold is then a wait on the current CUDA stream
        self.stands_for = 1  # one GPU standing for a ring of this many ranks (native backend, world size 1)

    def wire_to(self, peer: int | None) -> Network | None:
        """The wire a message to (or from) rank ``peer`` travels on."""
        if not isinstance(self.network, TwoLevel):
            return self.network
        return self.network.wire(self.network.nodes.link(self.rank, self.rank if peer is None else peer))

    def depart(self, nbytes: int, kind: str, to: int | None = None, now: float | None = None,
               post: bool = True) -> float | None:
        """A message of ``nbytes`` to rank ``to`` leaves: when it will have arrived, posted for its receiver.  It
        leaves at ``now`` (by default this moment) at the earliest, after every message this rank has taken in
        (in every collective here a message sent after a receive carries what was received), and after the
        message before it out of this port, each taking ``alpha + nbytes/bandwidth`` of its wire.  Between nodes
        the bytes also go through the node's link one message after another, whichever of the node's ranks sent
        them (``G`` ranks sending across at once each see ``1/G`` of the bandwidth).  ``post=False`` for a
        message that is only modelled (the native backend's: torch moved the bytes).  None where nothing is
        dialled, or on a device (see :meth:`hold`)."""
        wire = self.wire_to(to)
        if wire is None:
            return None
        if self.clock is not None:  # under NCCL the wait is a kernel before the transfer's, on the same stream
            self.clock.sleep(wire.message_s(nbytes))
            return None
        start = max(time.perf_counter() if now is None else now, self._outbound_done, self._in_by)
        if self.links is not None and isinstance(self.network, TwoLevel) and \
                self.network.nodes.link(self.rank, to) == INTER:
            deadline = self.links.reserve(self.network.nodes.node_of(self.rank), nbytes / wire.bandwidth, start) \
                + wire.alpha
        else:
            deadline = start + wire.message_s(nbytes)
        self._outbound_done = deadline
        if post and self.mailbox is not None and to is not None:
            self.mailbox.post(self.rank, to, deadline)
        self._record(start, deadline, kind, nbytes)
        return deadline

    def arrive(self, nbytes: int, source: int | None = None) -> None:
        """A message from rank ``source`` came in over loopback; the wire has it in at its sender's posted deadline
        (now, where nobody posted one) -- and, since a port takes in ``bandwidth`` bytes a second at most, not
        before the message ahead of it has streamed in (the parameter server's root: N-1 messages arriving
        together queue).  Nothing waits here: what this rank sends next leaves after it (:meth:`depart`), and
        the collective ends after it (:meth:`settle`)."""
        wire = self.wire_to(source)
        if wire is None or self.clock is not None:
            return
        sent = self.mailbox.take(source, self.rank) if self.mailbox is not None and source is not None else None
        done = max(time.perf_counter() if sent is None else sent, self._inbound_done + nbytes / wire.bandwidth)
        self._inbound_done = done
        self._in_by = max(self._in_by, done)

    def receive_all(self, start: float, sizes: list[int], sources: list[int] | None = None) -> None:
        """Messages sent towards this port from ``start`` on, while this rank sent its own (a star exchange:
        a parameter server's push or pull).  A port is full duplex: they stream in one after another, the
        first after ``alpha``, however long this rank's own messages take -- and none before its sender's
        deadline."""
        if self.clock is not None:
            return
        wires = [self.wire_to(s) for s in (sources or [None] * len(sizes))]
        sent = [self.mailbox.take(s, self.rank) for s, w in zip(sources or [], wires, strict=False)
                if w is not None] if self.mailbox is not None and sources else []
        timed = [(w, n) for w, n in zip(wires, sizes, strict=True) if w is not None]
        if timed:
            first = min(w.alpha for w, _ in timed)
            done = max(start + first, self._inbound_done) + sum(n / w.bandwidth for w, n in timed)
            self._inbound_done = max([done, *sent])
            self._in_by = max(self._in_by, self._inbound_done)

    def hold(self, seconds: float, kind: str, nbytes: int = 0, since: float | None = None) -> None:
        """``seconds`` of modelled network time from ``since`` (by default, now) or after what this port already
        waits for: the native backend's critical paths, counted from the start of torch's collective, whose
        transfer runs under them."""
        if self.clock is not None:  # queued on the device, where the collective's kernels run; the host goes on
            self.clock.sleep(seconds)
            return
        start = max(time.perf_counter() if since is None else since, self._in_by)
        self._in_by = start + seconds
        self._record(start, self._in_by, kind, nbytes)

    def join(self, peers: list[int]) -> float:
        """This rank joins a collective whose transfer it cannot see (torch's): its start, now, posted to ``peers``."""
        now = time.perf_counter()
        if self.mailbox is not None:
            for peer in peers:
                self.mailbox.post(self.rank, peer, now)
        return now

    def started(self, began: float, peers: list[int]) -> float:
        """When a collective this rank joined at ``began`` started on the wire: when the last of ``peers`` joined
        (each posted its start before joining, so a collective that needed them all has their starts)."""
        if self.mailbox is None:
            return began
        return max([began, *(self.mailbox.take(peer, self.rank) for peer in peers)])

    def due(self) -> float:
        """When this rank's last message out has arrived and every message to it is in (``time.perf_counter``)."""
        return max(self._outbound_done, self._in_by)

    def settle(self) -> None:
        """The collective ends: wait, on this thread and without the CPU, until :meth:`due` -- the moment a real
        link would have finished it."""
        sleep_until(self.due())

    def send(self, nbytes: int, kind: str, to: int | None = None) -> None:
        """One message, and its wait: what a collective of one message to ``to`` costs its sender."""
        self.depart(nbytes, kind, to)
        self.settle()

    def _record(self, start: float, end: float, kind: str, nbytes: int) -> None:
        if self.messages is not None:
            self.messages.append((start, end, kind, nbytes, threading.current_thread().name))


class Mailbox:
    """Each message's arrival time, from its sender to its receiver -- which are processes.  A file of
    ``(number, deadline)`` pairs, :data:`DEPTH` slots per ordered pair of ranks: the sender writes message ``k``'s
    deadline into slot ``k mod DEPTH`` before the bytes leave, so when the receiver has the bytes, the slot is
    already written (``time.perf_counter`` is the machine's monotonic clock, the same in every process).  Both
    sides count the messages of each pair; a slot holding another number than the receiver expects means the two
    counts disagree -- a message sent with no matching arrival, or one overtaken -- and is an error, not a guess."""

    DEPTH = 4096  # messages a sender may run ahead of its receiver: the broadcast chain's 1 MiB pieces, 4 GiB

    def __init__(self, path: str, world_size: int):
        self.path, self.world_size = path, world_size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # sparse: only the pairs that talk take pages
        self._posted: dict[int, int] = {}
        self._taken: dict[int, int] = {}

    def _slot(self, src: int, dst: int, number: int) -> int:
        return 16 * ((src * self.world_size + dst) * self.DEPTH + number % self.DEPTH)

    def post(self, src: int, dst: int, deadline: float) -> None:
        number = self._posted[dst] = self._posted.get(dst, 0) + 1
        os.pwrite(self._fd, struct.pack("qd", number, deadline), self._slot(src, dst, number))

    def take(self, src: int, dst: int) -> float:
        number = self._taken[src] = self._taken.get(src, 0) + 1
        found, deadline = struct.unpack("qd", os.pread(self._fd, 16, self._slot(src, dst, number)).ljust(16, b"\0"))
        if found != number:
            raise RuntimeError(f"rank {dst}: the dialled network expected message {number} from rank {src}, and its "
                               f"mailbox holds message {found}: a message left without its arrival being waited "
                               f"for (or was overtaken) -- a bug in the communication layer, not in the stage")
        return deadline

    def close(self) -> None:
        os.close(self._fd)


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

    def reserve(self, node: int, seconds: float, now: float | None = None) -> float:
        """Queue ``seconds`` of transfer on ``node``'s link, from ``now`` on at the earliest; when those bytes are
        through."""
        with self._threads:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 8, 8 * node)
            try:
                (busy,) = struct.unpack("d", os.pread(self._fd, 8, 8 * node))
                through = max(time.perf_counter() if now is None else now, busy) + seconds
                os.pwrite(self._fd, struct.pack("d", through), 8 * node)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 8, 8 * node)
        return through

    def close(self) -> None:
        os.close(self._fd)


def sleep_until(deadline: float) -> None:
    """Sleep, without using the CPU, until ``deadline`` (``time.perf_counter``)."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
