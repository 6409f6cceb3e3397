"""A learner's error, in words: what raised on a rank and where in their file (:class:`Raised`), and -- when the
error surfaced in torch, far from its cause -- the last line of theirs that ran (:class:`LastOfYours`).  A rank
reports a :class:`Raised` as a value, so the checker can keep its pool when every rank raised alike."""
from __future__ import annotations

import contextlib
import functools
import linecache
import sys
import threading
import traceback
from dataclasses import dataclass

from ...comm import OutOfStep
from .loading import shown


@dataclass
class Raised:
    """An exception on a rank, in words: its type, message and the last frame in the learner's file."""

    rank: int
    kind: str
    message: str
    where: str

    @classmethod
    def now(cls, rank: int, error: BaseException, path: str | None, last_of_yours: str = "") -> "Raised":
        """``last_of_yours``: the learner's last line that ran, said when the traceback holds none of theirs.  A
        collective refused after an earlier one failed part-way is told by that failure, its cause."""
        while isinstance(error, OutOfStep) and error.__cause__ is not None:
            error = error.__cause__
        frames = traceback.extract_tb(error.__traceback__)
        mine = [f for f in frames if path and f.filename == path]
        if not mine and last_of_yours:
            at = frames[-1]
            where = (f"{last_of_yours}\n    (the last line of yours that ran: the error itself was raised in "
                     f"{shown(at.filename)}:{at.lineno} in {at.name}, which runs no code of yours"
                     + (" -- torch's autograd engine, during backward" if "autograd" in at.filename else "") + ")")
            return cls(rank, type(error).__name__, str(error).split("\n")[0], where)
        mine = mine or frames[-1:]
        where = f"{shown(mine[-1].filename)}:{mine[-1].lineno} in {mine[-1].name}: {mine[-1].line}" if mine else ""
        message = str(error).split("\n")[0]
        if isinstance(error, (AttributeError, TypeError)) and "'NoneType' object" in message:
            message += _without_grad(rank, error, path)
        return cls(rank, type(error).__name__, message, where)

    def __str__(self) -> str:
        return f"rank {self.rank} raised {self.kind}: {self.message}" + (f"\n    at {self.where}" if self.where else "")


def _without_grad(rank: int, error: BaseException, path: str | None) -> str:
    """A None where a tensor was expected, in the learner's method: most often a parameter's ``.grad`` -- which
    ones had none is read off the module their method was working on (``self.module``) at that moment."""
    module = None
    tb = error.__traceback__
    while tb is not None:
        if path and tb.tb_frame.f_code.co_filename == path:
            module = getattr(tb.tb_frame.f_locals.get("self"), "module", module)
        tb = tb.tb_next
    names = [] if module is None or not hasattr(module, "named_parameters") else [
        f"{name} ({'frozen: requires_grad is False' if not p.requires_grad else 'not used in this backward'})"
        for name, p in module.named_parameters() if p.grad is None]
    if names:
        return (f" (a None where a tensor was expected: at that moment rank {rank}'s "
                f"{', '.join(names)} had no .grad -- skip a parameter whose .grad is None)")
    return (" (a None where a tensor was expected -- a parameter without a .grad? A frozen parameter never has one, "
            "an unused one not in this step: the checker's edge model has both)")




#: Frames between a call and the function it reaches: a ``@contextmanager``'s body runs from ``contextlib``'s
#: ``__enter__``, a ``functools.partial`` from ``functools``.
PASSING_THROUGH = {contextlib.__file__, functools.__file__}


def calling(frame):
    """The frame that called ``frame``'s function, past :data:`PASSING_THROUGH` (``with no_sync(self):``)."""
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename in PASSING_THROUGH:
        caller = caller.f_back
    return caller


def handed_back(event: str, arg):
    """A ``@contextmanager``'s body handed back by a returning frame (``return no_sync(self)``: the caller's ``with``
    runs it, after that frame is gone), as its code; else None."""
    return getattr(getattr(arg, "gen", None), "gi_code", None) if event == "return" else None


class LastOfYours:
    """The last line of the learner's file that ran, on any thread.  An error raised inside torch's autograd engine
    -- a unit not gathered for backward, a gradient of the wrong size -- has no frame of the learner's in its
    traceback: it surfaces in ``backward()``, far from the line that caused it.  The line that ran last is where
    to look.  Only frames of the learner's file are traced line by line; every other call costs one comparison.

    It also watches for the answer key (``answers``: ``{code: name}``, :func:`~minizero.course.labs.yours.answer_key`)
    called from the learner's file -- in every run of every property, on every rank and thread, where "your methods
    are what runs" watches one run: a file that calls the answer only at N = 3 passed that (issue 45).
    ``answered``: ``{answer's code: the learner's calling code}``."""

    def __init__(self, path: str | None, answers: dict | None = None):
        self.path, self.frame, self.lineno = path, None, 0
        self.answers, self.answered = answers or {}, {}

    def _trace(self, frame, event, arg):
        if frame.f_code.co_filename != self.path:
            caller = calling(frame) if frame.f_code in self.answers else None
            if caller is not None and caller.f_code.co_filename == self.path:
                self.answered.setdefault(frame.f_code, caller.f_code)
            return None
        self.frame, self.lineno = frame.f_code, frame.f_lineno
        return self._line

    def _line(self, frame, event, arg):
        self.frame, self.lineno = frame.f_code, frame.f_lineno
        handed = handed_back(event, arg)
        if handed in self.answers:
            self.answered.setdefault(handed, frame.f_code)
        return self._line

    def __enter__(self):
        if self.path:
            threading.settrace(self._trace)
            sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        if self.path:
            sys.settrace(None)
            threading.settrace(None)

    def where(self) -> str:
        if self.frame is None:
            return ""
        line = linecache.getline(self.path, self.lineno).strip()
        return f"{shown(self.path)}:{self.lineno} in {self.frame.co_name}: {line}"


