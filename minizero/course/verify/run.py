"""``verify``: the property suite's equivalence search, run on a factory's wrapper instead of a stage.

The same drawn experiments as the suite and the labs (:func:`minizero.course.harness.drawn.experiments`: world
sizes 1-4 with 3 among them, uneven batches and empty ranks, K micro-batches, tied parameters, two param groups,
SGD to AdamW, float64 and float32, clipping on both sides of the norm), each run on a pool of ranks through the
one training loop and judged against single-device training by the suite's rule
(:func:`~minizero.course.harness.equivalence.judge`); the first failure is shrunk by the same search
(:mod:`minizero.course.labs.search`) and told as the labs tell it -- parameter, rank, step, direction.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace

import torch

from ...run.launch import RankError
from ...run.pools import RankPools
from ...stages import STAGES as PACKAGE_STAGES
from ..harness.diagnosis import what_is_wrong
from ..harness.drawn import experiments
from ..harness.experiment import Experiment, reference_of, run_experiment
from ..labs.failed import Failed, describe
from ..labs.raised import Raised
from ..labs.ranks import gloo_words, stderr_to
from ..labs.search import Search
from ..labs.verdicts import stopped
from .adapter import Yours
from .convention import call_factory, load_factory, split_spec
from .declared_casts import SLACK, Casts, what_is_wrong_against_the_casts

STAGES = {**PACKAGE_STAGES, Yours.name: Yours}  # the reference is the package's own
SHRINK_S = 20.0
DEADLINE_S = 60.0  # an example takes about a second: a wrapper this long on one is stopped, and shown where


@dataclass
class Searcher(Search):
    """The labs' search (:mod:`minizero.course.labs.search`), without their known mistakes to name."""
    examples: int
    shrink_s: float


@dataclass
class Verdict:
    factory: str
    examples: int
    declared: str  # what was drawn, from what the factory declared
    failed: str | None = None  # what went wrong, in words
    case: str = ""
    final: bool = False  # the ranks were stopped or died: the first case that did it, not shrunk
    against: str = "single-device training"  # on declared casts: the reference that applies them

    @property
    def ok(self) -> bool:
        return self.failed is None

    def __str__(self) -> str:
        if self.ok:
            return f"verify {self.factory}: equal to {self.against} on {self.examples} drawn examples ({self.declared})."
        return (f"verify {self.factory}: FAILS\n  what went wrong: {self.failed}\n"
                f"  {'failing case (not shrunk: the ranks were stopped)' if self.final else 'smallest failing case'}: "
                f"{self.case}\n  (the examples are derandomized: the same command replays it)")


class RaisedOnRank(Exception):
    """What a rank raised, in words (:class:`Raised`): re-raised so that the pool stops every rank at once --
    a peer left waiting in a collective the raising rank never joined would wait for gloo's timeout."""

    MARK = "RaisedOnRank: "


def yours_on_rank(me, exp, path: str):
    """This rank's result of ``exp`` with the factory's wrapper; what it raised, in words, ends the run."""
    try:
        return run_experiment(me, exp)
    except Exception as error:  # noqa: BLE001 -- told, in words, with the line of the wrapper's file it came from
        raise RaisedOnRank(str(Raised.now(me.rank, error, path))) from None


def declared(me, spec: str) -> tuple[int, bool, Casts | None] | Raised:
    """On one rank: (the most micro-batches a step may take, whether unused parameters are drawn, the casts it
    declares or None), from what the factory returns for a small model -- or what it raised."""
    path, _ = split_spec(spec)
    try:
        wrapped = call_factory(load_factory(spec), torch.nn.Linear(2, 2), torch.distributed.group.WORLD)
    except Exception as error:  # noqa: BLE001 -- told in words
        return Raised.now(me.rank, error, path)
    return (3 if wrapped.no_sync is not None else 1), wrapped.unused_parameters, wrapped.casts


def corners(spec: str, max_accum: int, world_sizes, unused: bool = False, casts: Casts | None = None) -> list:
    """Cases tried whatever the draws, after them (a draw that fails is told on its shrunk case first): a
    parameter with an empty shard under an inf-norm clip (a max over nothing) at N = 2 and again at N = 4 -- where a
    2-D mesh's rows of two shard what its rows of one at N = 2 did not -- and K = 3 at N = 3 with uneven batches,
    one rank empty; for a wrapper that takes unused parameters, the edge model (frozen, unused and zero-size
    parameters) under the same clip.  On declared casts, first :func:`one_order` cases, judged bit for bit."""
    base = Experiment(stage=Yours.name, task="mlp", model={"sizes": (1, 1)}, optimizer="sgd", lr=0.01, steps=2,
                      dtype="float64", backend="native", clip=(0.02, float("inf")), record_states=False,
                      stages=STAGES, options={"factory": spec})
    cases = [(base, 2), (base, 4),
             (replace(base, model={"sizes": (3, 4, 2)}, accum=max_accum, rank_sizes=(2, 0, 3), clip=None), 3)]
    if unused:
        cases.append((replace(base, task="edge", model={}), 2))
    if casts:
        cases = one_order(spec, casts) + cases
    return [(exp, n) for exp, n in cases if n in world_sizes]


def one_order(spec: str, casts: Casts) -> list:
    """Three SGD steps of a thin MLP at N = 1 and 2, where a 16-bit wire has one order of rounding -- one sum of
    two, and halving is exact outside the subnormals -- so a wrapper that casts as it declares is the same-casts
    reference bit for bit, whether it divides before the cast (torch's hook) or after (minizero's wire).  Exact
    training is up to 5 wire roundings of an update away there (measured): only the casts tell them apart.  Under
    bf16 compute with an fp32 reduction, N = 1 only (:attr:`Casts.one_order`)."""
    thin = Experiment(stage=Yours.name, task="mlp", model={"sizes": (1, 2, 1, 1)}, optimizer="sgd", lr=0.1, steps=3,
                      seed=1, dtype="float64", backend="native", record_states=False, stages=STAGES,
                      options={"factory": spec})
    return [(thin, n) for n in casts.one_order]


