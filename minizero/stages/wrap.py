"""What happens when a model is wrapped: the checks every stage runs first, the broadcast, and the routes that
let a loop written for torch drive the stage.

Before a stage touches a model it makes sure it can: one stage per model, no
tensor it cannot hold (meta device, sparse gradients), the same structure on
every rank.  Then rank 0's values are broadcast, so every replica starts
equal -- the first invariant of data parallelism.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm, Tag
from ..comm.fingerprint import digest


def claim(module: nn.Module, stage) -> None:
    """A model belongs to one stage: its hooks, and for ZeRO its parameters' storage, are that stage's.
    A second stage over the same model would run the first one's hooks too."""
    owner = getattr(module, "_minizero_stage", None)
    if owner is not None:
        raise ValueError(
            f"rank {stage.rank}: this model is already wrapped by a {owner} stage; a model belongs to one stage "
            f"(its hooks, buffers and parameter storage are the stage's). Build a fresh model -- or load a "
            f"state_dict into one -- for another stage.")
    module._minizero_stage = stage.name


def check_wrappable(module: nn.Module, rank: int) -> None:
    """What no stage can work with, refused at wrap time naming the tensor and the fix."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"rank {rank}: {name!r} is on the meta device (a shape without storage), so there is nothing to "
                f"broadcast or shard. Materialise the model first (model.to_empty(device=...) and initialise it).")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ValueError(
                f"rank {rank}: module {name!r} produces sparse gradients (sparse=True); minizero's buffers hold "
                f"dense gradients. Construct it with sparse=False.")


def check_same_model(module: nn.Module, comm: Comm) -> None:
    """Refuse to wrap models whose structure differs across ranks.

    Names, shapes, dtypes and ``requires_grad`` of parameters and buffers must
    agree -- values may differ, rank 0's are broadcast.  This runs before any
    other collective, because a mismatch would otherwise show up later as a
    hang or as silently misaligned flat buffers.  Two cheap rounds: a
    fingerprint of the whole model, and only on mismatch one per tensor, so
    every rank can name the first tensor that differs.
    """
    signature = [f"param {n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in module.named_parameters()]
    signature += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    n = comm.world_size
    mine = torch.tensor([len(signature), digest("\n".join(signature))], dtype=torch.float64)
    everyone = torch.empty(2 * n, dtype=torch.float64)
    comm.all_gather(everyone, mine, tag=Tag("model signature"))
    everyone = everyone.view(n, 2)
    if bool((everyone == everyone[0]).all()):
        return
    longest = int(everyone[:, 0].max())
    per_tensor = torch.full((longest,), -1.0, dtype=torch.float64)
    per_tensor[: len(signature)] = torch.tensor([digest(s) for s in signature], dtype=torch.float64)
    table = torch.empty(n * longest, dtype=torch.float64)
    comm.all_gather(table, per_tensor, tag=Tag("model signature, tensor by tensor"))
    table = table.view(n, longest)
    first = int((table != table[0]).any(dim=0).nonzero()[0])
    differing = [r for r in range(n) if table[r, first] != table[comm.rank, first]]
    here = signature[first] if first < len(signature) else "(no such tensor here)"
    raise ValueError(
        f"rank {comm.rank}: the model differs across ranks at wrap time; first difference at tensor "
        f"#{first}: here {here}, but ranks {differing} have something else. Build the same model on "
        f"every rank (names, shapes, dtypes, requires_grad); only values may differ, rank 0's are broadcast."
    )


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Make every replica start from rank ``src``'s parameters and buffers (as torch DDP does) --
    integer buffers (BatchNorm's counter) and non-contiguous tensors included.

    Coalesced, as torch DDP's ``_sync_module_states`` broadcasts them (``_broadcast_coalesced``, 250 MB buckets):
    the tensors of one dtype copied into one flat buffer, one broadcast each -- not a collective per tensor, whose
    fixed cost (a fingerprint, a latency per hop) a model of many small tensors would pay many times over."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    with torch.no_grad():
        for dtype, named in by_dtype.items():
            flat = torch.cat([tensor.detach().reshape(-1) for _, tensor in named])
            what = named[0][0] if len(named) == 1 else f"{len(named)} tensors, {named[0][0]} first"
            comm.broadcast(flat, src, tag=Tag(f"broadcast {str(dtype).removeprefix('torch.')} ({what})"))
            offset = 0
            for _, tensor in named:
                tensor.data.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
                offset += tensor.numel()


def check_optimizer_owns_only_model_parameters(optimizer: torch.optim.Optimizer, module: nn.Module, rank: int) -> None:
    """A parameter the optimizer holds but the model does not gets no gradient and no name: refuse it here."""
    in_model = {id(p) for p in module.parameters()}
    foreign = [(gi, tuple(p.shape)) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in in_model]
    if foreign:
        raise ValueError(
            f"rank {rank}: the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(param group, shape: {foreign[:3]}); ZeRO shards the model's parameters. Build the optimizer "
            f"over model.parameters() -- after any change to the model -- or after wrapping, over "
            f"stage.parameters().")


def route(optimizer: torch.optim.Optimizer, stage) -> None:
    """Whichever the user calls -- the stage's step()/zero_grad() or their optimizer's -- the stage's runs:
    the optimizer's own would step on unsynchronised (under ZeRO, unsharded; under mixed precision,
    16-bit) gradients."""
    optimizer.step, optimizer.zero_grad = stage.step, stage.zero_grad


def route_model(module: nn.Module, stage) -> None:
    """``model.zero_grad()`` -- the call a loop written for FSDP2 or DDP makes -- clears what the stage steps:
    under ZeRO the pieces' gradients, which the model's own zero_grad() would never reach (the steps
    would add up silently)."""
    module.zero_grad = stage.zero_grad
