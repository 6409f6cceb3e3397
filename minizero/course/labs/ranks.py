"""What runs on each rank for the checker: an experiment with the learner's class, a probe of
overlap, one round of collectives.  A rank reports its own exception as a value, so the checker can
keep the pool when every rank raised alike (:meth:`~minizero.course.labs.check.Checker.on_ranks`): a blank
skeleton then costs no process spawn per example."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

from ...comm import Ledger, ReduceOp
from ...run.launch import Rank
from ..harness.experiment import build, run_experiment
from ..harness.overlap import backward_launches
from ..harness.tasks import TASKS
from .loading import Impl
from .raised import LastOfYours, Raised
from .yours import CalledTheAnswer, answer_key, probe


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
    last = LastOfYours(impl.path, answer_key(impl) if impl.path else None)
    try:
        with last:
            result = run_experiment(me, replace(exp, stages=impl.stages()))
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(me.rank, error, impl.path, last.where())
    if last.answered:  # right values, none of them the learner's
        called = {code: caller.co_qualname for code, caller in last.answered.items()}
        return Raised.now(me.rank, CalledTheAnswer.of(called, last.answers), impl.path)
    return result


def yours_run(me: Rank, impl: Impl, exp) -> list[str] | Raised | None:
    """What of the lab's methods (``Class.method``) the learner's file does not define itself -- an empty
    class, or a deleted method, inherits the package's finished one: the answer, not theirs -- or defines but
    one step of ``exp`` never calls (a class the stage does not use, say): each in words; [] when all run; None
    when the step raised (whether they run is then unknown: the properties report the error)."""
    return probe(me.rank, impl, lambda: run_experiment(me, replace(exp, stages=impl.stages())),
                 lambda never: f"in a training step: is your {' and '.join(sorted({t.split('.')[0] for t in never}))} "
                               f"the class the stage uses?")


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
