"""Oracles: the same training through torch's own implementations.

The property suite compares every stage with single-device training; these
compare with what PyTorch ships -- ``DistributedDataParallel`` (optionally
with ``fp16_compress_hook``), ``ZeroRedundancyOptimizer`` and FSDP2's
``fully_shard`` -- on the same model, data and optimizer.  Used
by the tests and by ``bench``.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .units import resolve_units



class TorchStage:
    """A torch implementation behind minizero's stage interface, so the one training loop drives it."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.world_size = torch.distributed.get_world_size()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def full_optimizer_state_dict(self) -> dict:
        return {}  # oracles are compared by parameters only


class TorchDDP(TorchStage):
    name = "torch-ddp"

    def __init__(self, module, optimizer, comm=None, compress: str | None = None, bucket_mb: float = 25.0):
        super().__init__(DistributedDataParallel(module, bucket_cap_mb=bucket_mb), optimizer)
        if compress == "fp16":
            self.module.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compress == "bf16":
            self.module.register_comm_hook(None, default_hooks.bf16_compress_hook)

    def no_sync(self):
        return self.module.no_sync()



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


class TorchFSDP2(TorchStage):
    """torch's FSDP2: ``fully_shard`` on each unit and on the root, over a CPU device mesh (gloo)."""

    name = "torch-fsdp2"

    def __init__(self, module, optimizer, comm=None, units=None, reshard_after_forward: bool = True, **_):
        names = {id(p): n for n, p in module.named_parameters()}
        with torch.no_grad():  # FSDP2 shards each rank's own values: start from rank 0's, as every stage does
            for tensor in list(module.parameters()) + list(module.buffers()):
                torch.distributed.broadcast(tensor, 0)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for unit in resolve_units(module, units):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        # fully_shard replaced the parameters by DTensors: rebuild the optimizer over them, group by group.
        new = dict(module.named_parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [new[names[id(p)]] for p in g["params"]]}
                  for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        super().__init__(module, type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items()
                                                            if k in accepted}))

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict:
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}


ORACLES = {"torch-ddp": TorchDDP, "torch-zero": TorchZeRO, "torch-fsdp2": TorchFSDP2}
