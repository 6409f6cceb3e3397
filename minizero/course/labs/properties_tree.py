"""The tree lab's properties: exact results, the tree's latency and bytes, and training over it.

* **results** -- drawn as the ring lab draws them (world sizes 1-4, 0-40 elements, float64 and float32):
  all-reduce SUM, AVG and MAX of small integers, every sum exact, so any wrong element is a wrong answer.
* **rounds and bytes** -- at every world size 1-4: the rounds on the critical path, counted from the order of the
  messages every rank sent and received (:mod:`minizero.course.labs.rounds`), at most ``2 ceil(log2 N)``; and each
  rank's bytes, as the ledger counted them, exactly the binomial tree's (:func:`~minizero.comm.tree.tree_bytes_sent`).
  A chain sends as few bytes per rank as a tree and fails here on its ``2(N-1)`` rounds.
* **training** -- DDP and bucketed DDP over the learner's tree equal single-device training.

A cost failure is compared with the known mistakes (:mod:`minizero.course.labs.mistakes_tree`) on the same case.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from ...comm import Ledger, ReduceOp
from ...comm.tree import tree_bytes_sent, tree_children, tree_rounds
from ...run.launch import Rank
from ...stages import DDP, BucketedDDP
from ..harness.diagnosis import what_is_wrong
from ..harness.experiment import Experiment, reference_of
from .failed import Failed, describe
from .loading import Impl
from .mistakes_tree import TREE_MISTAKES
from .raised import Raised
from .rounds import SENDS, critical_path, recorded

OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)


def tree_round(me: Rank, impl: Impl, numel: int, dtype: str, seed: int) -> dict | Raised:
    """The learner's all-reduce -- SUM, AVG and MAX -- on small integer-valued tensors (every sum exact): on this
    rank, each result, the expected result, the bytes and messages the ledger counted, and every send and receive
    it made, in order."""
    try:
        comm = impl.cls()(None, check=True)
        n, r = me.world_size, me.rank
        dt = getattr(torch, dtype)

        def data(rank: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed * 131 + rank)
            return torch.randint(-64, 64, (numel,), generator=g).to(dt)

        everyone = torch.stack([data(q) for q in range(n)])
        expected = {ReduceOp.SUM: everyone.sum(0), ReduceOp.AVG: everyone.sum(0) / n, ReduceOp.MAX: everyone.amax(0)}
        cases = {}
        for op in OPS:
            got, ledger = everyone[r].clone(), Ledger()
            with ledger.attached(comm), recorded(comm, "all_reduce") as events:
                comm.all_reduce(got, op)
            cases[f"all_reduce {op.name}"] = {"got": got, "expected": expected[op], "mine": everyone[r],
                                              "sent": ledger.sent["all_reduce"],
                                              "messages": ledger.messages["all_reduce"], "events": list(events)}
        comm.close()
        return cases
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(me.rank, error, impl.path)


def _case(n: int, numel: int, dtype: str, seed: int) -> str:
    return f"world size {n}, tensors of {numel} element(s), {dtype}, data seed {seed}"


def _first_raised(rounds: list) -> Raised | None:
    return next((r for r in rounds if isinstance(r, Raised)), None)


# ------------------------------------------------------------------ results
def wrong_value(rounds: list, n: int) -> str | None:
    """The first wrong element, in words, with what it looks like when that says something."""
    for rank, cases in enumerate(rounds):
        for name, case in cases.items():
            got, want = case["got"], case["expected"]
            if got.shape == want.shape and got.eq(want).all():
                continue
            i = int((got != want).nonzero()[0]) if got.shape == want.shape else 0
            said = (f"{name} on rank {rank}: element {i} is {got.reshape(-1)[i].item() if got.numel() else 'missing'}, "
                    f"should be {want.reshape(-1)[i].item()}")
            summed = _summed_over(got, [cases_of[name]["mine"] for cases_of in rounds], name, n)
            if n > 1 and torch.equal(got, case["mine"]):
                said += f" -- rank {rank}'s result is its own input: nothing reached it"
            elif summed is not None:
                missing = [q for q in range(n) if q not in summed]
                said += (f" -- the {name.split()[1].lower()} over ranks {summed} only: the tensor of rank(s) {missing} "
                         f"never entered it")
            elif name.endswith("AVG") and torch.equal(got * n, want):
                said += f" -- 1/{n} of the mean: divided by N twice (the given all_reduce divides once, at rank 0)"
            elif name.endswith("MAX") and not any("SUM" in k and not cases[k]["got"].eq(cases[k]["expected"]).all()
                                                  for k in cases):
                said += " -- the sums are right: combine what arrives with op.combine, which is a max for MAX"
            return said
    return None


def _summed_over(got: torch.Tensor, inputs: list[torch.Tensor], name: str, n: int) -> list[int] | None:
    """The one proper subset of ranks whose inputs reduce to ``got`` (SUM, AVG divided by N, MAX), if exactly one
    does: which contributions a wrong result is missing."""
    if not got.numel():
        return None
    op = name.split()[1]
    found = []
    for mask in range(1, (1 << n) - 1):
        ranks = [q for q in range(n) if mask >> q & 1]
        parts = torch.stack([inputs[q] for q in ranks])
        value = parts.amax(0) if op == "MAX" else parts.sum(0) / (n if op == "AVG" else 1)
        if torch.equal(value, got):
            found.append(ranks)
    return found[0] if len(found) == 1 else None


def results(checker) -> str:
    strategy = st.tuples(st.sampled_from([1, 2, 3, 4]), st.integers(0, 40), st.sampled_from(["float64", "float32"]),
                         st.integers(0, 1000))

    def examine(drawn):
        n, numel, dtype, seed = drawn
        rounds = checker.on_ranks(n, tree_round, checker.impl, numel, dtype, seed)
        raised = _first_raised(rounds)
        problem = str(raised) if raised else wrong_value(rounds, n)
        return (problem, None) if problem else None

    checker.search(strategy, examine, _case)
    checker.fixed(FIXED_RESULTS, examine, _case)  # every world size whatever is drawn: a few draws miss N = 2
    return (f"{checker.examples} drawn examples: all-reduce SUM, AVG and MAX give exact results at world sizes 1-4, "
            f"tensors of 0-40 elements; then each world size 1-4 whatever is drawn")


#: (world size, elements, dtype, data seed): tried after the draws -- fewer elements than ranks at N = 4.
FIXED_RESULTS = ((1, 5, "float64", 1), (2, 5, "float32", 2), (3, 7, "float64", 3), (4, 3, "float32", 4))


# ------------------------------------------------------------------ rounds and bytes
def rounds_problem(rounds: list, n: int) -> str | None:
    """The rounds on the critical path, if more than the tree's, in words."""
    for name in rounds[0]:
        path = critical_path([cases[name]["events"] for cases in rounds])
        if path is None:
            return f"{name}: a receive no rank sent to (the k-th receive from a rank must match its k-th send)"
        if path > tree_rounds(n):
            return (f"{name}: {path} rounds on the critical path; a binomial tree takes 2 ceil(log2 {n}) = "
                    f"{tree_rounds(n)} -- too many messages wait for one another (a chain, rank to rank, takes "
                    f"2(N-1) = {2 * (n - 1)}; a parent that sends to its nearest child first makes the farthest wait)")
    return None


