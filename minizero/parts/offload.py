"""Optimizer-state offload (ZeRO-Offload, Ren et al. 2021): the step in host memory.

After ZeRO-2 the largest part of a rank's model state is the optimizer's:
K = 12 bytes per parameter under mixed precision (fp32 master, Adam's two
moments), against 2 + 2 for the 16-bit parameters and gradients.  ZeRO-Offload
moves those K bytes of the rank's shard to the host, where memory is large and
cheap, and computes the optimizer step there, on the CPU:

1. backward leaves the shard's averaged gradient on the device, in 16 bits;
2. it is **copied to the host** (2 bytes per element: it crosses in 16 bits
   and is widened to fp32 there), and the masters are stepped on the host;
3. each stepped master is rounded to 16 bits on the host and **copied back**
   into the device's working copy -- the parameters the next forward (and
   ZeRO's all-gather) uses.

So per step a rank moves 2Psi/N bytes each way over PCIe, and the device keeps
2Psi + 2Psi/N (ZeRO-2) where it kept 2Psi + 14Psi/N.  The price is the CPU's
step and the copies, which ZeRO-Offload hides behind the next backward; here
they run in line, one after the other: the point is where memory goes.

:class:`HostCopies` is the crossing: every copy between the device and the host
goes through it, and it counts the bytes in each direction, as the
communication layer counts what it sends.  :class:`~minizero.parts.masters.MasterWeights`
uses it to read gradients and write back parameters; in fp32 the masters are
plain fp32 copies of the shard, on the host (DeepSpeed offloads fp32 training
the same way).  On a machine without a GPU host and device are the same memory:
the copies are still made, placed and counted, so the bookkeeping is what the
suite proves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: Where offloaded state lives: host memory (DeepSpeed's ``offload_optimizer.device = "cpu"``).
HOST = torch.device("cpu")
#: How a stage's ``held_tensors()`` names a kind it keeps there (``host_master``, ``host_optimizer``): memory
#: accounting adds those up apart, as ``host`` (:func:`minizero.observe.memory.held_bytes`), not in the device's total.
HOST_KIND = "host_"


class HostCopies:
    """The copies between a stage's device and host memory, counted in bytes each way."""

    def __init__(self, host: torch.device = HOST):
        self.host = host
        self.to_host = 0  # bytes copied device -> host (gradients)
        self.to_device = 0  # bytes copied host -> device (updated parameters)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` to keep there for good (the masters): pinned when a GPU is in use, so
        the copies to and from it can run without staging."""
        kept = tensor.detach().to(self.host, copy=True)
        return kept.pin_memory() if tensor.is_cuda else kept

    def gradient(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``grad`` on the host in ``dtype``: it crosses in its own (16-bit) dtype and is widened there,
        so half the bytes cross.  Always a new tensor: the caller scales it in place."""
        self.to_host += grad.numel() * grad.element_size()
        return grad.to(self.host, copy=True).to(dtype)

    def write_back(self, working: torch.Tensor, master: torch.Tensor) -> None:
        """The stepped ``master``, rounded to the working dtype on the host, into the device's ``working``."""
        self.to_device += working.numel() * working.element_size()
        working.copy_(master.to(working.dtype))

    def counted(self) -> dict[str, int]:
        return {"to_host": self.to_host, "to_device": self.to_device}


@dataclass(frozen=True)
class OffloadPolicy:
    """What a ZeRO stage keeps off the device: one object, as FSDP2's ``fully_shard(offload_policy=...)``.
    ``optimizer``: this rank's fp32 masters and optimizer states in host memory, stepped there (ZeRO-Offload;
    DeepSpeed's ``offload_optimizer``).  Parameters and gradients stay on the device -- FSDP2's
    ``CPUOffloadPolicy`` moves those too, which is not built.  The command line's ``--offload-optimizer``."""

    optimizer: bool = False

    @classmethod
    def of(cls, offload: "bool | OffloadPolicy", rank: int = 0) -> "OffloadPolicy":
        """``True``/``False`` or an :class:`OffloadPolicy`; a device name is refused, not taken as on."""
        policy = offload if isinstance(offload, OffloadPolicy) else cls(offload)
        if not isinstance(policy.optimizer, bool):
            raise TypeError(f"rank {rank}: offload_optimizer must be True or False (keep this rank's optimizer "
                            f"states in host memory and step there), got {policy.optimizer!r}; host memory is "
                            f"the only place offered (DeepSpeed's offload_optimizer.device='cpu').")
        return policy
