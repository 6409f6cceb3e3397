"""Is the learner's code what runs?  Each method a lab asks for must be written in the learner's file
(:func:`learners_methods`), called by a training step, and not hand the work to the package's own finished
method -- the answer key (:func:`never_called`).  A skeleton's base has the lab's methods taken out
(:func:`minizero.course.labs.given.without`), so an empty class or a deleted method runs a blank that raises; what
is left to catch here is the learner's method calling the package's answer by name (``PackageDDP.post_backward(self)``),
and a stage that builds the skeleton's class instead of theirs (:class:`RanAnother`)."""
from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback

from .given import set_yours
from .loading import Impl, load_file, shown
from .raised import Raised, calling, handed_back


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


class RanAnother(Exception):
    """A step ran the skeleton's or the lab base's copy of a method the learner's file defines: the stage does not
    build the learner's class (a ``unit_class`` left as the skeleton's, say) -- none of their code ran."""

    @classmethod
    def of(cls, error: "BaseException | Raised", todos, path: str) -> "RanAnother | None":
        """Is ``error`` a lab method's blank raising ``write Class.method`` -- in a file other than the learner's
        ``path`` (their own blank method is theirs to write, and the properties say so)?  Then which, in words."""
        chain, seen = [], error
        while isinstance(seen, BaseException) and seen not in chain:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        elsewhere = [e for e in chain if isinstance(e, NotImplementedError) and e.__traceback__ is not None
                     and not _same_file(traceback.extract_tb(e.__traceback__)[-1].filename, path)]
        messages = [str(e) for e in elsewhere] if chain else (
            [error.message] if isinstance(error, Raised) and error.kind == "NotImplementedError"
            and not error.where.startswith(f"{shown(path)}:") else [])
        ran = next((todo for m in messages for todo in todos if m.startswith(f"write {todo}")), None)
        if ran is None:
            return None
        owner = ran.split(".")[0]
        return cls(f"your file defines {ran}, but a step ran another {owner}'s, which raises (the skeleton's or the "
                   f"lab's base's): the stage does not build your {owner}{set_yours(owner)}")


def learners_methods(impl: Impl) -> tuple[dict, list[str]]:
    """``({code: "Class.method"}, problems)``: each lab method the learner's file defines itself, and, in words,
    each it does not -- it would inherit the skeleton's (which raises) or the package's."""
    module = load_file(impl.path)
    mine, problems = {}, []
    for todo in impl.lab.todo:
        owner, method = todo.split(".")
        cls = getattr(module, owner, None)
        fn = inspect.unwrap(getattr(cls, method, None)) if cls is not None else None
        code = getattr(fn, "__code__", None)
        if code is None or os.path.realpath(code.co_filename) != os.path.realpath(impl.path):
            problems.append(f"your file does not define {todo}" + (
                f" (your {owner} inherits it: it would run {_where(code)}, not yours)" if code is not None else ""))
        else:
            mine[code] = todo
    return mine, problems


def never_called(impl: Impl, mine: dict, run) -> list[str] | None:
    """``run()`` watched on every thread (a communication thread it starts too): the ``mine`` methods it never
    called; None when it raised or returned a :class:`Raised` -- whether they run is then unknown, and the
    properties report the error, on the smallest case they find -- unless what raised is a blank copy of one of
    ``mine`` (:class:`RanAnother`, raised), or the package's own answer to one of them ran (:class:`CalledTheAnswer`,
    raised: reached only by name, since the skeleton's base replaced it)."""
    called, answers, answered = set(), answer_key(impl), {}

    def profile(frame, event, arg):
        handed = handed_back(event, arg) if frame.f_code in mine else None
        if handed in answers and handed not in answered:
            answered[handed] = mine[frame.f_code]
        if event != "call":
            return
        if frame.f_code in mine:
            called.add(frame.f_code)
        elif frame.f_code in answers and frame.f_code not in answered:
            caller = calling(frame)
            answered[frame.f_code] = mine.get(caller.f_code) if caller is not None else None

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        result = run()
    except Exception as error:  # noqa: BLE001 -- a method that raises (a blank one) is the properties' to report
        result = error
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if answered:
        raise CalledTheAnswer.of(answered, answers)
    if isinstance(result, (Exception, Raised)):
        another = RanAnother.of(result, mine.values(), impl.path)
        if another is not None:  # a blank copy of the learner's own method ran: the verdict is here
            raise another
        return None
    return [todo for code, todo in mine.items() if code not in called]


def probe(rank: int, impl: Impl, run, not_called) -> list[str] | Raised | None:
    """A lab's "your methods are what runs", on one rank: each of the lab's methods written in the learner's file
    (:func:`learners_methods`) and each called by ``run()`` (:func:`never_called`) -- [] when all are; the missing
    and the uncalled in words (``not_called(never)``: where they were not called and what to look at, after "your
    X is/are never called"); None when ``run()`` raised (the properties report it); what the probe itself raised,
    as the rank's."""
    try:
        mine, problems = learners_methods(impl)
        if problems:
            return problems
        never = never_called(impl, mine, run)
        if never:
            return [f"your {', '.join(never)} {'is' if len(never) == 1 else 'are'} never called {not_called(never)}"]
        return never
    except RanAnother as another:  # a blank copy of the learner's own method ran, or the package's answer did
        return [str(another)]
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(rank, error, impl.path)


def answer_key(impl: Impl) -> dict:
    """``{code: "DDP.post_backward"}``: the package's finished method for each lab method of ``impl``, found in the
    learner's classes' bases (:func:`minizero.course.labs.given.without` keeps each one it takes out)."""
    module, answers = load_file(impl.path), {}
    for todo in impl.lab.todo:
        owner, method = todo.split(".")
        for base in getattr(getattr(module, owner, None), "__mro__", ()):
            answer = vars(base).get("__answers__", {}).get(method)
            if answer is not None:
                # named by the package's class, whichever file it takes the method from (Stage's no_sync)
                answers[inspect.unwrap(answer).__code__] = f"{base.__bases__[0].__name__}.{method}"
                for function in vars(base).get("__delegates__", {}).get(method, ()):  # where it does its work
                    answers[inspect.unwrap(function).__code__] = f"{function.__module__.rsplit('.', 1)[-1]}.{function.__qualname__}"
                break
    return answers


class CalledTheAnswer(RanAnother):
    """A learner's method ran the package's own finished method -- ``PackageDDP.post_backward(self)``: the step is
    right, and none of it is theirs."""

    @classmethod
    def of(cls, answered: dict, answers: dict) -> "CalledTheAnswer":
        said = [f"{'your ' + caller if caller else 'your code'} calls minizero's own {answers[code]} "
                f"({_where(code)})" for code, caller in answered.items()]
        return cls(f"{'; '.join(said)}: the package's finished method, the lab's answer -- the checker judges your "
                   f"code, so write what it does in your method (the helpers it calls -- the communication layer, "
                   f"flat buffers, the stage's hooks -- are yours to call)")


def _where(code) -> str:
    """Where an inherited method is written: the package's file, or the skeleton's (which only raises)."""
    return f"{shown(code.co_filename)}:{code.co_firstlineno}"


