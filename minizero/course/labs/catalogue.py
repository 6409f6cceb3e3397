"""The labs: one per lesson, each a skeleton the learner completes and the properties that judge it.

A lab names the package's own class that answers it (the answer key: the
checker passes it, and CI proves that), the skeletons the learner starts from --
two levels, ``skeletons/contract/`` (each method's contract and the properties
that judge it, no recipe) and ``skeletons/guided/`` (what to do and which parts of
minizero exist for it), both the machinery given and the lesson's methods left to
write -- the properties it must satisfy -- the same the package's stages are held
to in ``tests/`` -- and the known mistakes the checker compares a failure with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...checkpoint.reshard import Reshard
from ...comm import Comm, HierarchicalComm, RingComm
from ...comm.tree import TreeComm
from ...parts.precision import Precision
from ...stages import DDP, STAGES, BucketedDDP, LocalSGD, Stage, ZeRO1, ZeRO2, ZeRO3
from . import mistakes, mistakes_local_sgd, mistakes_precision

SKELETONS = Path(__file__).parent / "skeletons"
#: The skeletons' levels, the default first: the contract alone, then the contract with hints.
LEVELS = ("contract", "guided")


@dataclass(frozen=True)
class Lab:
    name: str
    lesson: str  # the notebook that tells the story
    title: str
    answer: type  # the package's class: what a correct file behaves like
    todo: tuple[str, ...]  # what the learner writes, as Class.method
    properties: tuple[str, ...]  # names in minizero.course.labs.property_table.PROPERTIES, checked in this order
    mistakes: tuple[type, ...] = ()  # minizero.course.labs.mistakes: compared with a failure, to name it
    options: dict = field(default_factory=dict)  # stage options every example uses
    compress: bool = False  # draw compressed examples (the 16-bit wire)
    precision: bool = True  # can be checked under mixed precision (python -m minizero check LAB --precision bf16)
    # checked before every other property: the learner's methods are what runs (where a lab runs them outside a
    # training step -- resharding -- its own way of watching them)
    yours: str = "yours"

    @property
    def kind(self) -> type:
        """What the learner's file defines: a stage, a communication layer -- or, for a lab whose idea runs outside
        a training step (resharding a checkpoint), a subclass of the package's class itself."""
        return next((kind for kind in (Comm, Stage) if issubclass(self.answer, kind)), self.answer)

    def skeleton_at(self, level: str = LEVELS[0]) -> Path:
        """The blank skeleton at ``level`` (:data:`LEVELS`): ``skeletons/<level>/<name>.py``."""
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; the levels: {', '.join(LEVELS)}")
        return SKELETONS / level / f"{self.name.replace('-', '_')}.py"

    @property
    def skeleton(self) -> Path:
        """The default level's skeleton (the contract)."""
        return self.skeleton_at()

    @property
    def stage(self) -> str:
        """The name of the package's stage the learner's stands beside (the ring lab, which has none, names
        ZeRO-2: ``sent_bytes`` compares kinds of collective with it)."""
        return self.answer.name if issubclass(self.answer, Stage) else ZeRO2.name


def _labs(*labs: Lab) -> dict[str, Lab]:
    return {lab.name: lab for lab in labs}


STAGE_PROPERTIES = ("equivalence", "bytes")

