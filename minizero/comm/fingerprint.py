"""Collective-order checking: every rank says what it is about to do, before it does it.

A collective pairs the i-th message of each rank with its neighbours' i-th.
If ranks disagree on *which* collective comes next -- one rank synchronises a
micro-batch that another runs inside ``no_sync()``, a module runs twice on
one rank, ``clip_grad_norm_`` runs on some ranks only -- the bytes of one
tensor get added to the bytes of another.  Same sizes: a silently wrong
result.  Different sizes: a hang or a transport error naming nothing of the
user's.

So, with checking on, every collective is preceded by a small all-gather of a
**fingerprint**: the call's number on this Comm, its kind, element count,
dtype, reduction, and the stage's :class:`Tag` (what the tensor is -- "bucket 2",
"unit 3 forward all-gather" -- and where in the step: optimizer step,
forward pass, synchronising or inside ``no_sync()``).  Every rank gets the
same table, so every rank sees a mismatch at the same call and raises the same
:class:`CollectiveMismatch`, naming what each rank was doing and the likely
cause -- before a single byte of the data moves.  (torch does the same with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, over a separate gloo group.)

The fingerprint is 9 float64 numbers; its bytes are booked as kind ``check``,
apart from the training traffic the formulas describe.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

#: Collective kinds, the keys of the byte ledger.  ``check`` is the fingerprint exchange; ``push``, ``pull`` and
#: ``all_to_all`` the direct exchanges (:mod:`.star`).
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce", "exchange", "check", "push",
         "pull", "all_to_all")
#: What a collective may carry -- reductions need floating point, or integers for SUM and MAX; broadcast
#: and all-gather only copy, so integer and bool buffers (BatchNorm's counter) travel too.  The position
#: is the dtype's number in a fingerprint.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.bool)
TEXT = 96  # characters of each rank's description exchanged when fingerprints differ


@dataclass(frozen=True)
class Tag:
    """What a collective is for, in the words of the stage that issues it.

    ``step``: optimizer steps taken before it; ``backward``: backward passes
    since that step (not forwards: a forward with no backward -- a logging
    pass on one rank -- changes nothing to synchronise); ``syncing``: 1 in a
    synchronising micro-batch, 0 inside ``no_sync()``.  -1 means "not
    applicable" (wrap time, user code)."""

    what: str = ""
    step: int = -1
    backward: int = -1
    syncing: int = -1

    def describe(self) -> str:
        parts = [repr(self.what)] if self.what else ["(untagged)"]
        if self.step >= 0:
            parts.append(f"step {self.step}")
        if self.backward >= 0:
            parts.append(f"backward {self.backward}")
        if self.syncing >= 0:
            parts.append("synchronising" if self.syncing else "inside no_sync()")
        return ", ".join(parts)


@dataclass(frozen=True)
class Call:
    """One collective, as one rank is about to issue it."""

    seq: int
    kind: str
    numel: int
    dtype: torch.dtype
    op: str  # "sum", "avg", "max", "from rank 0", or ""
    tag: Tag

    def describe(self) -> str:
        op = f" ({self.op})" if self.op else ""
        return f"#{self.seq} {self.kind} of {self.numel} {str(self.dtype).replace('torch.', '')}{op} for {self.tag.describe()}"


class CollectiveMismatch(RuntimeError):
    """Ranks were about to run different collectives; raised on every rank, before any data moved."""


class OutOfStep(RuntimeError):
    """A collective refused because an earlier one on this Comm failed part-way.  Its ``__cause__`` is that
    failure -- the error to show: this one is only where the rank next tried to talk (lesson 16's blank
    PowerSGD lab once read "RuntimeError: no more collectives" where its cause was "write power_step")."""


def digest(text: str) -> float:
    """48 bits of a hash: exactly representable in float64, the dtype fingerprints travel in."""
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big"))


_OPS = {"": 0, "sum": 1, "avg": 2, "max": 3}


def _op_code(op: str) -> float:
    return float(_OPS[op]) if op in _OPS else 100.0 + float(op.rsplit(" ", 1)[-1])


def encode(call: Call) -> list[float]:
    return [float(call.seq), float(KINDS.index(call.kind)), float(call.numel),
            float(DTYPES.index(call.dtype)) if call.dtype in DTYPES else -1.0, _op_code(call.op),
            digest(call.tag.what), float(call.tag.step), float(call.tag.backward), float(call.tag.syncing)]


