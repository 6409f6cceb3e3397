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
from torch.nn.parallel import DistributedDataParallel

from ...compress import PowerSGD, parse
from ...parts.precision import Precision
from ...parts.rebuilt import rebuild
from ...parts.unit_plan import resolve_units


class TorchStage:
    """A torch implementation behind minizero's stage interface (:class:`~minizero.stages.DataParallel`),
    so the one training loop drives it."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.world_size = torch.distributed.get_world_size()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self):
        self.optimizer.step()

    def scale_loss(self, loss):
        return loss  # torch's stages are driven in one precision here

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(self.module.parameters()), max_norm, norm_type)

    def _local(self, tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensors: this rank's shard

    def full_state_dict(self) -> dict:
        inner = self.module.module if isinstance(self.module, DistributedDataParallel) else self.module
        return {k: v.detach().clone() for k, v in inner.state_dict().items()}

    def full_optimizer_state_dict(self) -> dict:
        return {}  # oracles are compared by parameters only

    def held_tensors(self) -> dict:
        params = [self._local(p) for p in self.module.parameters()]
        # ZeroRedundancyOptimizer keeps this rank's states in its local optimizer (``.optim``); its own
        # ``.state`` stays empty, which would count torch's ZeRO-1 as holding no optimizer state at all.
        states = getattr(self.optimizer, "optim", self.optimizer).state
        return {"params": params, "grads": [self._local(p.grad) for p in self.module.parameters() if p.grad is not None],
                "optimizer": [self._local(t) for state in states.values() for t in state.values()
                              if torch.is_tensor(t)]}

    def add_observer(self, observer) -> None:
        """torch's wrappers keep their memory to themselves: nothing to observe."""


class TorchDDP(TorchStage):
    name = "torch-ddp"

    def __init__(self, module, optimizer, comm=None, compress: str | None = None, bucket_mb: float = 25.0,
                 error_feedback: bool = False):
        # torch's comm hooks, ZeroRedundancyOptimizer and FSDP2 are imported where an oracle is built: FSDP2 pulls in
        # DTensor and sympy, about 2 s of every process that imports the harness (a lesson's kernel, a command).
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        super().__init__(DistributedDataParallel(module, bucket_cap_mb=bucket_mb), optimizer)
        if compress == "fp16":
            self.module.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compress == "bf16":
            self.module.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif isinstance(settings := parse(compress), PowerSGD):  # minizero's settings in torch's names
            state = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=settings.rank, start_powerSGD_iter=settings.start,
                min_compression_rate=settings.min_rate, use_error_feedback=error_feedback,
                warm_start=settings.warm_start, orthogonalization_epsilon=settings.epsilon,
                random_seed=settings.seed)
            self.module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif compress not in (None, "none"):
            raise ValueError(f"torch DDP has no comm hook for compress={compress!r} (fp16, bf16, powersgd)")

    def no_sync(self):
        return self.module.no_sync()



class TorchZeRO(TorchDDP):
    """torch DDP with ``ZeroRedundancyOptimizer``: whole parameters assigned to ranks (largest
    first), gradients all-reduced by DDP, updated parameters broadcast by their owners (~3 Psi)."""

    name = "torch-zero"

    def __init__(self, module, optimizer, comm=None, **options):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        super().__init__(module, optimizer, comm, **options)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        groups = [dict(g) for g in optimizer.param_groups]
        self.optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=type(optimizer), **defaults)
        for group in groups[1:]:
            self.optimizer.add_param_group(group)


class TorchFSDP2(TorchStage):
    """torch's FSDP2: ``fully_shard`` on each unit and on the root, over a device mesh of the model's device."""

    name = "torch-fsdp2"

    def __init__(self, module, optimizer, comm=None, units=None, reshard_after_forward: bool = True,
                 precision=None, **_):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        names = {id(p): n for n, p in module.named_parameters()}
        with torch.no_grad():  # FSDP2 shards each rank's own values: start from rank 0's, as every stage does
            for tensor in list(module.parameters()) + list(module.buffers()):
                torch.distributed.broadcast(tensor, 0)
        # The mesh on the model's device: on a "cpu" mesh FSDP2 would move a CUDA model's shards to the CPU.
        device = next(iter(module.parameters()), torch.empty(0)).device.type
        mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
        working = Precision.of(precision).working_dtype  # FSDP2's own mixed precision: fp32 shards, 16-bit compute
        policy = MixedPrecisionPolicy(param_dtype=working, reduce_dtype=working) if working else MixedPrecisionPolicy()
        for unit in resolve_units(module, units):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        # fully_shard replaced the parameters by DTensors: rebuild the optimizer over them, group by group.
        new = dict(module.named_parameters())
        super().__init__(module, rebuild(type(optimizer), optimizer.defaults, optimizer.param_groups,
                                         [[new[names[id(p)]] for p in g["params"]] for g in optimizer.param_groups]))

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict:
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        total = torch.nn.utils.clip_grad_norm_(list(self.module.parameters()), max_norm, norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total


ORACLES = {"torch-ddp": TorchDDP, "torch-zero": TorchZeRO, "torch-fsdp2": TorchFSDP2}
