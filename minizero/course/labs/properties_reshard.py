"""The reshard lab's properties: each rank's new shard is exactly its range, and a run resumed from them on M
ranks continues single-device training.

Every example is a drawn :class:`Case`: the package's ZeRO-1 trains a small MLP with Adam(W) on N ranks and saves
its flat shards (:mod:`minizero.checkpoint.flat`); M ranks build theirs with the learner's ``Reshard``.  N and M
are drawn from 1-4 (3 included), and the group sizes -- 6h + 2 elements, or 5h and h + 2 in two param groups --
rarely divide by either, so shards are uneven and the last ones partly padding.

* **ranges** -- each rank's shard of each group, parameters and Adam's state, equals exactly its range of the
  flat buffer laid out at M (element for element: it is a copy); a wrong one is located -- shifted by how many
  elements, or another tensor's values.
* **training** -- loaded and trained on (float64), every parameter and optimizer state after every step equals
  single-device training's on the same global batch, to 1e-9.

``yours`` here replaces the suite's first property for this lab alone: the learner's methods run while a rank
builds its shards, not in a training step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from ...checkpoint.flat import FlatShard
from ...checkpoint.reshard import Reshard
from ...stages import ZeRO1
from ..harness.equivalence import judge
from ..harness.experiment import Experiment, exact_reference_of
from .failed import Failed
from .mistakes_reshard import named
from .properties import PROPERTIES as SUITE
from .raised import Raised
from .reshard_ranks import resume_run, save_run, yours_reshard

SPLITS = {1: (12,), 2: (7, 5), 3: (4, 4, 4), 4: (3, 3, 3, 3)}  # one global batch of 12, split over N ranks
_SAVED: dict[str, list] = {}  # the package's own saves, by experiment: the learner's code plays no part in them


@dataclass(frozen=True)
class Case:
    saved_by: int  # N
    loaded_by: int  # M
    hidden: int  # the MLP (3, hidden, 2): 6 hidden + 2 parameters
    saved_after: int  # steps before the save
    more: int  # steps after the reshard
    optimizer: str = "adamw"
    param_groups: bool = False  # two flat groups (weights; biases at twice the rate, no decay)
    seed: int = 0

    def experiment(self, steps: int, first_step: int = 0, world_size: int | None = None) -> Experiment:
        return Experiment(stage=ZeRO1.name, task="mlp", model={"sizes": (3, self.hidden, 2)}, steps=steps,
                          first_step=first_step, dtype="float64", optimizer=self.optimizer, lr=0.01,
                          rank_sizes=SPLITS[world_size or self.saved_by], param_groups=self.param_groups,
                          seed=self.seed, record_states=True)

    def __str__(self) -> str:
        groups = ([5 * self.hidden, self.hidden + 2] if self.param_groups else [6 * self.hidden + 2])
        return (f"world size {self.saved_by} -> {self.loaded_by}: saved after {self.saved_after} step(s), resharded, "
                f"{self.more} more step(s); mlp (3, {self.hidden}, 2): flat group(s) of {groups} elements; "
                f"{self.optimizer} (lr 0.01), float64, data seed {self.seed}")


CASES = st.builds(Case, st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.integers(1, 2), st.integers(1, 2),
                  st.sampled_from(["adamw", "adam"]), st.booleans(), st.integers(0, 3))


def saved_shards(checker, case: Case) -> list[list[FlatShard]]:
    """Every rank's flat shards after the first ``saved_after`` steps at N ranks (the package's ZeRO-1)."""
    exp = case.experiment(case.saved_after)
    key = f"{case.saved_by} {exp!r}"
    if key not in _SAVED:
        _SAVED[key] = checker.on_ranks(case.saved_by, save_run, exp)
    return _SAVED[key]


def _loaded(checker, case: Case, train: bool) -> list:
    """Each of the M ranks' ``{"shards", "result"}``, or the first rank's exception as :class:`Failed`."""
    exp = case.experiment(case.more, case.saved_after, case.loaded_by)
    ranks = checker.on_ranks(case.loaded_by, resume_run, checker.impl, exp, saved_shards(checker, case), train)
    raised = next((r for r in ranks if isinstance(r, Raised)), None)
    if raised:
        raise Failed(str(raised))
    return ranks


# ------------------------------------------------------------------ ranges
def located(got: torch.Tensor, whole: torch.Tensor, start: int) -> str:
    """Where in ``whole`` (the flat tensor, no padding) ``got`` was cut from, relative to ``start``, in words."""
    for offset in range(-len(got) + 1, whole.numel()):
        a, b = max(offset, 0), min(offset + len(got), whole.numel())
        if b > a and torch.equal(got[a - offset:b - offset], whole[a:b]) and offset != start:
            shift = offset - start
            return (f"it holds elements [{offset}, {offset + len(got)}) of the flat tensor: shifted by {shift:+d} "
                    f"element(s)")
    return ""


def shard_problem(got, want: FlatShard, saved: list[FlatShard], rank: int, m: int, g: int) -> str | None:
    """What is wrong with rank ``rank``'s shard of flat group ``g``, in words; None when it is exactly ``want``."""
    where = f"rank {rank} of {m}, flat group {g} ({want.numel} elements)"
    if not isinstance(got, FlatShard):
        return f"{where}: reshard returned a {type(got).__name__}, not a FlatShard"
    start, stop = Reshard().owned_range(want.numel, m, rank)
    if (got.rank, got.world_size, got.numel) != (rank, m, want.numel):
        return (f"{where}: the shard says rank {got.rank} of {got.world_size}, {got.numel} elements; it is rank {rank} "
                f"of {m}, {want.numel} elements")
    if set(got.state) != set(want.state):
        return f"{where}: its optimizer state holds {sorted(got.state)}; the saved shards' holds {sorted(want.state)}"
    tensors = [("parameters", got.values, want.values, [s.values for s in saved])]
    tensors += [(f"optimizer state {k!r}", got.state[k], v, [s.state[k] for s in saved]) for k, v in want.state.items()]
    for name, mine, theirs, parts in tensors:
        if theirs.dim() == 0:
            if not torch.is_tensor(mine) or mine.dim() or not torch.equal(mine, theirs):
                shown = mine.tolist() if torch.is_tensor(mine) else mine
                return f"{where}, {name}: {shown}, but the saved shards' is {theirs.item()} (a count: kept whole)"
            continue
        if not torch.is_tensor(mine) or tuple(mine.shape) != tuple(theirs.shape):
            shape = tuple(mine.shape) if torch.is_tensor(mine) else type(mine).__name__
            return (f"{where}, {name}: shape {shape}, but rank {rank} owns [{start}, {stop}) -- "
                    f"ceil({want.numel} / {m}) = {stop - start} elements, padding included")
        if not torch.equal(mine.to(theirs.dtype), theirs):
            whole = torch.cat(parts)[:want.numel]
            said = f"{where}, {name}: not elements [{start}, {stop}) of the group's flat {name} (zeros past {want.numel})"
            inside = max(min(stop, want.numel) - start, 0)
            if torch.equal(mine[:inside].to(theirs.dtype), theirs[:inside]):
                return f"{said}: past element {want.numel} -- the padding -- it must hold zeros"
            if not mine.any():
                return f"{said}: it holds zeros only -- nothing of the group"
            found = located(mine, whole, start)
            if found:
                return f"{said}: {found}"
            others = [n for n, _, t, _ in tensors if t.dim() and n != name and torch.equal(mine.to(t.dtype), t)]
            if others:
                return f"{said}: they are its {others[0]}"
            i = int((mine.to(theirs.dtype) != theirs).nonzero()[0])
            return f"{said}: element {start + i} is {mine[i].item()}, should be {theirs[i].item()}"
    return None


