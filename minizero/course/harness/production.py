"""Production names and knobs, mapped to minizero's -- as data that checks itself (lesson 14).

A practitioner meets DDP and ZeRO through torch's and DeepSpeed's names: ``fully_shard``,
``reshard_after_forward``, ``bucket_cap_mb``, ``overlap_comm``.  Each :class:`Row` says what a name does,
what minizero calls the same thing (or that it has none), and how that was checked:

* **torch rows** carry :class:`Torch` checks, run against the *installed* torch: the import path resolves,
  the keyword is in ``inspect.signature``, its default is the one stated, the enum member exists, a constant
  has the stated value.  A row whose check fails says so in its verdict -- a table of names that drifts from
  torch does not stay green (``tests/test_production_names.py`` feeds it a made-up name to prove it);
* **minizero's side** carries :class:`Ours` checks against the stages' declared options
  (:mod:`minizero.stages.options`): the option exists, with the stated default;
* **DeepSpeed rows** cannot be checked here (DeepSpeed is not installed): their keys and defaults are taken from
  ``DeepSpeedZeroConfig`` in DeepSpeed's source (:data:`DEEPSPEED_SOURCE` names the release), and the verdict
  says so.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from ...stages import DDP, BucketedDDP, ZeRO1, ZeRO2, ZeRO3, ZeROPlusPlus
from .show import resolve

#: Where the DeepSpeed rows come from: the class that parses the ``zero_optimization`` block of a config, read in the
#: source distribution of a release (every key and default in the rows below was compared with it).
DEEPSPEED_SOURCE = "DeepSpeed 0.19.8's DeepSpeedZeroConfig (deepspeed/runtime/zero/config.py, the PyPI release)"
_ANY = object()  # "no default stated"


@dataclass(frozen=True)
class Torch:
    """One fact about the installed torch: ``path`` resolves; ``parameter`` is a keyword of its signature (with
    ``default``, if stated; ``annotation`` a word its type annotation holds); ``member`` is a member of the enum
    at ``path``; ``value`` is what the object at ``path`` equals."""

    path: str
    parameter: str | None = None
    default: object = _ANY
    annotation: str | None = None
    member: str | None = None
    value: object = _ANY

    def check(self) -> str:
        """What was found, in a few words; raises ``LookupError`` saying what is not as stated."""
        short = self.path.rsplit(".", 1)[-1]
        try:
            obj = resolve(self.path)
        except (ImportError, AttributeError) as error:
            raise LookupError(f"{self.path} does not resolve ({error})") from None
        if self.member is not None:
            if self.member not in getattr(obj, "__members__", {}):
                raise LookupError(f"{short} has no member {self.member}")
            return f"{short}.{self.member} exists"
        if self.value is not _ANY:
            if obj != self.value:
                raise LookupError(f"{short} is {obj!r}, not {self.value!r}")
            return f"{short} == {obj!r}"
        if self.parameter is None:
            return f"{short} exists"
        target = obj.__init__ if inspect.isclass(obj) and "__init__" in vars(obj) else obj
        parameters = inspect.signature(target).parameters
        if self.parameter not in parameters:
            raise LookupError(f"{short}() takes no parameter {self.parameter!r}")
        found = parameters[self.parameter]
        if self.default is not _ANY and found.default != self.default:
            raise LookupError(f"{short}({self.parameter}=...) defaults to {found.default!r}, "
                              f"not {self.default!r}")
        if self.annotation is not None and self.annotation not in str(found.annotation):
            raise LookupError(f"{short}({self.parameter}: {found.annotation}) does not take {self.annotation}")
        said = f": {found.annotation}" if self.annotation else "" if self.default is _ANY else f"={found.default!r}"
        return f"{short}({self.parameter}{said})"


@dataclass(frozen=True)
class Ours:
    """minizero's side: stage ``stage`` is registered, and declares option ``option`` (with default ``default``,
    if stated) or has method ``method``."""

    stage: type  # the stage's class: its name and options are read from it, never spelled here
    option: str | None = None
    default: object = _ANY
    method: str | None = None

    def check(self) -> str:
        from minizero.stages import STAGES
        name = self.stage.name
        if STAGES.get(name) is not self.stage:
            raise LookupError(f"minizero registers no stage {name!r} as {self.stage.__name__}")
        if self.method is not None:
            if not callable(getattr(self.stage, self.method, None)):
                raise LookupError(f"stage {name} has no method {self.method}()")
            return f"{name}.{self.method}()"
        if self.option is None:
            return f"stage {name}"
        declared = {o.name: o.default for o in self.stage.options}
        if self.option not in declared:
            raise LookupError(f"stage {name} has no option {self.option!r}")
        if self.default is not _ANY and declared[self.option] != self.default:
            raise LookupError(f"{name}({self.option}=...) defaults to {declared[self.option]!r}, "
                              f"not {self.default!r}")
        said = "" if self.default is _ANY else f"={declared[self.option]!r}"
        return f"{name}({self.option}{said})"


@dataclass(frozen=True)
class Row:
    """A production name, what it does, minizero's equivalent, and the facts that check both."""

    name: str
    does: str
    minizero: str
    torch: tuple[Torch, ...] = ()
    ours: tuple[Ours, ...] = ()
    deepspeed: bool = False

    def verdict(self) -> str:
        """``ok: ...`` with what was found, ``WRONG: ...`` with what is not so, or where an unchecked row is from."""
        found = []
        try:
            found = [fact.check() for fact in (*self.torch, *self.ours)]
        except LookupError as error:
            return f"WRONG: {error}"
        if not self.ours and not self.minizero.startswith("none"):  # minizero's column is held to the code too
            return "WRONG: the minizero column names something of minizero's with no Ours fact to check it"
        if self.deepspeed:
            return "from DeepSpeed's source, not checked here" + (f"; ok: {'; '.join(found)}" if found else "")
        return "ok: " + "; ".join(found) if found else "not checked"


