"""Experiments drawn at random: what the equivalence suite and the labs' checker run.

One strategy serves both, so a learner's stage faces exactly the properties
the package's own stages pass (``tests/`` and ``python -m minizero check``).
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ...parts.precision import Precision
from ...run.orders import ORDERS
from ...stages import DEFAULT_STAGE
from ...stages.options import BUCKET_MB_DRAWN, Drawing
from .experiment import Experiment
from .optimizers import OPTIMIZERS
from .registry import stage_class

#: The bucket caps drawn (declared with the option: ``minizero.stages.options.BUCKET_MB``), kept under the name
#: the suite's helpers import.
BUCKET_MB = list(BUCKET_MB_DRAWN)


def _one_of(values):
    """A strategy for one of ``values``: a range of whole numbers as ``st.integers`` (as the parameter server's
    ``servers`` was drawn before they were declared: the same examples), a single value without a draw."""
    if isinstance(values, range) and values.step == 1:
        return st.integers(values.start, values.stop - 1)
    values = tuple(values)
    return st.just(values[0]) if len(values) == 1 else st.sampled_from(values)


#: What each task's model offers the draws: the submodules ZeRO-3 may keep whole (``replicate``: nothing, or a module
#: of it; the edge model's mid and tied share a weight: both, or neither), and whether a parameter never gets a
#: gradient (the edge model's ``unused``: then ``find_unused_parameters`` is drawn on).
REPLICABLE = {"mlp": (None, ("layers.0",)), "gpt": (None, ("ln_f",), ("blocks.0.ln1", "ln_f")),
              "edge": (None, ("mid", "tied"), ("out",))}
UNUSED_PARAMETERS = {"edge", "routed"}


def drawing_for(world_size: int, task: str) -> Drawing:
    """What a stage's option draws may depend on, for ``task``'s model at ``world_size``."""
    return Drawing(world_size, REPLICABLE.get(task, ()), task in UNUSED_PARAMETERS)


@st.composite
def stage_options(draw, stage: str, task: str, compress: bool = False, stages: dict | None = None,
                  precision: bool = False, world_size: int = 1) -> dict:
    """Options drawn from what the stage declares: each option's own ``draw``, in the declaration's order
    (:class:`minizero.stages.options.Option`: ``servers`` up to the world size, ``bucket_mb``, ``prefetch``,
    ``find_unused_parameters`` on the edge model whose ``unused`` never gets a gradient, ...), so a stage with
    a new option has it drawn with no line here; an empty draw leaves the option at its default.  Then the
    suite's modes, which no declaration draws on its own: mixed precision and the compressed wire."""
    options, drawing = {}, drawing_for(world_size, task)
    for option in getattr(stage_class(stage, stages), "options", ()):  # torch's oracles declare none
        values = option.draw(drawing) if option.draw is not None else ()
        if len(values):
            options[option.name] = draw(_one_of(values))
    if precision:
        options["precision"] = draw(st.sampled_from(PRECISION_POLICIES))
    if compress or (precision and options["precision"].reduce_dtype is None and draw(st.booleans())):
        options["compress"] = draw(st.sampled_from(["fp16", "bf16"]))  # under mixed precision: composed
        options["error_feedback"] = draw(st.booleans())
    return options


#: Mixed-precision policies drawn: each 16-bit dtype, reduced in it (the default) or in fp32, and fp16
#: with a loss scale low enough that no step overflows as well as the default 2^16 that makes the first
#: steps overflow and skip.
PRECISION_POLICIES = [Precision("bf16"), Precision("fp16"), Precision("bf16", reduce_dtype="fp32"),
                      Precision("fp16", reduce_dtype="fp32"), Precision("fp16", loss_scale=2.0 ** 4)]


#: Clipping (max_norm, norm_type) on both sides of the gradient's norm, for the L2 and the inf norm: a max_norm
#: below every gradient norm these small models reach clips every step (the coefficient max_norm / (norm + eps)
#: scales the gradient down); one far above never does -- and must leave the gradient as it is, the coefficient
#: capped at 1, which only a draw on that side can tell from a clip that always scales.
CLIPPING = [(0.05, 2.0), (0.02, float("inf"))]
NOT_CLIPPING = [(1e6, 2.0), (1e6, float("inf"))]
CLIPS = [None, *CLIPPING, *NOT_CLIPPING]


def clip_side(clip: tuple | None) -> str | None:
    """Which side of the norm a drawn ``clip`` is on: ``"clips"``, ``"never clips"``, or None (no clipping)."""
    return None if clip is None else "clips" if clip in CLIPPING else "never clips" if clip in NOT_CLIPPING else None


def missing_clip_sides(drawn: list) -> list[str]:
    """The sides of the norm the drawn experiments never clipped on (what a covering check asks for)."""
    had = {clip_side(exp.clip) for exp in drawn}
    return [f"a clip that {side}" for side in ("clips", "never clips") if side not in had]


SIMPLEST_FIRST = ["sgd", "momentum", "nesterov", "adam", "adamw"]
assert sorted(SIMPLEST_FIRST) == sorted(OPTIMIZERS)


