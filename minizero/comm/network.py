"""A network you can dial: every message waits ``alpha + bytes / bandwidth`` of wall time.

On a laptop the ranks talk over loopback, where moving bytes costs the same
CPU that backward needs: overlap hides "between nothing and half" of the
communication, run to run, and nobody can tell what a stage would do over a
100 Gb/s network.  Real links are described by the Hockney model that NCCL's
tuning and the ZeRO paper's reasoning use: a message of ``n`` bytes costs a
latency ``alpha`` plus ``n / beta``.  A :class:`Network` puts exactly that on
every message, with the real transfer running under it:

* **per message, once, as the wire says.**  A message leaves at once and
  arrives ``alpha + n/beta`` later; out of one port the messages go one
  after another.  Its sender posts that moment in a mailbox the ranks share
  (:class:`~minizero.comm.port.Mailbox`), its receiver takes it once loopback
  has delivered the bytes, and nothing sent afterwards leaves before it
  (:mod:`.port`): loopback's transfer runs under the dial's wait, so a message
  costs the larger of the two, not their sum.  A ring step is one message
  per port each way, so a ring all-reduce of ``S`` bytes costs
  ``2(N-1) * (alpha + S/(N beta))``, the textbook figure.  Where a rank
  receives from one peer at a time (:meth:`RingComm._recv`: the parameter
  server's root, the broadcast chain), its port also takes in at most
  ``beta`` bytes a second: ``N-1`` messages arriving together at the root
  stream in one after another, as they would through one NIC.
* **no CPU.**  The wait is ``time.sleep`` on whichever thread runs the
  collective -- the communication thread, for the overlapped ones -- which
  releases the GIL: backward goes on computing, exactly as it would while a
  NIC moved the bytes.
* **outside the algorithms.**  A port (:mod:`.port`) is attached to a
  :class:`~minizero.comm.base.Comm` like the byte ledger; no stage and no ring
  step knows it is there.  With the native backend, torch's collective runs
  under the wait the ring version would have, counted from the moment its
  last rank joined: its messages
  (:func:`~minizero.comm.native.ring_messages`), or for the root all-reduce
  and the broadcast chain, the rank's place on their critical path.

Presets are real links, with the source of their numbers.  They are for the
scaling model (:mod:`minizero.costs.cost_model`, ``python -m minizero scale``): on a laptop their delays are far
below what loopback already costs.  The measured runs use slow dials
(``"lesson"``, or ``alpha=2ms,bandwidth=50MB/s``), where the network is most of
what a step waits for; the loopback transfer underneath still costs CPU, and
more on a busy machine, so a measured time is read beside the model's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .nodes import INTER, INTRA, Nodes, parse_nodes


@dataclass(frozen=True)
class Network:
    """``alpha`` seconds per message, ``bandwidth`` bytes per second per direction of each rank's port."""

    alpha: float
    bandwidth: float
    name: str = "custom"
    source: str = ""

    def __post_init__(self):
        if not (isinstance(self.alpha, (int, float)) and 0 <= self.alpha < float("inf")):
            raise ValueError(f"network alpha must be a finite time >= 0 seconds, got {self.alpha!r}")
        if not (isinstance(self.bandwidth, (int, float)) and 0 < self.bandwidth < float("inf")):
            raise ValueError(f"network bandwidth must be a finite rate > 0 bytes/s, got {self.bandwidth!r}")

    def message_s(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` takes from leaving its sender to being in at its receiver: the Hockney
        model."""
        return self.alpha + nbytes / self.bandwidth

    def describe(self) -> str:
        text = f"alpha={format_time(self.alpha)}, bandwidth={format_rate(self.bandwidth)}"
        return text if self.name == "custom" else f"{self.name} ({text})"


# NCCL's tuning model (src/graph/tuning.cc, hwLat, Ring/Simple protocol) charges 3.4 us per ring step
# over NVLink, 5.7 us over PCI and 9.6 us over the network; bandwidths are per direction.
PRESETS: dict[str, Network] = {n.name: n for n in [
    Network(3.4e-6, 450e9, "nvlink",
            "H100 SXM NVLink 4: 900 GB/s both directions (NVIDIA H100 datasheet); alpha: NCCL tuning.cc hwLat"),
    Network(5.7e-6, 32e9, "pcie4",
            "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction; alpha: NCCL tuning.cc hwLat"),
    Network(9.6e-6, 12.5e9, "ethernet-100g",
            "100 Gb/s Ethernet = 12.5 GB/s (IEEE 802.3); alpha: NCCL tuning.cc hwLat (network, best case: "
            "RDMA; TCP sockets add tens of microseconds)"),
    Network(9.6e-6, 50e9, "infiniband-ndr",
            "InfiniBand NDR 400 Gb/s = 50 GB/s per port (NVIDIA ConnectX-7); alpha: NCCL tuning.cc hwLat"),
    Network(2e-3, 50e6, "lesson",
            "not a real link: a deliberately slow one (2 ms, 50 MB/s) so that the lessons' small models, on a "
            "laptop, wait for the network rather than for loopback's CPU"),
]}



@dataclass(frozen=True)
class TwoLevel:
    """A cluster: ``nodes`` of ranks, messages inside a node on ``intra``, between nodes on ``inter`` --
    through the node's one link, which its ranks share (:class:`~minizero.comm.port.NodeLinks`).  A wire left out (None)
    costs nothing: ``nodes=2x2`` alone places the ranks, so the ledger can count bytes per link class,
    without slowing any message."""

    nodes: Nodes
    intra: Network | None = None
    inter: Network | None = None

    name = "two-level"

    def wire(self, link: str) -> Network | None:
        return self.intra if link == INTRA else self.inter

    def describe(self) -> str:
        wires = ", ".join(f"{link}: {w.describe()}" for link, w in ((INTRA, self.intra), (INTER, self.inter)) if w)
        return f"{self.nodes.describe()}" + (f"; {wires}" if wires else " (placement only: no wire dialled)")


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_network(spec: "str | Network | TwoLevel | None") -> "Network | TwoLevel | None":
    """``"alpha=50us,bandwidth=1GB/s"`` or a preset's name (``"ethernet-100g"``); None stays None.
    ``"nodes=2x4,intra=nvlink,inter=2ms/50MB/s"``: a :class:`TwoLevel` cluster (each wire a preset or
    ``ALPHA/RATE``; either may be left out).

    Bandwidth takes bytes (``B/s``) or bits (``b/s``, ``bit/s``) with decimal (``k M G T``) or binary
    (``Ki Mi Gi``) prefixes; time takes ``s ms us ns``.  A bare number is refused: the unit is the
    point of the dial, and a guessed one is off by a factor of a thousand."""
    if spec is None or isinstance(spec, (Network, TwoLevel)):
        return spec
    text = spec.strip()
    keys = {part.partition("=")[0].strip().lower() for part in text.split(",")}
    if "nodes" in keys:  # in any place, in any case: "bandwidth=...,nodes=2x2" is a cluster too, not a flat wire
        return parse_two_level(text)
    if text in PRESETS:
        return PRESETS[text]
    if "=" not in text:
        raise ValueError(f"unknown network preset {text!r}; presets: {', '.join(PRESETS)} -- or give "
                         f"'alpha=50us,bandwidth=1GB/s'")
    values: dict[str, str] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in ("alpha", "bandwidth"):
            raise ValueError(f"network: unknown key {key!r} in {spec!r}; give alpha=TIME,bandwidth=RATE (one wire), "
                             f"or nodes=MxG[,intra=WIRE][,inter=WIRE] (a cluster)")
        if key in values:
            raise ValueError(f"network: {key} given twice in {spec!r}; give each once")
        values[key] = value.strip()
    if "bandwidth" not in values:
        raise ValueError(f"network {spec!r} has no bandwidth; e.g. 'alpha=50us,bandwidth=1GB/s'")
    return Network(parse_time(values.get("alpha", "0s")), parse_rate(values["bandwidth"]))


def parse_two_level(text: str) -> TwoLevel:
    values: dict[str, str] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in ("nodes", "intra", "inter"):
            raise ValueError(f"network: unknown key {key!r} in {text!r}; give nodes=MxG[,intra=WIRE][,inter=WIRE], "
                             f"each wire a preset ({', '.join(PRESETS)}) or ALPHA/RATE such as 2ms/50MB/s")
        if key in values:
            raise ValueError(f"network: {key} given twice in {text!r}; give each once")
        values[key] = value.strip()
    if "nodes" not in values:
        raise ValueError(f"network: {text!r} has no nodes=MxG; give nodes=MxG[,intra=WIRE][,inter=WIRE]")
    return TwoLevel(parse_nodes(values["nodes"]), *(parse_wire(values[k], k) if k in values else None
                                                   for k in ("intra", "inter")))


def parse_wire(text: str, link: str) -> Network:
    """One link of a two-level network: a preset's name, or ``ALPHA/RATE``."""
    if text in PRESETS:
        return PRESETS[text]
    alpha, slash, rate = text.partition("/")
    if not slash:
        raise ValueError(f"network: {link}={text!r}: give a preset ({', '.join(PRESETS)}) or ALPHA/RATE, e.g. 2ms/50MB/s")
    return Network(parse_time(alpha), parse_rate(rate))


def parse_time(text: str) -> float:
    match = re.fullmatch(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(s|ms|us|µs|ns)\s*", text)
    if not match:
        raise ValueError(f"network alpha {text!r}: give a time with its unit, e.g. 50us, 2ms, 0s")
    value = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if value < 0:
        raise ValueError(f"network alpha {text!r} is negative; a latency is 0 or more")
    return value


def parse_rate(text: str) -> float:
    """Bytes per second from ``1GB/s``, ``100Gb/s``, ``100 Gbit/s``, ``512MiB/s``."""
    match = re.fullmatch(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([kKmMgGtT]i?)?(B|b|bit)/s\s*", text)
    if not match:
        raise ValueError(f"network bandwidth {text!r}: give a rate with its unit, e.g. 1GB/s, 100Gb/s, 512MiB/s")
    value = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    value = value / 8 if match.group(3) in ("b", "bit") else value
    if not value > 0:
        raise ValueError(f"network bandwidth {text!r} must be greater than 0")
    return value


def format_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds * 1e9:g}ns"


def format_rate(rate: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= scale:
            return f"{rate / scale:g}{unit}"
    return f"{rate:g}B/s"
