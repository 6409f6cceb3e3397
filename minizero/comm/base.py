"""The communication interface every stage talks to.

A stage never calls ``torch.distributed`` directly: it calls a :class:`Comm`.
Two implementations exist and are interchangeable per run:

* :class:`~minizero.comm.ring.RingComm` builds every collective from
  point-to-point ``send``/``recv`` -- the lesson;
* :class:`~minizero.comm.native.NativeComm` forwards to torch's built-in
  collectives (gloo on CPU, NCCL on GPU) -- the yardstick.

What every collective goes through lives here, once, so the algorithms stay clean:

* **Observers** (the byte ledger, later timers) learn how many bytes each
  collective sent, without a line of accounting code in any stage.
* **Tags and fingerprints.** A caller says what a collective is for
  (``tag=Tag("bucket 2", ...)``); with ``check=True`` every rank's fingerprint
  of the call is compared before any data moves (:mod:`.fingerprint`).
* **The progress board** hears when a collective starts, moves and ends, so a
  watchdog outside it can tell a stall from slow progress (:mod:`.progress`).
* **Async collectives** run on one daemon thread per ``Comm`` (:mod:`.thread`),
  in the order they were issued -- the same order on every rank -- so messages of
  two collectives never interleave: what makes overlap (bucketed DDP, ZeRO
  prefetch) safe.  Under NCCL they are queued on a CUDA stream of their own
  instead (:mod:`.stream`), as torch DDP and FSDP2 do: the host issues them in
  that same order and never waits for one.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from . import progress
from .collective import SUPPORTED_DTYPES, ReduceOp, _tensors
from .fingerprint import Call, CollectiveMismatch, OutOfStep, Tag, exchange
from .network import Network, TwoLevel
from .nodes import Nodes
from .port import Port
from .stream import CommStream, DeviceClock
from .thread import CommThread, Work
from .views import Views


class Comm(Views):
    """Collectives over a process group; subclasses implement the algorithms.

    Every collective is in place or writes into a caller-given ``output``,
    like ``torch.distributed``; ``output`` shards are ``1/world_size`` of the
    full tensor.  ``check=True`` compares every rank's fingerprint of each call
    before it runs (:mod:`.fingerprint`); the tests, ``compare`` and the lessons
    turn it on, ``make_comm``'s default is off (``bench check`` measures its cost).
    """

    name = "abstract"

    def __init__(self, group: dist.ProcessGroup | None = None, check: bool = False,
                 network: "Network | TwoLevel | None" = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._nccl = dist.get_backend(group) == "nccl"  # see placement.on_device
        self.check = check
        self.board = progress.installed()
        self._observers: list[Callable[[str, int], None]] = []
        self._span_observers: list[Callable] = []
        self._wait_observers: list[Callable[[float, float], None]] = []
        # Where the ranks sit (a two-level network's nodes), or None: one flat network (see .nodes).
        self.nodes: Nodes | None = network.nodes if isinstance(network, TwoLevel) else None
        if self.nodes is not None:
            self.nodes.check(self.world_size, self.rank)
        self._members = list(range(self.world_size))  # this Comm's ranks as ranks of the whole Comm (a view's: some)
        self._root = self  # the whole Comm a view was cut from: its thread and port serve every view
        # a dialled network (see .network), or none
        self.port = Port(network, rank=self.rank, links=self._node_links(network),
                         mailbox=self._mailbox(network)) if network is not None else None
        self._local = threading.local()
        self._thread: CommThread | CommStream | None = None
        # Under NCCL the collectives go on a CUDA stream of their own (.stream); False keeps the thread, whose
        # kernels join the compute stream -- nothing overlaps: the GPU bench's contrast (bench gpu-efficiency).
        # True means torch.cuda's streams; an object with their API may stand in (the suite's recorder, on CPU).
        self.own_stream: bool | object = self._nccl
        if self.port is not None and self._nccl:  # a dialled wire waits on the device, where NCCL's kernels run
            self.port.clock = DeviceClock()
        self._lock = threading.Lock()
        self._calls = 0  # collectives issued on this Comm: the number in every fingerprint
        self._failed: tuple[str, BaseException] | None = None  # what failed part-way, and its error: out of step

    # ----------------------------------------------------------- observers
    def add_observer(self, observer: Callable[[str, int], None]) -> None:
        """``observer(kind, nbytes)`` is called for every message this rank sends."""
        self._observers.append(observer)

    def remove_observer(self, observer: Callable[[str, int], None]) -> None:
        self._observers.remove(observer)

    def add_span_observer(self, observer: Callable) -> None:
        """``observer(call, start, end, thread_name)`` after every collective (``time.perf_counter``
        seconds), and ``observer(None, start, end, thread_name)`` for every wait that blocked on the
        communication thread: what a timeline draws (:mod:`minizero.observe.timeline`)."""
        self._span_observers.append(observer)
        self._wait_observers.append(lambda start, end: observer(None, start, end, threading.current_thread().name))

    def _leaving(self, nbytes: int, to: int) -> None:
        """A message of ``nbytes`` to rank ``to`` is about to leave this rank: a dialled port says when it will have
        arrived (its receiver takes it in then; this rank's collective ends after it)."""
        if self.port is not None:
            self.port.depart(nbytes, getattr(self._local, "kind", None) or "exchange", self._members[to])

    def _arrived(self, nbytes: int, source: int) -> None:
        """A message of ``nbytes`` arrived from rank ``source``: a dialled port waits until the wire has it in."""
        if self.port is not None:
            self.port.arrive(nbytes, self._members[source])

    def _report_sent(self, nbytes: int, to: int) -> None:
        """Tell the observers (the byte ledger) what left for rank ``to``: on a cluster of nodes, with the
        link class it crossed."""
        kind = getattr(self._local, "kind", None) or "exchange"
        if self.nodes is None:
            for observer in self._observers:
                observer(kind, nbytes)
        else:
            link = self.nodes.link(self._members[self.rank], self._members[to])
            for observer in self._observers:
                observer(kind, nbytes, link=link)

    def _at(self, part: str, step: int = -1) -> None:
        """Tell the board where this collective is (the fingerprint exchange's own steps say so)."""
        self.board.at("fingerprint exchange" if getattr(self._local, "kind", None) == "check" else part, step)

    # ----------------------------------------------------------- one collective
    def _run(self, kind: str, method, arguments: dict, tag: Tag | None, deferred: bool = False):
        """Validate, fingerprint, run and book one collective (on whichever thread runs it).  On a dialled network
        it ends when the wire has its messages in; ``deferred`` (an ``async_op`` collective on the communication
        thread) leaves that wait to whoever waits for it, and returns the moment instead (:class:`DueWork`)."""
        if getattr(self._local, "kind", None) is not None:  # part of an outer collective: booked there
            return method(**arguments)
        if self._failed is not None:
            what, error = self._failed
            raise OutOfStep(f"rank {self.rank}: no more collectives on this Comm: {what} failed part-way "
                            f"({type(error).__name__}: {error}), so its messages are out of step with its peers'. "
                            f"Start again with a new Comm, and a new stage over a fresh model.") from error
        call = self._describe(kind, arguments, tag or Tag())
        self.board.enter(call)
        start = due = time.perf_counter()
        try:
            if self.check and self.world_size > 1:
                self._local.kind = "check"
                self._at("fingerprint exchange")
                exchange(self, call, _tensors(arguments)[0].device)
            self._local.kind = kind
            result = method(**arguments)
            if self.port is not None:  # a dialled network: the collective ends when its messages would have
                due = self.port.due()
                if not deferred:
                    self.port.settle()
            return due if deferred else result
        except CollectiveMismatch:
            raise  # every rank raised at the same call, before any data moved: still in step
        except BaseException as error:
            # Part of this collective's messages may have left: a next one would pair with the rest
            # (on gloo, a size mismatch aborts the process).  Stop here, and say why from now on.
            self.failed_part_way(call.describe(), error)
            raise
        finally:
            self._local.kind = None
            self.board.leave()
            for observer in self._span_observers:
                observer(call, start, max(due, time.perf_counter()), threading.current_thread().name)

    def failed_part_way(self, what: str, error: BaseException) -> None:
        """``what`` stopped with ``error`` after some of its messages may have left: this Comm takes no more
        collectives, each refused (:class:`OutOfStep`) naming the first failure and chained from its error."""
        if self._failed is None:
            self._failed = (what, error)

    def _describe(self, kind: str, arguments: dict, tag: Tag) -> Call:
        """Check the tensors (naming this rank and the tag) and say what the call is."""
        self._calls += 1
        where = f"rank {self.rank}: {kind} for {tag.describe()}"
        tensors = _tensors(arguments)
        for t in tensors:
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{where}: dtype {t.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
        op = arguments.get("op")
        if op is not None and not (tensors[0].is_floating_point() or op is not ReduceOp.AVG and tensors[0].dtype != torch.bool):
            raise TypeError(f"{where}: {op.name} of {tensors[0].dtype} is not defined; reduce a floating-point tensor")
        self._check_layout(kind, arguments, where)
        return Call(self._calls, kind, max(t.numel() for t in tensors), tensors[0].dtype,
                    op.value if op is not None else f"from rank {arguments['src']}" if "src" in arguments else "", tag)

    #: A collective whose shapes are not a full tensor and its 1/N shard says how to check them, by kind (the
    #: parameter server's push and pull: S shards; the all-to-all: N chunks each way).
    shape_checks: dict[str, Callable] = {}

    def _check_shards(self, output: torch.Tensor, input: torch.Tensor, kind: str, where: str, arguments: dict) -> None:
        full, shard = (input, output) if kind == "reduce_scatter" else (output, input)
        if output.dtype != input.dtype:
            raise TypeError(f"{where}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(
                f"{where}: the full tensor must hold world_size x shard elements, got {full.numel()} and "
                f"{shard.numel()} with world_size {self.world_size}; pad the full tensor to a multiple of "
                f"world_size (see minizero.parts.layout)")

    def _check_layout(self, kind: str, arguments: dict, where: str) -> None:
        """Contiguous tensors, and shapes the collective of ``kind`` accepts (a shard of 1/N, or its own rule)."""
        if not all(t.is_contiguous() for t in _tensors(arguments)):
            raise ValueError(f"{where}: the tensor must be contiguous (call .contiguous() first)")
        if "output" in arguments:
            self.shape_checks.get(kind, Comm._check_shards)(self, arguments["output"], arguments["input"], kind, where,
                                                           arguments)

    def check_copied(self, kind: str, arguments: dict, tag: Tag | None) -> None:
        """The caller's tensors of an average whose wire runs its own collectives on copies (a codec's, PowerSGD's),
        checked as the plain collective checks them."""
        self._check_layout(kind, arguments, f"rank {self.rank}: {kind} for {(tag or Tag()).describe()}")

    # ---------------------------------------------------------- async thread
    def _background(self) -> CommThread | CommStream:
        root = self._root  # one thread (or stream) per whole Comm: its views' collectives queue there too
        with root._lock:
            if root._thread is None:
                if root.own_stream:
                    root._thread = CommStream(None if root.own_stream is True else root.own_stream)
                else:
                    root._thread = CommThread(f"comm-rank{root.rank}", root._wait_observers)
                weakref.finalize(root, root._thread.stop)  # a Comm nobody closed does not leave its thread behind
            return root._thread

    def submit(self, fn: Callable[[], object]) -> Work:
        """Run ``fn`` on the communication thread (under NCCL: stream), after every collective issued
        before it; collectives it calls run inline.  Bucketed DDP uses this to
        cast, reduce and unpack a bucket while backward goes on computing."""
        return self._background().submit(fn)

    def close(self) -> None:
        if self._root is not self:  # a view: the whole Comm's owner closes the thread
            return
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    # ----------------------------------------------------------- interface
    def peer(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (what ``dist.send`` expects)."""
        root = self._root.group
        whole = self._members[group_rank]
        return whole if root is None else dist.get_global_rank(root, whole)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        raise NotImplementedError

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        raise NotImplementedError

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        raise NotImplementedError

    def root_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        raise NotImplementedError