_FSDP, _DDP = "torch.distributed.fsdp", "torch.nn.parallel.DistributedDataParallel"
_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"

ROWS: tuple[Row, ...] = (
    # ------------------------------------------------------------------ FSDP2 and FSDP1
    Row("FSDP2 fully_shard(module)",
        "shards each parameter of the module on dim 0 as a DTensor (Shard(0), padded); the module is one unit",
        "zero3: a unit's parameters end to end in one flat buffer, cut in N equal shards; a parameter may "
        "straddle two ranks", (Torch(f"{_FSDP}.fully_shard", "shard_placement_fn", None),), (Ours(ZeRO3, "units"),)),
    Row("FSDP2 param.grad after backward",
        "a DTensor sharded as its parameter: full_tensor() all-gathers the whole gradient, to_local() is this rank's "
        "rows", "zero3: param.grad a sharded gradient with full_tensor() and to_local() (a range of the flattened "
        "parameter); stage.full_gradients() gathers them all",
        (Torch("torch.distributed.tensor.DTensor.full_tensor"), Torch("torch.distributed.tensor.DTensor.to_local")),
        (Ours(ZeRO3, method="full_gradients"),)),
    Row("fully_shard(reshard_after_forward=True)",
        "frees gathered parameters after forward, all-gathers again in backward: 3Ψ bytes per step. "
        "Default None: True except for the root",
        "zero3(reshard_after_forward=True), the default",
        (Torch(f"{_FSDP}.fully_shard", "reshard_after_forward", None),), (Ours(ZeRO3, "reshard_after_forward", True),)),
    Row("fully_shard(reshard_after_forward=False)",
        "keeps a unit gathered from forward to backward: 2Ψ bytes, unsharded parameters in memory meanwhile",
        "zero3(reshard_after_forward=False)", (Torch(f"{_FSDP}.fully_shard", "reshard_after_forward"),),
        (Ours(ZeRO3, "reshard_after_forward"),)),
    Row("fully_shard(reshard_after_forward=<int>)",
        "after forward, reshards to a smaller group (e.g. the node), so backward's all-gather stays in it",
        "zeropp(hpz=True): ZeRO++'s hpZ, the same trade with the node's G ranks as the smaller group",
        (Torch(f"{_FSDP}.fully_shard", "reshard_after_forward", annotation="int"),), (Ours(ZeROPlusPlus, "hpz", False),)),
    Row("FSDP1 ShardingStrategy.SHARD_GRAD_OP",
        "gathers parameters before forward and reshards only after backward; gradients and optimizer states "
        "sharded. Often called ZeRO-2, but parameters are sharded between steps too",
        "zero3(reshard_after_forward=False); zero2 moves the same 2Ψ but keeps all parameters on every rank",
        (Torch(f"{_FSDP}.ShardingStrategy", member="SHARD_GRAD_OP"),), (Ours(ZeRO3, "reshard_after_forward"), Ours(ZeRO2))),
    Row("FSDP1 ShardingStrategy.FULL_SHARD", "reshards after forward and after backward: ZeRO-3",
        "zero3 with its default reshard_after_forward=True", (Torch(f"{_FSDP}.ShardingStrategy", member="FULL_SHARD"),),
        (Ours(ZeRO3, "reshard_after_forward", True),)),
    Row("MixedPrecisionPolicy(param_dtype=...)",
        "dtype of the gathered parameters: the all-gather and the compute. The sharded parameters keep "
        "their dtype, and the optimizer steps them", "precision='bf16' or 'fp16': a 16-bit working copy, "
        "fp32 masters for the owned shard", (Torch(f"{_FSDP}.MixedPrecisionPolicy", "param_dtype", None),),
        (Ours(ZeRO3, "precision", "fp32"),)),
    Row("MixedPrecisionPolicy(reduce_dtype=...)",
        "dtype of the gradient reduce-scatter or all-reduce; None: the compute dtype",
        "Precision(reduce_dtype=None or 'fp32'); in fp32 runs, compress='fp16'/'bf16'",
        (Torch(f"{_FSDP}.MixedPrecisionPolicy", "reduce_dtype", None),), (Ours(ZeRO2, "compress", None),)),
    Row("fully_shard(offload_policy=CPUOffloadPolicy())",
        "keeps sharded parameters, gradients and the optimizer step on the CPU",
        "offload_optimizer=True: the optimizer's side only (masters, states, the step); parameters and gradients "
        "stay on the device",
        (Torch(f"{_FSDP}.CPUOffloadPolicy", "pin_memory", True),), (Ours(ZeRO3, "offload_optimizer", False),)),
    Row("FSDPModule.set_modules_to_forward_prefetch",
        "which units' all-gathers to issue ahead of use (implicit prefetch otherwise)",
        "zero3(prefetch=1): how many units ahead", (Torch(f"{_FSDP}.FSDPModule.set_modules_to_forward_prefetch"),),
        (Ours(ZeRO3, "prefetch", 1),)),
    Row("FSDPModule.set_reduce_scatter_max_input_buffers", "packed gradient buffers whose reduce-scatter may be in "
        "flight before backward packs the next (1: it waits; more: one more bucket each; experimental in 2.13)",
        "zero2/zero3(reduce_scatter_buffers=1)", (Torch(f"{_FSDP}.FSDPModule.set_reduce_scatter_max_input_buffers",
                                                         "max_input_buffers"),),
        (Ours(ZeRO2, "reduce_scatter_buffers", 1), Ours(ZeRO3, "reduce_scatter_buffers", 1))),
    Row("ZeroRedundancyOptimizer",
        "ZeRO-1 with whole parameters given to ranks; all-reduce, then each rank broadcasts its updated "
        "parameters: about 3Ψ", "zero1: flat shards, reduce-scatter + all-gather: 2Ψ",
        (Torch("torch.distributed.optim.ZeroRedundancyOptimizer", "overlap_with_ddp", False),), (Ours(ZeRO1),)),
    # ------------------------------------------------------------------ torch DDP
    Row("DDP bucket_cap_mb", "bucket size; default None means 25 MiB",
        "ddp-bucketed and zero2: bucket_mb=25.0",
        (Torch(_DDP, "bucket_cap_mb", None), Torch("torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB", value=25)),
        (Ours(BucketedDDP, "bucket_mb", 25.0),)),
    Row("DDP first bucket", "with bucket_cap_mb left at None, the first bucket is capped at 1 MiB so the first "
        "all-reduce starts early; a cap you set applies to every bucket",
        "none: every bucket has the same cap", (Torch("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES", value=2**20),)),
    Row("DDP bucket rebuild",
        "unless find_unused_parameters=True and static_graph=False, or bucket_cap_mb_list sets each bucket's cap, "
        "the first iteration has one bucket of everything; then buckets are rebuilt in the order gradients "
        "became ready", "none: buckets stay in reverse registration order (minizero.stages.ddp_bucketed.assign_buckets)",
        (Torch("torch._C._distributed_c10d.Reducer._rebuild_buckets"),
         Torch("torch.nn.parallel.distributed._BucketCapacityConfig.compute_bucket_size_limits", "static_graph"),
         Torch(_DDP, "bucket_cap_mb_list", None))),
    Row("DDP gradient_as_bucket_view", ".grad becomes a view into its bucket: no copy, one gradient buffer less",
        "ddp-bucketed always does this", (Torch(_DDP, "gradient_as_bucket_view", False),), (Ours(BucketedDDP),)),
    Row("DDP static_graph",
        "promises the same graph and the same unused parameters every step; DDP records them once",
        "none", (Torch(_DDP, "static_graph", False),)),
    Row("DDP find_unused_parameters",
        "finds parameters that get no gradient this step and marks them ready, so buckets complete",
        "find_unused_parameters=False on every averaging stage; an all-reduced bitmap of used parameters",
        (Torch(_DDP, "find_unused_parameters", False),), (Ours(BucketedDDP, "find_unused_parameters", False),)),
    Row("DDP no_sync()", "skips gradient synchronisation for accumulation micro-batches",
        "stage.no_sync(), same name", (Torch(f"{_DDP}.no_sync"),), (Ours(DDP, method="no_sync"),)),
    Row("DDP register_comm_hook(state, hook)", "replaces each bucket's all-reduce by your function",
        "none as a hook: the wire is an option (compress=)", (Torch(f"{_DDP}.register_comm_hook", "hook"),)),
    Row("fp16_compress_hook / bf16_compress_hook",
        "casts the bucket to 16 bits, divides by N in 16 bits, all-reduces, casts back",
        "compress='fp16' / 'bf16': divides by a power of two before the cast, the rest after the sum",
        (Torch(f"{_HOOKS}.fp16_compress_hook", "bucket"), Torch(f"{_HOOKS}.bf16_compress_hook", "bucket")),
        (Ours(BucketedDDP, "compress", None),)),
    # ------------------------------------------------------------------ DeepSpeed: from its source, not checked
    Row("DeepSpeed overlap_comm", "overlaps gradient reduction with backward. Default None: True at "
        "stage 3, else False",
        "ddp-bucketed, zero2, zero3 overlap on the communication thread: on a CPU; on a GPU only the host's "
        "launches (lesson 5); ddp, zero1 never", ours=(Ours(BucketedDDP), Ours(ZeRO2), Ours(ZeRO3)), deepspeed=True),
    Row("DeepSpeed reduce_bucket_size", "elements reduced at a time (default 5e8)",
        "bucket_mb, in MiB not elements", ours=(Ours(ZeRO2, "bucket_mb"),), deepspeed=True),
    Row("DeepSpeed allgather_bucket_size",
        "elements all-gathered at a time after the step, stages 1-2 (default 5e8)",
        "none: one all-gather per flat group", deepspeed=True),
    Row("DeepSpeed contiguous_gradients",
        "copies gradients into a contiguous buffer as they are produced, against fragmentation (default True)",
        "ddp-bucketed: .grad is a view into its bucket; zero2 packs each bucket into a flat buffer",
        ours=(Ours(BucketedDDP), Ours(ZeRO2)), deepspeed=True),
    Row("DeepSpeed stage3_prefetch_bucket_size", "parameter elements fetched ahead of use (default 5e7)",
        "zero3(prefetch=...), counted in units, not elements", ours=(Ours(ZeRO3, "prefetch"),), deepspeed=True),
    Row("DeepSpeed stage3_param_persistence_threshold",
        "parameters smaller than this are not partitioned (default 1e5 elements)",
        "zero3(replicate=...): by module, not by size", ours=(Ours(ZeRO3, "replicate", None),), deepspeed=True),
    Row("DeepSpeed stage3_max_live_parameters",
        "most parameters resident per GPU before releasing (default 1e9)",
        "none: the gathered set is the root, the unit computing and `prefetch` units", deepspeed=True),
    Row("DeepSpeed offload_optimizer", "optimizer states and step on CPU or NVMe: ZeRO-Offload (default off)",
        "zero1/2/3, hsdp: offload_optimizer=True, the owned shard's masters and optimizer states in host memory, "
        "the step on the CPU (no NVMe)", ours=(Ours(ZeRO2, "offload_optimizer", False),), deepspeed=True),
)