def rank_problem(shards: list, saved: list[list[FlatShard]], rank: int, m: int) -> str | None:
    """What is wrong with any of rank ``rank``'s shards (one per flat group), in words; None when all are right."""
    want = Reshard().reshard_all(saved, m, rank)
    if len(shards) != len(want):
        return f"rank {rank} of {m}: {len(shards)} shard(s) for {len(want)} flat group(s)"
    for g, (got, expected) in enumerate(zip(shards, want, strict=True)):
        problem = shard_problem(got, expected, [s[g] for s in saved], rank, m, g)
        if problem:
            return problem
    return None


def ranges(checker) -> str:
    seen: dict[str, tuple] = {}  # a failing case, in words -> what a known mistake is compared on

    def examine(case: Case):
        ranks = _loaded(checker, case, train=False)
        saved = saved_shards(checker, case)
        for rank, ran in enumerate(ranks):
            problem = rank_problem(ran["shards"], saved, rank, case.loaded_by)
            if problem:
                seen[str(case)] = (saved, case.loaded_by, [r["shards"] for r in ranks])
                return problem, None
        return None

    search_naming(checker, examine, seen)
    for case in FIXED_RANGES:
        try:
            found = examine(case)
        except Failed as failed:  # a rank raised on it: told with the case
            raise Failed(failed.why, str(case), final=failed.final) from None
        if found:
            raise Failed(found[0], str(case), named(*seen[str(case)]))
    return (f"{checker.examples} drawn examples: saved by N = 1-4 ranks, resharded to M = 1-4 (3 included, uneven "
            f"shards): each rank's parameters, exp_avg, exp_avg_sq and step exactly its range; then a rank whose "
            f"shard is all padding")