def drawn_for(spec: str, world_sizes: tuple, max_accum: int, unused: bool, casts: Casts | None,
              every_order: bool = False):
    """What ``verify`` draws for a factory that declared ``max_accum``, ``unused`` and ``casts``, and those draws in
    words.  On declared casts, one rounded reduction a step (the same-casts reference rounds one): the last
    micro-batch synchronises, as torch's idiom has it; and the SGD family only -- Adam's first step is lr * sign(g),
    so a gradient element near zero, rounded in another order, moves a whole lr either way (0.00997 at lr 0.01, a
    bf16 hook against the same casts): verify a wrapper's optimizer side without the casts.  ``every_order``: the
    backwards in :data:`~minizero.run.orders.ORDERS` too (not on declared casts: the same-casts reference rounds
    the idiom's one reduction)."""
    tasks = ("mlp", "mlp", "gpt") + (("edge",) if unused else ())
    strategy = experiments(Yours.name, world_sizes=world_sizes, max_accum=max_accum, backends=("native",),
                           stages=STAGES, tasks=tasks, syncs=max_accum > 1 and casts is None, sgd_family=casts is not None,
                           orders=every_order and casts is None)
    strategy = strategy.map(lambda d: (replace(d[0], options={"factory": spec}, record_states=False), d[1]))
    said = (f"world sizes {', '.join(map(str, world_sizes))}, K up to {max_accum}"
            + ((", backwards inside and outside no_sync() in every order that ends synchronising" if casts is None else
                ", the last micro-batch synchronising") if max_accum > 1 else
               " (no no_sync() or set_requires_gradient_sync: accumulation not drawn)")
            + ((", backwards in other orders (forwards then backwards, retained, inside then outside no_sync(), "
                "both in one backward)" if casts is None else " (not in other orders: the same-casts reference "
                "rounds the idiom's one reduction)") if every_order else "")
            + f", uneven and empty batches, one and two param groups, {'sgd to nesterov' if casts else 'sgd to adamw'}, "
              "float64 and float32, clipping, "
              "the MLP and a GPT with tied embeddings" + (", frozen and unused parameters" if unused else "")
            + (f"; on its declared {casts.said}, within {SLACK:g}x their own effect of the same-casts reference"
               if casts else ""))
    return strategy, said


def verify(spec: str, examples: int = 25, world_sizes=(1, 2, 3, 4), pools: RankPools | None = None,
           shrink_s: float = SHRINK_S, deadline_s: float = DEADLINE_S, every_order: bool = False) -> Verdict:
    """Draw ``examples`` experiments, run each with the wrapper ``spec`` names (``"path.py:factory"``) and with
    single-device training; the first that differs, shrunk, is the verdict.  ``every_order``: backwards that do
    not each follow their own forward are drawn too (:mod:`minizero.run.orders`)."""
    path, _ = split_spec(spec)
    load_factory(spec)  # a missing file or name is refused here, before any rank starts
    own = pools is None
    pools = RankPools(timeout_s=30.0) if own else pools
    probed = pools.run_within(deadline_s, 1, declared, spec)[0]
    if isinstance(probed, Raised):
        if own:
            pools.close()
        return Verdict(spec, examples, "nothing: the factory raised on one rank", str(probed), "world size 1")
    max_accum, unused, casts = probed
    strategy, said = drawn_for(spec, tuple(world_sizes), max_accum, unused, casts, every_order)
    noise = tempfile.TemporaryDirectory(prefix="minizero-verify-")

    def examine(drawn):
        exp, n = drawn
        try:
            results = pools.run_within(deadline_s, n, stderr_to, noise.name, yours_on_rank, exp, path)
        except RankError as error:
            if RaisedOnRank.MARK in error.remote_traceback:  # the first rank that raised: the others were stopped
                return error.remote_traceback.split(RaisedOnRank.MARK, 1)[1].strip(), None
            why = stopped(error, path, deadline_s, False) if error.stacks else str(error)
            why = why.replace("the checker's deadline", "verify's deadline")
            words = gloo_words(noise.name)
            raise Failed(why + (f"\n    gloo's own words, {words}" if words else ""), final=True) from None
        why = (what_is_wrong(results, reference_of(exp, n), exp, n) if casts is None else
               what_is_wrong_against_the_casts(results, exp, n, casts, (exp, n) in one_order(spec, casts)))
        return (why, results) if why else None

    at = " and ".join(map(str, casts.one_order)) if casts else ""
    verdict = Verdict(spec, examples, said + (f", then three steps of a thin MLP at N = {at}, bit for bit" if casts else "")
                      + f", then an empty shard under an inf-norm clip at N = 2 and 4 and "
                      f"K = {max_accum} at N = 3"
                      + (", and the edge model under that clip" if unused else ""))
    if casts:
        verdict.against = f"single-device training with the same casts ({casts.said})"
    try:
        searcher = Searcher(examples, shrink_s)
        searcher.search(strategy, examine, describe)
        searcher.fixed(corners(spec, max_accum, world_sizes, unused, casts), examine, describe)
    except Failed as failed:
        verdict.failed, verdict.case, verdict.final = failed.why, failed.case, failed.final
    finally:
        noise.cleanup()
        if own:
            pools.close()
    return verdict
