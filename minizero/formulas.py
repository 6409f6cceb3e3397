"""The paper's numbers, to print beside what was measured.

Ψ = parameters that receive gradients, N = data-parallel ranks, b = bytes per
gradient element.  Ring collectives: reduce-scatter and all-gather each send
(N-1)/N of the tensor per rank; an all-reduce is both (ZeRO paper, section 7).
"""
from __future__ import annotations


def sent_bytes_per_step(stage: str, psi: int, world_size: int, grad_bytes: int, param_bytes: int | None = None) -> float:
    """Bytes each rank sends per optimizer step, on average over ranks.

    ``grad_bytes`` per gradient element on the wire (2 with compression),
    ``param_bytes`` per parameter element (ZeRO all-gathers parameters)."""
    n = world_size
    param_bytes = param_bytes or grad_bytes
    ring = (n - 1) / n * psi  # elements one reduce-scatter or all-gather sends per rank
    if stage == "reference":
        return 0.0
    if stage in ("ddp", "ddp-bucketed"):
        return 2 * ring * grad_bytes  # one all-reduce of the gradients per step, however many micro-batches
    if stage in ("zero1", "zero2"):
        return ring * grad_bytes + ring * param_bytes  # reduce-scatter gradients + all-gather parameters
    if stage == "zero3":  # all-gather before forward and again before backward, reduce-scatter gradients
        return ring * grad_bytes + 2 * ring * param_bytes
    if stage == "zero3-no-reshard":  # parameters stay gathered from forward to backward
        return ring * grad_bytes + ring * param_bytes
    raise ValueError(f"no byte formula for stage {stage!r}")


def root_all_reduce_bytes(nbytes: int, world_size: int) -> tuple[int, int]:
    """(bytes the root sends, bytes each other rank sends) in a gather-reduce-broadcast all-reduce."""
    return (world_size - 1) * nbytes, nbytes if world_size > 1 else 0


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * nbytes


#: Full-size optimizer state tensors per parameter: Adam keeps m and v, momentum one buffer.
STATE_TENSORS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2}


def state_bytes(stage: str, psi: int, world_size: int, element_size: int, state_tensors: int) -> float:
    """Model-state bytes per rank (ZeRO paper, Table 1, with fp32 everywhere): parameters,
    gradients and optimizer states, whole or divided by N as the stage shards them."""
    params = psi * element_size
    grads = psi * element_size
    states = psi * element_size * state_tensors
    n = world_size
    if stage in ("reference", "ddp", "ddp-bucketed"):
        return params + grads + states  # fp32 Adam: 16 Psi
    if stage == "zero1":
        return params + grads + states / n  # 8 Psi + 8 Psi / N
    if stage == "zero2":
        return params + (grads + states) / n  # 4 Psi + 12 Psi / N
    if stage == "zero3":
        return (params + grads + states) / n  # 16 Psi / N, plus the gathered working set
    raise ValueError(f"no memory formula for stage {stage!r}")
