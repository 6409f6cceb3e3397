"""What runs on each rank for the checker: an experiment with the learner's class, a probe of
overlap, one round of collectives.  A rank reports its own exception as a value, so the checker can
keep the pool when every rank raised alike (:meth:`~minizero.course.labs.check.Checker.on_ranks`): a blank
skeleton then costs no process spawn per example."""
from __future__ import annotations

import inspect
import linecache
import os
import sys
import threading
import traceback
from dataclasses import dataclass, replace

import torch

from ...comm import Ledger, ReduceOp
from ...run.launch import Rank
from ..harness.experiment import build, run_experiment
from ..harness.overlap import backward_launches
from ..harness.tasks import TASKS
from .given import set_yours
from .loading import Impl, load_file, shown


@dataclass
class Raised:
    """An exception on a rank, in words: its type, message and the last frame in the learner's file."""

    rank: int
    kind: str
    message: str
    where: str

    @classmethod
    def now(cls, rank: int, error: BaseException, path: str | None, last_of_yours: str = "") -> "Raised":
        """``last_of_yours``: the learner's last line that ran, said when the traceback holds none of theirs."""
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
        return cls(rank, type(error).__name__, str(error).split("\n")[0], where)

    def __str__(self) -> str:
        hint = (" (a None where a tensor was expected -- a parameter without a .grad? A frozen parameter never has "
                "one, an unused one not in this step: the checker's edge model has both)"
                if self.kind in ("AttributeError", "TypeError") and "'NoneType' object" in self.message else "")
        return f"rank {self.rank} raised {self.kind}: {self.message}{hint}" + (
            f"\n    at {self.where}" if self.where else "")


def import_file(me: Rank, impl: Impl) -> str | Raised:
    """Import the learner's file on this rank and find its class: the class's name, or what the import raised
    -- a ``sys.exit()`` too (a ``SystemExit``), which would otherwise end the rank without a verdict."""
    try:
        return impl.cls().__qualname__
    except BaseException as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(me.rank, error, impl.path)


def lab_experiment(me: Rank, impl: Impl, exp):
    """This rank's result of ``exp`` with the learner's stage (``exp.stage`` names it) -- or what it raised, traced
    back to the learner's last line that ran when the error surfaced elsewhere (:class:`LastOfYours`)."""
    last = LastOfYours(impl.path)
    try:
        with last:
            return run_experiment(me, replace(exp, stages=impl.stages()))
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(me.rank, error, impl.path, last.where())


class LastOfYours:
    """The last line of the learner's file that ran, on any thread.  An error raised inside torch's autograd engine
    -- a unit not gathered for backward, a gradient of the wrong size -- has no frame of the learner's in its
    traceback: it surfaces in ``backward()``, far from the line that caused it.  The line that ran last is where
    to look.  Only frames of the learner's file are traced line by line; every other call costs one comparison."""

    def __init__(self, path: str | None):
        self.path, self.frame, self.lineno = path, None, 0

    def _trace(self, frame, event, arg):
        if frame.f_code.co_filename != self.path:
            return None
        self.frame, self.lineno = frame.f_code, frame.f_lineno
        return self._line

    def _line(self, frame, event, arg):
        self.frame, self.lineno = frame.f_code, frame.f_lineno
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


def yours_run(me: Rank, impl: Impl, exp) -> list[str] | Raised | None:
    """What of the lab's methods (``Class.method``) the learner's file does not define itself -- an empty
    class, or a deleted method, inherits the package's finished one: the answer, not theirs -- or defines but
    one step of ``exp`` never calls (a class the stage does not use, say): each in words; [] when all run; None
    when the step raised (whether they run is then unknown: the properties report the error)."""
    try:
        mine, problems = learners_methods(impl)
        if problems:
            return problems
        never = never_called(mine, lambda: run_experiment(me, replace(exp, stages=impl.stages())), impl.path)
        if never:
            owners = sorted({todo.split(".")[0] for todo in never})
            return [f"your {', '.join(never)} {'is' if len(never) == 1 else 'are'} never called in a training "
                    f"step: is your {' and '.join(owners)} the class the stage uses?"]
        return never
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        if isinstance(error, RanAnother):
            return [str(error)]
        return Raised.now(me.rank, error, impl.path)


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


def never_called(mine: dict, run, path: str) -> list[str] | None:
    """``run()`` watched on every thread (a communication thread it starts too): the ``mine`` methods it never
    called; None when it raised or returned a :class:`Raised` -- whether they run is then unknown, and the
    properties report the error, on the smallest case they find -- unless what raised is a blank copy of one of
    ``mine`` (:class:`RanAnother`, raised)."""
    called: set = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in mine:
            called.add(frame.f_code)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        result = run()
    except Exception as error:  # noqa: BLE001 -- a method that raises (a blank one) is the properties' to report
        result = error
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if isinstance(result, (Exception, Raised)):
        another = RanAnother.of(result, mine.values(), path)
        if another is not None:  # a blank copy of the learner's own method ran: the verdict is here
            raise another
        return None
    return [todo for code, todo in mine.items() if code not in called]


def _where(code) -> str:
    """Where an inherited method is written: the package's file, or the skeleton's (which only raises)."""
    return f"{shown(code.co_filename)}:{code.co_firstlineno}"


def overlap_probe(me: Rank, impl: Impl, exp) -> list[dict] | Raised:
    """:func:`minizero.course.harness.overlap.backward_launches` with the learner's stage -- or what it raised."""
    try:
        return backward_launches(me, replace(exp, stages=impl.stages()))
    except Exception as error:  # noqa: BLE001
        return Raised.now(me.rank, error, impl.path)


