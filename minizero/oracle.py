"""Oracles: the same training through torch's own implementations.

The property suite compares every stage with single-device training; these
compare with what PyTorch ships -- ``DistributedDataParallel`` (optionally
with ``fp16_compress_hook``) -- on the same model, data and optimizer.  Used
by the tests and by ``bench``.
"""
from __future__ import annotations

import torch
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



ORACLES = {"torch-ddp": TorchDDP}