#: Tried whatever is drawn (issue 45): 2 -> 4 ranks with two flat groups, of 5 and 3 elements -- at M = 4 the second's
#: shards are of 1, and rank 3's begins past its end: all padding, zeros to the last element.
FIXED_RANGES = (Case(saved_by=2, loaded_by=4, hidden=1, saved_after=1, more=1, param_groups=True),)


def search_naming(checker, examine, seen: dict) -> None:
    """:meth:`Checker.search` over drawn cases; a failure names the known mistake that builds the learner's very
    shards on the smallest case, if one does."""
    try:
        checker.search(CASES.map(lambda c: (c,)), lambda drawn: examine(drawn[0]), str)
    except Failed as failed:
        mistake = named(*seen[failed.case]) if failed.case in seen else None
        raise Failed(failed.why, failed.case, mistake, final=failed.final) from None


# ------------------------------------------------------------------ training
def resumed(checker) -> str:
    seen: dict[str, tuple] = {}

    def examine(case: Case):
        ranks = _loaded(checker, case, train=True)
        results = [ran["result"] for ran in ranks]
        whole = exact_reference_of(case.experiment(case.saved_after + case.more), case.saved_by)
        s = case.saved_after
        tail = replace(whole, params=whole.params[s:], losses=whole.losses[s:],
                       optimizer_states=whole.optimizer_states[s:])
        verdict = judge(results, tail, "float64", states=True)
        if not verdict.ok:
            seen[str(case)] = (saved_shards(checker, case), case.loaded_by, [ran["shards"] for ran in ranks])
            why = verdict.nonfinite or verdict.violation
            return f"resumed on {case.loaded_by} rank(s) (steps counted from the reshard): {why}", None
        return None

    search_naming(checker, examine, seen)
    return (f"{checker.examples} drawn examples: N -> M in 1-4, resumed and trained on, equal single-device training "
            f"(float64, 1e-9: parameters, exp_avg, exp_avg_sq, step)")


# ------------------------------------------------------------------ your methods are what runs


def yours(checker) -> str:
    """The checker's first property, for the reshard lab: its methods run while a rank builds its shards (not in
    a training step, where :func:`minizero.course.labs.properties.yours_run` looks)."""
    if checker.impl.path is None:
        ours = checker.impl.module == checker.lab.answer.__module__ and checker.impl.qualname == checker.lab.answer.__name__
        return "the package's own class (the answer key)" if ours else f"a class of the package's, {checker.impl.label}"
    case = Case(saved_by=3, loaded_by=2, hidden=2, saved_after=1, more=1)
    exp = case.experiment(0, case.saved_after, case.loaded_by)
    problems = checker.on_ranks(2, yours_reshard, checker.impl, exp, saved_shards(checker, case))[0]
    if isinstance(problems, Raised):
        raise Failed(str(problems), final=True)
    if problems:
        raise Failed("; ".join(problems), final=True)
    if problems is None:
        return f"{', '.join(checker.lab.todo)}: written in your file (the reshard raised before all of them ran)"
    return f"{', '.join(checker.lab.todo)}: yours, each called while a rank builds its shards"


PROPERTIES = {
    "yours while resharding": (SUITE["yours"][0], yours),
    "reshard ranges": ("every rank's new shard holds exactly its range", ranges),
    "resumed on M ranks": ("resumed on M ranks, training equals single-device training", resumed),
}