def bytes_problem(rounds: list, n: int) -> str | None:
    """A rank whose bytes are not the binomial tree's, in words."""
    for name in rounds[0]:
        for rank, cases in enumerate(rounds):
            case = cases[name]
            size = case["got"].numel() * case["got"].element_size()
            watched = sum(b for call, _, b in case["events"] if call in SENDS)
            want = tree_bytes_sent(case["got"].numel(), case["got"].element_size(), n, rank)
            if case["sent"] != watched:
                return (f"{name}: rank {rank} sent {watched} bytes, of which the ledger counted {case['sent']}: send "
                        f"with self._send (it reports each message to the ledger)")
            if case["sent"] != want:
                children = tree_children(rank, n)
                return (f"{name}: rank {rank} sent {case['sent'] / size:g}x the tensor ({case['sent']} bytes), "
                        f"{'too many' if case['sent'] > want else 'too few'}: the binomial tree's rank {rank} sends "
                        f"{want / size:g}x -- "
                        + ("nothing up (the root)" if rank == 0 else "once up to its parent")
                        + (f", once down to each child {children}" if children else ", and has no children"))
    return None


def cost(checker) -> str:
    """The rounds at every world size first -- the lab's point: a chain's bytes are wrong at N = 3 as well, but its
    latency is what is wrong with it -- then the bytes."""
    measured = {}
    for n in (1, 2, 3, 4):
        for numel in (1, 16):
            rounds = checker.on_ranks(n, tree_round, checker.impl, numel, "float32", 0)
            raised = _first_raised(rounds)
            if raised:
                raise Failed(str(raised), _case(n, numel, "float32", 0))
            measured[n, numel] = rounds
    for problem_of in (rounds_problem, bytes_problem):
        for (n, numel), rounds in measured.items():
            problem = problem_of(rounds, n)
            if problem:
                raise Failed(problem, _case(n, numel, "float32", 0), named(checker, n, numel, rounds))
    return ("at N = 1-4: at most 2 ceil(log2 N) rounds on the critical path (0, 2, 4, 4), each rank's bytes the "
            "binomial tree's (the root's ceil(log2 N) x the tensor, the others' at most 2x)")


def _shape(rounds: list) -> list:
    """What a known mistake is compared on: each all-reduce's critical path and every rank's bytes."""
    return [(critical_path([c[name]["events"] for c in rounds]), [c[name]["sent"] for c in rounds])
            for name in rounds[0]]


def named(checker, n: int, numel: int, rounds: list) -> str | None:
    """The known mistake whose rounds and bytes on this case are exactly the learner's, if one's are."""
    mine = _shape(rounds)
    for mistake in TREE_MISTAKES:
        theirs = checker.on_ranks(n, tree_round, Impl.of(checker.lab, mistake), numel, "float32", 0)
        if _first_raised(theirs) is None and _shape(theirs) == mine:
            return mistake.mistake
    return None


# ------------------------------------------------------------------ training over it
def over_your_tree(checker) -> str:
    for stage, n in ((DDP.name, 3), (DDP.name, 4), (BucketedDDP.name, 3)):
        exp = Experiment(stage=stage, task="gpt", steps=2, accum=2, dtype="float64", backend=checker.key)
        results = checker.run_case(n, exp)
        why = what_is_wrong(results, reference_of(exp, n), exp, n)  # the parameter, rank, step and direction
        if why:
            raise Failed(why, describe(exp, n))
    return "ddp (N = 3 and 4) and ddp-bucketed (N = 3, its all-reduces on the communication thread) over your tree"


PROPERTIES = {
    "tree results": ("every all-reduce's result (SUM, AVG, MAX)", results),
    "tree rounds and bytes": ("rounds on the critical path and bytes per rank: the tree's", cost),
    "training over your tree": ("stages trained over your tree equal single-device training", over_your_tree),
}