def collectives_round(me: Rank, impl: Impl, numel: int, dtype: str, seed: int) -> dict | Raised:
    """The learner's ring on small integer-valued tensors (every sum exact): each collective's result,
    expected result, bytes and messages, on this rank."""
    try:
        comm = impl.cls()(None, check=True)
        n, r = me.world_size, me.rank
        dt = getattr(torch, dtype)

        def data(rank: int, size: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed * 131 + rank)
            return torch.randint(-64, 64, (size,), generator=g).to(dt)

        shard = -(-numel // n)  # reduce-scatter and all-gather: equal shards, the caller pads
        cases = {}
        everyone = [data(q, numel) for q in range(n)]
        padded = [data(q, shard * n) for q in range(n)]
        expected = {
            "all_reduce SUM": torch.stack(everyone).sum(0),
            "all_reduce AVG": torch.stack(everyone).sum(0) / n,
            "all_reduce MAX": torch.stack(everyone).amax(0),
            "reduce_scatter SUM": torch.stack(padded).sum(0)[r * shard:(r + 1) * shard],
            "all_gather": torch.cat([p[q * shard:(q + 1) * shard] for q, p in enumerate(padded)]),
        }
        for name in expected:
            ledger = Ledger()
            comm.add_observer(ledger)
            given = None  # the caller's input, which only the all-reduce (in place) may change
            if name.startswith("all_reduce"):
                got = everyone[r].clone()
                comm.all_reduce(got, ReduceOp[name.split()[1]])
            elif name.startswith("reduce_scatter"):
                got, given = torch.full((shard,), float("nan"), dtype=dt), padded[r].clone()
                comm.reduce_scatter(got, given, ReduceOp.SUM)
            else:
                got, given = torch.full((shard * n,), float("nan"), dtype=dt), padded[r][r * shard:(r + 1) * shard].clone()
                comm.all_gather(got, given)
            comm.remove_observer(ledger)
            kind = name.split()[0]
            cases[name] = {"got": got, "expected": expected[name], "kind": kind, "sent": ledger.sent[kind],
                           "messages": ledger.messages[kind], "numel": shard * n if kind != "all_reduce" else numel,
                           "input": None if given is None else (given, padded[r] if kind == "reduce_scatter"
                                                               else padded[r][r * shard:(r + 1) * shard])}
        comm.close()
        return cases
    except Exception as error:  # noqa: BLE001
        return Raised.now(me.rank, error, impl.path)


def no_sync_probe(me: Rank, impl: Impl, exp) -> list[str] | Raised:
    """``no_sync()`` as users write it around torch DDP: nested (a helper that accumulates, called inside a block
    of the user's own), and left by an exception (a skipped micro-batch, a KeyboardInterrupt in a notebook).  What
    is judged is what a backward sends after each -- nothing inside a block, the gradients once outside -- not
    the flag: the problems, in words ([] when it behaves)."""
    try:
        stage, model, comm, _ = build(me, replace(exp, stages=impl.stages()))
        ledger = Ledger()
        comm.add_observer(ledger)
        task = TASKS[exp.task]
        x, y = task.make_batch(2 * me.world_size, exp.seed, 0, torch.float64, **exp.model)

        def sends() -> int:
            before = sum(ledger.snapshot().values())
            stage(x[me.rank::me.world_size]).pow(2).sum().backward()
            return sum(ledger.snapshot().values()) - before

        problems = []
        with stage.no_sync():
            with stage.no_sync():
                pass
            if sends():
                problems.append("a backward inside a no_sync() block, after a no_sync() nested in it had ended, sent "
                                "gradients: leaving the inner block turned synchronisation back on -- put back the "
                                "value it had before the block, not True")
        if not sends():
            problems.append("a backward after nested no_sync() blocks ended sent nothing: synchronisation was not "
                            "turned back on")
        try:
            with stage.no_sync():
                raise KeyError("raised inside no_sync()")
        except KeyError:
            pass
        if not sends():
            problems.append("after an exception left a no_sync() block, backward sent nothing: synchronisation stayed "
                            "off for good -- restore it in a finally: (or a try/finally around the yield)")
        comm.close()
        return [f"rank {me.rank}: {p}" for p in problems]
    except Exception as error:  # noqa: BLE001
        return Raised.now(me.rank, error, impl.path)


def stderr_to(me: Rank, directory: str, fn, *args):
    """``fn(me, *args)`` with this rank's C-level stderr in ``directory/rank<r>.stderr`` (truncated first).  gloo
    prints its abort -- a dozen lines of C++ ending in a ``what():`` -- there, not to the learner's terminal before the
    verdict; the checker reads the one line that says what happened (:func:`gloo_words`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(os.path.join(directory, f"rank{me.rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        return fn(me, *args)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def gloo_words(directory: str) -> str:
    """What gloo said before a rank died, in one line per rank that said something: its ``what():`` (the enforce
    that failed: "op.preamble.length <= op.nbytes. 72 vs 8 ...")."""
    said = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        what = [line for line in lines if line.startswith("what():") or "Error" in line or "error" in line]
        if what:
            words = what[0].removeprefix("what():").strip()
            words = words.split("] ", 1)[1] if words.startswith("[enforce fail") and "] " in words else words
            said.append(f"{name.removesuffix('.stderr').replace('rank', 'rank ')}: {words}")
    return "; ".join(said)