LABS: dict[str, Lab] = _labs(
    Lab("ring", "lessons/01_collectives_from_send_recv.ipynb", "the ring reduce-scatter and all-gather from send/recv",
        RingComm, ("Ring._ring_reduce_scatter", "Ring._ring_all_gather"),
        ("collectives", "ring bytes and messages", "training over your ring"), precision=False),
    Lab("tree", "lessons/02_latency_and_scale.ipynb", "a binomial-tree all-reduce from send/recv",
        TreeComm, ("Tree._tree_reduce", "Tree._tree_broadcast"),
        ("tree results", "tree rounds and bytes", "training over your tree"), precision=False),
    Lab(DDP.name, "lessons/03_ddp_allreduce.ipynb", "DDP's gradient synchronisation", DDP, ("DDP.post_backward",),
        STAGE_PROPERTIES, (mistakes.SumInsteadOfMean, mistakes.SyncsWeights, mistakes.DropsLastParameter)),
    Lab(BucketedDDP.name, "lessons/04_bucketing_and_overlap.ipynb", "buckets launched during backward", BucketedDDP,
        ("BucketedDDP.post_accumulate_grad", "BucketedDDP.deferred_all_reduce"), STAGE_PROPERTIES + ("overlap",),
        (mistakes.TensorHookDDP, mistakes.PostHookArgumentAsGradient)),
    Lab("compress", "lessons/06_accumulation_and_compression.ipynb",
        "accumulation with no_sync() and the 16-bit wire", DDP, ("DDP.no_sync", "Wire.encode", "Wire.decode"),
        ("equivalence", "one all-reduce per step", "no_sync nests", "compressed equivalence", "compressed bytes"),
        (mistakes.SyncsEveryMicroBatch, mistakes.FP16HookDivision), compress=True, precision=False),
    Lab(ZeRO1.name, "lessons/07_zero1.ipynb", "ZeRO-1: reduce-scatter, step the owned shard, all-gather", ZeRO1,
        ("ZeRO1.post_backward", "ZeRO1.all_gather_parameters"), STAGE_PROPERTIES + ("memory",),
        (mistakes.ShiftedShard, mistakes.AllReduceThenAllGather)),
    Lab(ZeRO2.name, "lessons/08_zero2.ipynb", "ZeRO-2: a reduce-scatter per bucket during backward", ZeRO2,
        ("ZeRO2.post_accumulate_grad", "ZeRO2.deferred_reduce_scatter", "ZeRO2.post_backward"),
        STAGE_PROPERTIES + ("memory", "overlap"),
        (mistakes.LastMicroBatchOnly,)),
    Lab(ZeRO3.name, "lessons/09_zero3.ipynb", "ZeRO-3: gather a unit around its forward and backward, free it after",
        ZeRO3, ("Unit.unshard", "Unit.pre_forward", "Unit.post_forward", "Unit.pre_backward",
                "Unit.post_backward"), STAGE_PROPERTIES + ("memory",),
        (mistakes.NeverReshards, mistakes.StaleAfterBackward)),
    Lab("mixed-precision", "lessons/10_mixed_precision.ipynb",
        "the mixed-precision step: unscale, agree on overflow, step the fp32 masters, refresh the 16-bit copy", ZeRO2,
        ("MasterWeights.unscale_", "MasterWeights._agree_on_overflow", "MasterWeights.step", "MasterWeights.refresh"),
        ("mixed-precision step", "mixed-precision training"),
        mistakes_precision.MISTAKES,
        # fp16 at a scale that does not overflow: the first check needs one step taken (all four methods run)
        options={"precision": Precision("fp16", loss_scale=16.0)},
        precision=False),  # the lab draws its precisions itself
    Lab("reshard", "lessons/12_training_runs.ipynb", "resharding a flat ZeRO checkpoint from N ranks to M", Reshard,
        ("Reshard.owned_range", "Reshard.reshard"), ("reshard ranges", "resumed on M ranks"), precision=False,
        yours="yours while resharding"),
    Lab(LocalSGD.name, "lessons/13_parameter_server_async_local_sgd.ipynb",
        "local SGD: every H steps average the replicas (DiLoCo: an outer step on the averaged change)", LocalSGD,
        ("LocalSGD.step", "LocalSGD.average"), ("local-sgd H=1", "local-sgd package", "local-sgd bytes"),
        mistakes_local_sgd.MISTAKES,
        options={"average_every": 1}, precision=False),  # H = 1: the first check's one step averages
    Lab("powersgd", "lessons/16_when_compression_pays.ipynb",
        "the PowerSGD step: P = M Q and Q = M^T P, each all-reduced, P orthogonalized between", BucketedDDP,
        ("PowerSGDWire.power_step",), ("powersgd equivalence", "powersgd bytes"),
        options={"compress": "powersgd:rank=2", "error_feedback": True}, precision=False),
    # a Comm lab, as the tree's: no stage, no precision; its first check watches an all-reduce on nodes (a two-level
    # Comm needs to know where the ranks sit, which the suite's training step does not say)
    Lab("hierarchical", "lessons/17_topology.ipynb",
        "the two-level all-reduce: reduce-scatter inside the node, all-reduce across the nodes, all-gather inside",
        HierarchicalComm, ("Hierarchical._all_reduce",), ("hierarchical results", "hierarchical link bytes"),
        precision=False, yours="yours on the nodes"),
)

assert all(lab.stage in STAGES for lab in LABS.values())


def check_lab_name(name: str) -> Lab:
    if name not in LABS:
        raise ValueError(f"unknown lab {name!r}; the labs: {', '.join(LABS)} (python -m minizero lab --list)")
    return LABS[name]
