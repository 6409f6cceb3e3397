"""Stages added the way every stage is: this one file, and one registry call (in the test, a copy).

``ddp-all-gather`` averages gradients without a reduction collective: every
rank all-gathers every rank's flat gradients and adds them up itself.  Correct,
and a lesson in bytes: each rank sends (N-1) Psi b instead of the ring
all-reduce's 2(N-1)/N Psi b -- the byte check holds it to its own formula.

``ddp-all-gather-split`` is the same stage with an option of its own,
``gathers``: the flat gradients go in that many all-gathers, one consecutive
range each -- smaller messages, the same bytes, the same average.  The option is
declared once, beside the stage (:data:`GATHERS`); its command-line flag
(``--gathers``), its parsing, its help and the values the property suite draws
all come from that declaration, with no line anywhere else.
"""
from __future__ import annotations

from minizero.costs.formulas import all_gather_bytes
from minizero.parts.flat import pack, unpack
from minizero.stages import DDP
from minizero.stages.options import FIND_UNUSED_PARAMETERS, Option, positive_int

#: The new option: every fact of it that a command or the property suite needs.
GATHERS = Option("gathers", 1, "all-gather the flat gradients in this many collectives, a consecutive range each",
                  positive_int, draw=lambda d: range(1, 4))


class AllGatherDDP(DDP):
    name = "ddp-all-gather"
    options = (FIND_UNUSED_PARAMETERS,)
    gathers = 1  # the whole flat buffer in one all-gather

    def __init__(self, module, optimizer=None, comm=None, find_unused_parameters: bool = False):
        super().__init__(module, optimizer, comm, find_unused_parameters=find_unused_parameters)

    def post_backward(self) -> None:
        """Every rank's gradients to every rank, ``gathers`` all-gathers of a range each; each rank averages."""
        grads = [p.grad for p in self._with_gradient()]
        mine = pack(grads)
        for i, span in enumerate(mine.tensor_split(self.gathers)):
            if span.numel():  # more gathers than elements: the same empty ranges on every rank, not sent
                everyone = span.new_empty(self.world_size * span.numel())
                self.comm.all_gather(everyone, span, tag=self.tag(f"every rank's gradients, range {i}"))
                span.copy_(everyone.view(self.world_size, -1).sum(dim=0) / self.world_size)  # a view of mine
        unpack(mine, grads)

    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return all_gather_bytes(world_size * psi * grad_bytes, world_size)  # however many gathers carry it


class SplitAllGatherDDP(AllGatherDDP):
    name = "ddp-all-gather-split"
    options = (GATHERS, FIND_UNUSED_PARAMETERS)

    def __init__(self, module, optimizer=None, comm=None, gathers: int = 1, find_unused_parameters: bool = False):
        super().__init__(module, optimizer, comm, find_unused_parameters)
        self.gathers = gathers


class WrongFormula(AllGatherDDP):
    """The same stage, claiming the ring all-reduce's bytes: the byte check must say no."""

    name = "ddp-all-gather-claims-ring"

    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return 2 * all_gather_bytes(psi * grad_bytes, world_size)
