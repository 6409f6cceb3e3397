"""Will it fit?  A step's memory per rank: the model states, and what the step keeps on top -- activations above all.

Model states come from each stage's own formula (:meth:`Stage.state_bytes`, the ZeRO paper's Table 1).  What a
step adds is what backward needs of the forward, and no ZeRO stage shrinks it.  Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", eq. 1) count it for a transformer layer in 16 bits:
s*b*h*(34 + 5*a*s/h) bytes -- attention 11sbh + 5as^2b (the QKV input 2sbh, Q and K 4sbh, the softmax's output
2as^2b, its dropout mask as^2b and the dropout's output 2as^2b, V 2sbh, the projection's input 2sbh and its dropout
mask sbh), the MLP 19sbh (its input 2sbh, GeLU's input 8sbh and output 8sbh, a dropout mask sbh) and the two
LayerNorms' inputs 4sbh.  minizero's GPT has no dropout: 32sbh + 2as^2b.  With every block checkpointed (their "full
recomputation", :mod:`minizero.parts.activations`) a layer keeps only its input, 2sbh, and backward holds one layer's
activations at a time while it replays it.  After the blocks, the final LayerNorm's and the head's inputs (2sbh
each) and the logits with their log-softmax (sbV each, in fp32 always: a stage hands the loss fp32 logits,
:func:`minizero.stages.mixed.cast_call`): terms outside the layers, which eq. 1, a count per layer, leaves out, and
which weigh most in a small model with a large vocabulary.  In fp32, every other figure doubles.

:func:`fits` answers "will it fit on this GPU, and if not, what is the smallest change that makes it fit?".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...parts.buckets import MAX_IN_FLIGHT
from ...parts.precision import Precision
from ...stages import STAGES, distributed
from ...stages.facts import GradientMemory
from .backward_memory import backward_peak
from .optimizers import FOREACH_TEMPORARIES, LOOP_TEMPORARIES, STATE_TENSORS

MASTER_BYTES = 4  # fp32: the masters under mixed precision, everything in plain fp32 training
LOSS_BYTES = 4  # the logits the loss sees, and their log-softmax: fp32 under every precision

#: GPT-3's family (Brown et al. 2020, Table 2.1): Psi -> (layers, hidden, heads), the shape ``--params`` assumes.
GPT3 = {125e6: (12, 768, 12), 350e6: (24, 1024, 16), 760e6: (24, 1536, 16), 1.3e9: (24, 2048, 24),
        2.7e9: (32, 2560, 32), 6.7e9: (32, 4096, 32), 13e9: (40, 5140, 40), 175e9: (96, 12288, 96)}


@dataclass(frozen=True)
class Shape:
    """A GPT: ``layers`` blocks of width ``hidden`` with ``heads`` heads, sequences of ``seq`` tokens, a vocabulary
    of ``vocab``; ``dropout``: its layers drop out (Megatron's GPT, the formula's model) or not (minizero's)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 50257
    dropout: bool = True

    @classmethod
    def of_params(cls, psi: float, seq: int) -> "Shape":
        """The GPT-3 shape nearest ``psi`` parameters (by ratio)."""
        nearest = min(GPT3, key=lambda p: max(p, psi) / min(p, psi))
        layers, hidden, heads = GPT3[nearest]
        return cls(layers, hidden, heads, seq)


def activation_bytes(shape: Shape, micro_batch: int, element_bytes: int, checkpointed: bool = False) -> dict:
    """Bytes of activations one rank keeps for backward at the end of a micro-batch's forward (``blocks``,
    ``head``) and the most it holds in backward (``peak``: with checkpointing, the kept inputs plus one block
    replayed)."""
    s, b, h, a, v = shape.seq, micro_batch, shape.hidden, shape.heads, shape.vocab
    half = element_bytes / 2  # the formula counts 16-bit bytes
    per_block = s * b * h * ((34 if shape.dropout else 32) + (5 if shape.dropout else 2) * a * s / h) * half
    head = 2 * s * b * h * element_bytes + 2 * s * b * v * LOSS_BYTES
    if checkpointed:
        kept = shape.layers * s * b * h * element_bytes
        return {"blocks": kept, "head": head, "peak": kept + head + per_block, "per_block": per_block}
    blocks = shape.layers * per_block
    return {"blocks": blocks, "head": head, "peak": blocks + head, "per_block": per_block}


def loss_gradient_bytes(shape: Shape, micro_batch: int) -> float:
    """The loss's backward makes the log-softmax's gradient and then the logits' (fp32, s*b*V each) beside the
    log-softmax: one vocabulary-sized tensor more than the end of forward held."""
    return shape.seq * micro_batch * shape.vocab * LOSS_BYTES


def backward_activation_bytes(shape: Shape, micro_batch: int, element_bytes: int, checkpointed: bool = False) -> float:
    """The most activations a rank holds at any moment of backward: at its start (every block's, or their inputs,
    the head's, and the loss's gradient), or in a block's backward (:func:`.backward_memory.backward_peak` with no
    gradients: what the block has not freed, its replay when checkpointed, the gradient through its MLP, the head's
    gradient waiting for the tied embedding's)."""
    acts = activation_bytes(shape, micro_batch, element_bytes, checkpointed)
    walk = backward_peak(GradientMemory(kept=True), shape, acts["per_block"], acts["blocks"] / shape.layers, micro_batch,
                         element_bytes, 1)
    return max(acts["blocks"] + acts["head"] + loss_gradient_bytes(shape, micro_batch), walk["total"])


def gathered_unit_bytes(stage: str, shape: Shape, element_bytes: int, prefetch: int = 1) -> float:
    """ZeRO-3's working set in the working precision: the root unit (the embeddings, tied to the head, and the final
    LayerNorm: gathered for the whole forward and again for the whole backward), the block computing and the
    ``prefetch`` blocks gathering behind it (12h^2 + 13h parameters each).  None for a stage that keeps its
    parameters whole."""
    if not STAGES[stage].shards.parameters:
        return 0.0
    h = shape.hidden
    root = (shape.vocab + shape.seq + 2) * h
    return (root + min(1 + prefetch, shape.layers) * (12 * h * h + 13 * h)) * element_bytes


def stepped_params(stage: str, psi: float, world_size: int) -> float:
    """How many parameters a rank's optimizer steps: the owned shard's under ZeRO, every one otherwise."""
    cls = STAGES[stage]
    return psi / (cls.shard_count(world_size) if cls.shards.optimizer_states else 1)


def step_gradient_bytes(stage: str, psi: float, world_size: int, precision: str, offloaded: bool = False) -> float:
    """Mixed precision's temporary fp32 gradients at the step: each gradient the optimizer steps, widened to fp32
    beside its master (:class:`~minizero.parts.masters.MasterWeights`) -- the owned shard's under ZeRO, every
    parameter's otherwise -- and freed after the step.  Offloaded, they are made on the host."""
    if not Precision.of(precision).mixed or offloaded:
        return 0.0
    return stepped_params(stage, psi, world_size) * MASTER_BYTES


def step_temporary_bytes(stage: str, psi: float, world_size: int, optimizer: str, offloaded: bool = False,
                         foreach: bool = True, largest: float = 0.0) -> float:
    """The optimizer's own intermediates at the step on the device.  torch's foreach implementation (its default on a
    GPU) computes over whole tensor lists, so each intermediate (:data:`~.optimizers.FOREACH_TEMPORARIES`) is as large
    as the fp32 state it steps -- the owned shard's under ZeRO.  The for-loop one (the CPU's) steps one tensor at a
    time: :data:`~.optimizers.LOOP_TEMPORARIES` of the ``largest`` tensor it steps (elements: a parameter, or the
    piece of one a ZeRO rank owns).  Offloaded, the step runs on the host."""
    if offloaded:
        return 0.0
    stepped = stepped_params(stage, psi, world_size)
    if foreach:
        return FOREACH_TEMPORARIES[optimizer] * stepped * MASTER_BYTES
    return LOOP_TEMPORARIES[optimizer] * min(largest, stepped) * MASTER_BYTES


def step_bytes(stage: str, psi: float, shape: Shape, world_size: int, micro_batch: int, precision: str = "bf16",
               optimizer: str = "adam", checkpointed: bool = False, offloaded: bool = False,
               foreach: bool = True, bucket_mb: float = 25.0, reduce_scatter_buffers: int = MAX_IN_FLIGHT) -> dict:
    """One rank's peak on the device, by component: the model states (the stage's formula), and on top of them the
    most of four moments --
      the start of backward: every block's activations (checkpointed: inputs), the head's, and the loss's gradient
        (one more s*b*V fp32 tensor beside the log-softmax);
      backward (:mod:`.backward_memory`): activations freed block by block as gradients are born, backward's working
        memory, and ZeRO-2's and -3's packed buckets (``buckets``);
      after backward: DDP's flat copy of every gradient for its all-reduce (a stage's ``after_backward_elements``);
      the step: mixed precision's fp32 gradients and the optimizer's intermediates -- with ``foreach``, torch's
        default on a GPU, as large as what it steps; else one tensor's worth (activations are freed by then).
    The first two count without the gradients ``zero_grad()`` freed (a stage whose gradients are born in backward),
    with ZeRO-3's gathered units.  ``host``: what optimizer offload keeps in host memory.  ``in_flight``: what of a
    peak in backward the communication thread's timing decides -- the bucket being reduced and ZeRO-3's prefetched
    block, both counted as held (the bound a "fits" needs): a measured peak lies up to this much below ``total``."""
    cls, k = STAGES[stage], STATE_TENSORS[optimizer]
    working = Precision.of(precision).working_bytes(MASTER_BYTES)
    states = cls.state_bytes(psi, world_size, MASTER_BYTES, k, precision, offload_optimizer=offloaded)
    memory = cls.gradient_memory
    shards = cls.shard_count(world_size) if cls.shards.gradients else 1
    freed = 0.0 if memory.kept else psi / shards * working  # the gradients zero_grad() freed, born again
    acts = activation_bytes(shape, micro_batch, working, checkpointed)
    start = acts["blocks"] + acts["head"] + loss_gradient_bytes(shape, micro_batch)
    walk = backward_peak(memory, shape, acts["per_block"], acts["blocks"] / shape.layers, micro_batch, working, shards,
                         bucket_mb, reduce_scatter_buffers)
    gathered = gathered_unit_bytes(stage, shape, working)
    after = cls.after_backward_elements(psi, world_size) * working
    gradients = step_gradient_bytes(stage, psi, world_size, precision, offloaded)
    largest = max(4 * shape.hidden * shape.hidden, shape.vocab * shape.hidden)  # the MLP's matrices, the embedding
    temporaries = step_temporary_bytes(stage, psi, world_size, optimizer, offloaded, foreach, largest)
    backward = states - freed + gathered + max(start, walk["total"])
    buckets = walk["buckets"] if walk["total"] > start else 0.0
    prefetched = gathered - gathered_unit_bytes(stage, shape, working, prefetch=0)
    in_backward = backward >= max(states + after, states + gradients + temporaries)
    return {"model_states": states, "activations": backward_activation_bytes(shape, micro_batch, working, checkpointed),
            "gathered_units": gathered,
            "buckets": buckets, "after_backward": after, "in_flight": buckets + prefetched if in_backward else 0.0,
            "step_gradients": gradients, "optimizer_temporaries": temporaries, "freed_gradients": freed,
            "backward": backward - states,
            "total": max(backward, states + after, states + gradients + temporaries),
            "host": cls.host_state_bytes(psi, world_size, MASTER_BYTES, k, precision, offload_optimizer=offloaded)}


def offloads(stage: str) -> bool:
    """Does ``stage`` take ``offload_optimizer`` (the ZeRO stages declare it)?"""
    return "offload_optimizer" in STAGES[stage].option_names()


@dataclass(frozen=True)
class Plan:
    stage: str
    world_size: int
    micro_batch: int
    checkpointed: bool
    offloaded: bool = False

    def change_from(self, other: "Plan") -> str:
        said = []
        if self.checkpointed != other.checkpointed:
            said.append("--checkpoint-activations")
        if self.stage != other.stage:
            said.append(f"stage {self.stage}")
        if self.offloaded != other.offloaded:
            said.append("--offload-optimizer")
        if self.micro_batch != other.micro_batch:
            said.append(f"--micro-batch {self.micro_batch}")
        if self.world_size != other.world_size:
            said.append(f"--world-size {self.world_size}")
        return " + ".join(said)


def sharded_kinds(stage: str) -> int:
    """How many of the ZeRO paper's three kinds of model state ``stage`` divides among its ranks (P_os, +g, +p)."""
    shards = STAGES[stage].shards
    return shards.optimizer_states + shards.gradients + shards.parameters


def further_stages(stage: str) -> list[str]:
    """The stages equivalent to single-device training that shard more of the model state than ``stage``: the
    next ZeRO stages first."""
    more = [s for s in distributed() if STAGES[s].equivalent and sharded_kinds(s) > sharded_kinds(stage)]
    return sorted(more, key=sharded_kinds)


def smallest_change(plan: Plan, fits_with) -> Plan | None:
    """The first plan that fits, trying one change, then two, the cheapest first: checkpointing (one more forward),
    a stage that shards more (more communication: ZeRO-3's is 1.5x), offloading the optimizer (the step on the CPU,
    2Psi/N bytes each way over PCIe), halving the micro-batch (more micro-batches per step), more ranks (up to 16x:
    money)."""
    def single(p: Plan):
        if not p.checkpointed:
            yield replace(p, checkpointed=True)
        yield from (replace(p, stage=s) for s in further_stages(p.stage) if offloads(s) or not p.offloaded)
        if not p.offloaded and offloads(p.stage):
            yield replace(p, offloaded=True)
        mb = p.micro_batch // 2
        while mb >= 1:
            yield replace(p, micro_batch=mb)
            mb //= 2
        yield from (replace(p, world_size=p.world_size * k) for k in (2, 4, 8, 16))

    for candidate in single(plan):
        if fits_with(candidate):
            return candidate
    for first in single(plan):
        for candidate in single(first):
            if fits_with(candidate):
                return candidate
    return None


def fits(psi: float, shape: Shape, plan: Plan, gpu_bytes: float, precision: str = "bf16",
         optimizer: str = "adam", bucket_mb: float = 25.0,
         reduce_scatter_buffers: int = MAX_IN_FLIGHT) -> tuple[dict, Plan | None]:
    """``(the peak by component, the smallest change that fits -- the plan itself if it fits, None if nothing
    tried fits)``."""
    def peak(p: Plan) -> dict:
        return step_bytes(p.stage, psi, shape, p.world_size, p.micro_batch, precision, optimizer, p.checkpointed,
                          p.offloaded, bucket_mb=bucket_mb, reduce_scatter_buffers=reduce_scatter_buffers)

    here = peak(plan)
    if here["total"] <= gpu_bytes:
        return here, plan
    return here, smallest_change(plan, lambda p: peak(p)["total"] <= gpu_bytes)


UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30,
         "TIB": 2 ** 40}


def gpu_bytes(text: str) -> float:
    """``80GB`` (the vendors' GB, 1e9: an "80 GB" H100 holds 79.6 GiB of it), ``80GiB``, or bytes."""
    number = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if number.endswith(unit):
            value, scale = number[:-len(unit)], UNITS[unit]
            break
    else:
        value, scale = number, 1
    try:
        size = float(value) * scale
    except ValueError:
        size = float("nan")
    if not 0 < size < float("inf"):
        raise ValueError(f"--gpu {text!r}: give a memory size such as 80GB, 40GiB or 8e10 (bytes)")
    if size < UNITS["MB"]:  # "--gpu 80" meant 80 GB: no device has less than a megabyte
        raise ValueError(f"--gpu {text!r} is {size:g} bytes -- no GPU is that small; give a unit, such as "
                         f"{text.strip()}GB")
    return size