FIELDS = 9


def decode(row: list[float], what: str) -> Call:
    seq, kind, numel, dtype, op, _, step, backward, syncing = (int(v) for v in row)
    op_name = next((k for k, v in _OPS.items() if v == op), f"from rank {op - 100}")
    return Call(seq, KINDS[kind], numel, DTYPES[dtype] if dtype >= 0 else torch.float32, op_name,
                Tag(what, step, backward, syncing))


def exchange(comm, call: Call, device: torch.device) -> None:
    """All-gather every rank's fingerprint of ``call``; raise :class:`CollectiveMismatch` if any differs.

    Runs *inside* the collective (``comm`` books its bytes as ``check``); every
    rank sees the same table, so every rank raises at the same call."""
    n = comm.world_size
    mine = torch.tensor(encode(call), dtype=torch.float64, device=device)
    table = torch.empty(n * FIELDS, dtype=torch.float64, device=device)
    comm.all_gather(table, mine)
    rows = table.view(n, FIELDS).cpu()
    if bool((rows == rows[0]).all()):
        return
    # A second, equally-sized exchange: what each rank was doing, in words.
    text = torch.tensor(list(call.tag.what.encode()[:TEXT].ljust(TEXT, b"\0")), dtype=torch.float64, device=device)
    texts = torch.empty(n * TEXT, dtype=torch.float64, device=device)
    comm.all_gather(texts, text)
    words = [bytes(int(c) for c in row if c).decode(errors="replace") for row in texts.view(n, TEXT).cpu().tolist()]
    calls = [decode(row, what) for row, what in zip(rows.tolist(), words, strict=True)]
    raise CollectiveMismatch(explain(comm.rank, calls))


def explain(rank: int, calls: list[Call]) -> str:
    lines = [f"rank {rank}: ranks disagree on the next collective (call #{calls[rank].seq} here); "
             f"stopped before any data moved. Each rank was about to run:"]
    lines += [f"  rank {r}: {c.describe()}" for r, c in enumerate(calls)]
    lines.append(f"Likely cause: {likely_cause(calls)}")
    return "\n".join(lines)


def likely_cause(calls: list[Call]) -> str:
    """The most specific explanation the differing fields allow."""
    def differ(field):
        return len({field(c) for c in calls}) > 1

    tags = [c.tag for c in calls]
    if differ(lambda c: c.tag.syncing) and all(t.syncing >= 0 for t in tags):
        return ("some ranks are synchronising gradients while others are inside no_sync(): enter no_sync() "
                "on every rank alike, for the same micro-batches.")
    if differ(lambda c: c.tag.step) and all(t.step >= 0 for t in tags):
        return "ranks have taken a different number of optimizer steps: call step() on every rank alike."
    if differ(lambda c: c.tag.backward) and all(t.backward >= 0 for t in tags):
        return ("ranks reached this collective after a different number of backward passes: no_sync() was "
                "entered on some ranks only (one rank synchronised a micro-batch the others accumulated), "
                "or ranks ran a different number of micro-batches.")
    whats = [t.what for t in tags]
    if differ(lambda c: c.tag.what) and any("gradients" in w for w in whats) and any("all-gather" in w for w in whats):
        return ("a parameter got a gradient on some ranks only: a unit's gradients are reduced as soon as all of "
                "them are ready, so that reduce-scatter came earlier on some ranks than on others. Use every "
                "parameter on every rank, or pass find_unused_parameters=True.")
    if differ(lambda c: c.tag.what) and all("unit" in w and "all-gather" in w for w in whats):
        return ("ZeRO-3 gathers each unit as it is called: a module was called a different number of times, "
                "or in a different order, on different ranks (data-dependent control flow?).")
    if differ(lambda c: (c.kind, c.tag.what)):
        return ("ranks issued collectives in a different order: something that communicates -- "
                "clip_grad_norm_, step(), a backward, a state_dict -- ran on some ranks only.")
    if differ(lambda c: (c.numel, c.dtype)):
        return ("the same collective carries tensors of different sizes: the ranks hold different "
                "models, or a parameter got a gradient on some ranks only.")
    if differ(lambda c: c.op):
        return "ranks asked for different reductions (op or source rank) in the same call."
    return "ranks issued a different number of collectives on this Comm before this one."