def table_markdown(rows: tuple[Row, ...] = ROWS) -> str:
    """The rows as a Markdown table with each row's verdict: what a lesson displays."""
    lines = ["| production name | what it does | minizero | checked |", "|---|---|---|---|"]
    for row in rows:
        cells = [row.name, row.does, row.minizero, row.verdict()]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def wrong(rows: tuple[Row, ...] = ROWS) -> list[str]:
    """The rows whose facts are not so, with what is wrong: empty when every checked name is right."""
    return [f"{row.name}: {row.verdict()}" for row in rows if row.verdict().startswith("WRONG")]


def left_out(rows: tuple[Row, ...] = ROWS) -> list[str]:
    """The production names minizero has no equivalent for: the rows whose minizero column begins with "none".

    A lesson lists what minizero leaves out from this, not from a sentence typed beside the table, so a row added
    or changed cannot leave the list behind."""
    return [row.name for row in rows if row.minizero.startswith("none")]


def layouts(named_params: list[tuple[str, object]], world_size: int) -> list[dict]:
    """Who owns how many elements of each parameter, under FSDP2's dim-0 sharding and under minizero's flat layout.

    FSDP2's side uses torch's own ``_chunk_with_empty`` (what ``FSDPParam`` shards with): rank r keeps chunk r of
    dim 0, padded to chunk 0's size.  minizero's side builds a :class:`~minizero.parts.layout.FlatGroup` per rank over
    copies of the parameters and reads its pieces.  Per parameter: ``fsdp2`` and ``flat`` are elements held per
    rank, ``fsdp2_pad`` the padding FSDP2 adds for it; the group's one padding is in the last row's ``flat_pad``."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from minizero.parts.layout import FlatGroup
    copies = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named_params]
    groups = [FlatGroup(copies, rank, world_size) for rank in range(world_size)]
    rows = []
    for i, (name, p) in enumerate(named_params):
        chunks = _chunk_with_empty(p.detach(), world_size, dim=0)
        held = [c.numel() for c in chunks]
        padded = chunks[0].numel()
        flat = [sum(pc.stop - pc.start for pc in g.pieces if pc.segment.name == name) for g in groups]
        rows.append({"name": name, "shape": tuple(p.shape), "fsdp2": held, "fsdp2_pad": padded * world_size - p.numel(),
                     "flat": flat})
    rows[-1]["flat_pad"] = groups[0].shard_size * world_size - groups[0].numel
    return rows
