"""A stage added the way every stage is: this one file, and one registry entry (in the test, a copy).

``ddp-all-gather`` averages gradients without a reduction collective: every
rank all-gathers every rank's flat gradients and adds them up itself.  Correct,
and a lesson in bytes: each rank sends (N-1) Psi b instead of the ring
all-reduce's 2(N-1)/N Psi b -- the byte check holds it to its own formula.
"""
from __future__ import annotations

from minizero.flat import pack, unpack
from minizero.formulas import all_gather_bytes
from minizero.stages import DDP
from minizero.stages.options import FIND_UNUSED_PARAMETERS


class AllGatherDDP(DDP):
    name = "ddp-all-gather"
    options = (FIND_UNUSED_PARAMETERS,)

    def __init__(self, module, optimizer=None, comm=None, find_unused_parameters: bool = False):
        super().__init__(module, optimizer, comm, find_unused_parameters=find_unused_parameters)

    def sync_gradients(self) -> None:
        grads = [p.grad for p in self._with_gradient()]
        mine = pack(grads)
        everyone = mine.new_empty(self.world_size * mine.numel())
        self.comm.all_gather(everyone, mine, tag=self.tag("every rank's gradients"))
        unpack(everyone.view(self.world_size, -1).sum(dim=0) / self.world_size, grads)

    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return all_gather_bytes(world_size * psi * grad_bytes, world_size)


class WrongFormula(AllGatherDDP):
    """The same stage, claiming the ring all-reduce's bytes: the byte check must say no."""

    name = "ddp-all-gather-claims-ring"

    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return 2 * all_gather_bytes(psi * grad_bytes, world_size)

