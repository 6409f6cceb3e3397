"""Oracles: the same training through torch's own implementations.

The property suite compares every stage with single-device training; these
compare with what PyTorch ships -- ``DistributedDataParallel`` (optionally
with ``fp16_compress_hook``) and ``ZeroRedundancyOptimizer`` -- on the same
model, data and optimizer.  Used
by the tests and by ``bench``.
"""
from __future__ import annotations

import inspect

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel



class TorchDDP:
    """torch DDP behind minizero's stage interface, so the one training loop drives it."""

    name = "torch-ddp"

    def __init__(self, module, optimizer, comm=None, compress: str | None = None, bucket_mb: float = 25.0):
        self.module = DistributedDataParallel(module, bucket_cap_mb=bucket_mb)
        if compress == "fp16":
            self.module.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compress == "bf16":
            self.module.register_comm_hook(None, default_hooks.bf16_compress_hook)
        self.optimizer = optimizer
        self.world_size = torch.distributed.get_world_size()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return self.module.no_sync()

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)



class TorchZeRO(TorchDDP):
    """torch DDP with ``ZeroRedundancyOptimizer``: whole parameters assigned to ranks (largest
    first), gradients all-reduced by DDP, updated parameters broadcast by their owners (~3 Psi)."""

    name = "torch-zero"

    def __init__(self, module, optimizer, comm=None, **options):
        super().__init__(module, optimizer, comm, **options)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        groups = [dict(g) for g in optimizer.param_groups]
        self.optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=type(optimizer), **defaults)
        for group in groups[1:]:
            self.optimizer.add_param_group(group)

    def full_optimizer_state_dict(self) -> dict:
        return {}  # compared by parameters only


ORACLES = {"torch-ddp": TorchDDP, "torch-zero": TorchZeRO}