@st.composite
def experiments(draw, stage: str = DEFAULT_STAGE, world_sizes=(1, 2, 3, 4), max_accum: int = 3, compress: bool = False,
                backends=("ring", "native"), stages: dict | None = None, precision: bool = False,
                tasks=("mlp", "mlp", "edge", "gpt"), wrap_first: bool = False, nodes: bool = False,
                syncs: bool = False, sgd_family: bool = False, orders: bool = False):
    """An experiment and its world size: model shape, batch split, optimizer, dtype...  With ``wrap_first``,
    half the draws build the optimizer after wrapping, over ``stage.parameters()``, and the loop zeroes and steps
    it itself (FSDP2's order: ``optimizer.zero_grad()`` sets every ``.grad`` to None behind the stage's back); and
    half zero the gradients as a user's loop often does, with ``model.zero_grad()``.  With ``nodes`` (always for a
    stage whose mesh is the nodes: HSDP), the ranks sit on drawn nodes -- ``M x G = N``, one rank per node and
    one node included -- and the backend may be the hierarchical one.  With ``syncs``, half the draws of K >= 2
    synchronise more than the last micro-batch's backward -- in every order that ends synchronising -- so a gradient
    synchronised twice before a step must add, as ``.grad`` does (not the same-casts reference's: one rounding a step).
    With ``sgd_family``, only the optimizers whose update is linear in the gradient (a wire rounding in an order of
    its own: see below).  With ``orders``, the backwards in one of :data:`~minizero.run.orders.ORDERS` or
    torch's idiom, where the synchronising pattern is the idiom's."""
    world_size = draw(st.sampled_from(world_sizes))
    network = None
    if nodes or getattr(stage_class(stage, stages), "needs_nodes", False):
        per_node = draw(st.sampled_from([g for g in range(1, world_size + 1) if world_size % g == 0]))
        network = f"nodes={world_size // per_node}x{per_node}"
        backends = (*backends, "hierarchical")
    task = draw(st.sampled_from(tasks))
    model = {}
    if task == "mlp":
        model = {"sizes": tuple(draw(st.lists(st.integers(1, 9), min_size=2, max_size=4)))}
    elif task == "gpt":
        model = {"d_model": draw(st.sampled_from([8, 16])), "n_layer": draw(st.integers(1, 2)),
                 "n_head": 2, "block_size": draw(st.sampled_from([4, 8]))}
    accum = draw(st.integers(1, max_accum))
    rank_sizes = None
    if draw(st.booleans()):  # unequal samples per rank, some possibly empty
        rank_sizes = tuple(draw(st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size)
                                .filter(lambda sizes: sum(sizes) > 0)))
    # The mixed model's first layer is float32 whatever is drawn: judged by float32's rule (and the SGD family).
    dtype = "float32" if task == "mixed" else draw(st.sampled_from(["float64", "float32"]))
    # Adam's first steps are about lr * sign(g): a gradient element near zero flips sign under float32
    # rounding in any two summation orders, an O(lr) difference no tolerance on parameters can absorb.
    # So float32 draws the SGD family (1e-5 holds), and Adam/AdamW are proven in float64 (1e-9).
    # Simplest first: a failure shrinks towards plain SGD, where a wrong gradient shows undamped.
    optimizers = SIMPLEST_FIRST if dtype == "float64" else SIMPLEST_FIRST[:3]
    if precision:  # the reference applies the same casts in the same order: no sign for Adam to flip
        optimizers = SIMPLEST_FIRST
    if sgd_family:  # another wrapper's 16-bit wire rounds in its own order: Adam would flip signs again
        optimizers = SIMPLEST_FIRST[:3]
    exp = Experiment(
        stage=stage, task=task, model=model,
        optimizer=draw(st.sampled_from(optimizers)),
        lr=draw(st.sampled_from([1e-3, 1e-2, 1e-1])),
        steps=draw(st.integers(1, 3)),
        micro_batch=draw(st.integers(1, 3)),
        accum=accum,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        backend=draw(st.sampled_from(backends)),
        network=network,
        rank_sizes=rank_sizes,
        options=draw(stage_options(stage, task, compress, stages, precision, world_size)),
        clip=draw(st.sampled_from(CLIPS)),
        param_groups=draw(st.booleans()),
        wrap_first=(wrapped := wrap_first and draw(st.booleans())),
        record_states=not wrapped,  # (the loop's own optimizer holds the pieces' states, not a consolidated one)
        stages=stages,
        # the user's own idiom, model.zero_grad() -- which wrapping routes to the stage's -- half the time
        zero_grad=draw(st.sampled_from(["optimizer", "model"])) if wrap_first else "optimizer",
    )
    if syncs and accum > 1:  # drawn last, so the draws before it are what they were without it
        # None first: a failure shrinks to torch's idiom, the last micro-batch synchronising alone
        pattern = draw(st.none() | st.tuples(*[st.booleans()] * (accum - 1)).map(lambda head: (*head, True)))
        exp = replace(exp, syncs=pattern if pattern != (False,) * (accum - 1) + (True,) else None)
    if orders and exp.syncs is None:  # drawn after the rest, None first: a failure shrinks to torch's idiom
        # at K = 1 only retained differs from the idiom
        exp = replace(exp, order=draw(st.sampled_from((None, *(ORDERS if accum > 1 else ("retained",))))))
    return exp, world_size
