"""A rank stuck in its own code: the deadline that sees it, and where it is -- a stack sample.

A rank that loops in its own code -- no collective in progress -- is no stall:
no collective waits on the progress board (:mod:`minizero.comm.progress`) when
every rank loops.  :func:`outside_collectives` is the deadline for it: so long in
no collective within one task.  Before the launcher stops such a rank it asks
where the rank is, so the verdict can name the function and the line, as
``py-spy dump`` would.

The answer comes from a watcher thread in the rank: it sleeps on an event until
asked, then reads the main thread's frames (``sys._current_frames``) -- a Python
loop gives up the GIL every few milliseconds, so the watcher runs beside it --
and writes them to shared memory.  A rank that does not answer in time (frozen,
or stuck in native code that holds the GIL) gets no sample: the verdict says so.
"""
from __future__ import annotations

import json
import linecache
import sys
import threading
import time
from dataclasses import dataclass

from ..comm import progress

TEXT = 16384  # bytes of shared memory per rank: frames are dropped from the outermost until they fit
FRAMES = 60  # at most this many frames, the innermost


def outside_collectives(records: list[dict], now: float, started: float, idle_s: float,
                        finished) -> tuple[str, list[int]] | None:
    """The ranks that, in the task submitted at ``started``, have been in no collective for ``idle_s`` seconds
    (from the latest of its submission, the rank taking it up, and its last collective's end), as ``(message, ranks)``;
    None if none has.  ``finished``: the ranks done with the task."""
    late = [r for r, row in enumerate(records) if r not in finished and row["state"] == progress.IDLE
            and now - max(started, row["left"], row.get("task", 0.0)) > idle_s]
    if not late:
        return None
    who = ", ".join(f"rank {r}" for r in late)
    return f"{who} spent more than {idle_s:g} s of this task in no collective (the limit): looping or stuck in its own code", late


@dataclass(frozen=True)
class Frame:
    """One frame of a sample: the file, the line, the function's qualified name (``DDP.post_backward``)
    and the line's source."""

    filename: str
    lineno: int
    function: str
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}" + (f": {self.line}" if self.line else "")


def frames_of(frame) -> list[Frame]:
    """``frame`` and its callers, outermost first."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(Frame(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name),
                         linecache.getline(code.co_filename, frame.f_lineno).strip()))
        frame = frame.f_back
    return out[::-1]


def _encode(frames: list[Frame]) -> bytes:
    frames = frames[-FRAMES:]
    while True:
        text = json.dumps([[f.filename, f.lineno, f.function, f.line[:200]] for f in frames]).encode()
        if len(text) < TEXT or not frames:
            return text
        frames = frames[1:]


class StackSampler:
    """One rank's sampler: built by the launcher before the rank starts (its events and buffer are shared),
    :meth:`serve` in the rank, :meth:`ask` and :meth:`answer` in the launcher."""

    def __init__(self, context):
        self._asked = context.Event()
        self._answered = context.Event()
        self._text = context.RawArray("c", TEXT)

    # ---------------------------------------------------------------- in the rank
    def serve(self) -> None:
        """Start the watcher thread that answers for this process's main thread (call it from there)."""
        main = threading.get_ident()

        def watch():
            while True:
                self._asked.wait()
                self._asked.clear()
                frame = sys._current_frames().get(main)
                self._text.value = _encode(frames_of(frame) if frame is not None else [])
                del frame
                self._answered.set()

        threading.Thread(target=watch, name="minizero-stack-sampler", daemon=True).start()

    # ---------------------------------------------------------------- in the launcher
    def ask(self) -> None:
        self._answered.clear()
        self._asked.set()

    def answer(self, until: float) -> list[Frame] | None:
        """The frames (outermost first) once the rank answered, or None if it did not by ``until`` (monotonic)."""
        if not self._answered.wait(max(0.0, until - time.monotonic())):
            return None
        return [Frame(*f) for f in json.loads(self._text.value.decode(errors="replace"))]


def sample(samplers: dict[int, StackSampler], wait_s: float = 2.0) -> dict[int, list[Frame] | None]:
    """Every rank's sample, asked at once; a rank that does not answer within ``wait_s`` gets None."""
    for sampler in samplers.values():
        sampler.ask()
    until = time.monotonic() + wait_s
    return {rank: sampler.answer(until) for rank, sampler in samplers.items()}


# ------------------------------------------------------------------------------------- a rank that dies by a signal
def stacks_on_fatal_signal(path: str):
    """From now on, a fatal signal in this process (gloo aborts a rank whose peer broke; a segfault) writes every
    thread's Python stack to ``path`` -- not to the terminal the ranks share with whoever started them, where a
    test that breaks a collective on purpose would print pages of thread dumps.  The launcher reads it back into
    the :class:`~minizero.run.launch.RankError` (:func:`last_stack`).  Returns the open file: faulthandler writes to it
    only while it stays open, so the caller keeps it for the process's life."""
    import faulthandler
    crash_file = open(path, "w")  # noqa: SIM115 -- held open on purpose, see above
    faulthandler.enable(file=crash_file, all_threads=True)
    return crash_file


def last_stack(path: str, lines: int = 40) -> str:
    """What :func:`stacks_on_fatal_signal` wrote: the signal and the thread that took it first, at most ``lines``
    lines; "" when the rank wrote nothing (it exited, or was killed by SIGKILL, which no handler sees)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    blocks = text.strip().split("\n\n")
    current = [b for b in blocks if b.startswith("Current thread")]
    chosen = ([blocks[0]] if blocks[0].startswith("Fatal Python error") else []) + current[:1]
    return "\n".join("\n\n".join(chosen or blocks[:1]).splitlines()[:lines]) if text.strip() else ""
