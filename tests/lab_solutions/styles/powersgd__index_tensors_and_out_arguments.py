"""Lab ``powersgd`` in another style: the uncompressed rest gathered and put back with index tensors
(``index_select``/``index_copy_``), each product written with ``out=``, and the Gram-Schmidt written column by column
with a list of the columns done."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract import powersgd as contract


def _orthonormalize(columns: torch.Tensor, epsilon: float) -> None:
    if columns.shape[1] > 2:  # QR above rank 2, as torch's hook
        columns.copy_(torch.linalg.qr(columns)[0])
        return
    done = []
    for i in range(columns.shape[1]):
        col = columns[:, i:i + 1]
        norm = torch.norm(col, dim=0, keepdim=True)
        col.div_(norm + epsilon if epsilon else norm)
        done.append(col)
        for later in range(i + 1, columns.shape[1]):
            rest = columns[:, later:later + 1]
            rest.sub_(torch.sum(col * rest, dim=0, keepdim=True) * col)


class PowerSGDWire(contract.PowerSGDWire):
    def power_step(self, carried: torch.Tensor, plan, q: torch.Tensor, tag) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.comm.world_size
        out = torch.empty_like(carried)
        if plan.rest:
            where = torch.cat([torch.arange(a, a + k) for a, k in plan.rest])
            rest = carried.index_select(0, where)
            if rest.numel():
                self.comm.all_reduce(rest, ReduceOp.SUM, tag=tag)
            out.index_copy_(0, where, rest / n)
        if not plan.matrices:
            return out, q
        p, new_q = carried.new_empty(plan.p_size), carried.new_empty(plan.q_size)

        def matrix(mx):
            return carried[mx.offset:mx.offset + mx.n * mx.m].view(mx.n, mx.m)

        def p_of(mx):
            return p[mx.p_offset:mx.p_offset + mx.n * mx.r].view(mx.n, mx.r)

        def q_of(buffer, mx):
            return buffer[mx.q_offset:mx.q_offset + mx.m * mx.r].view(mx.m, mx.r)

        for mx in plan.matrices:
            torch.matmul(matrix(mx), q_of(q, mx), out=p_of(mx))
        self.comm.all_reduce(p, ReduceOp.SUM, tag=tag)
        for mx in plan.matrices:
            _orthonormalize(p_of(mx), self.settings.epsilon)
        for mx in plan.matrices:
            torch.matmul(matrix(mx).T, p_of(mx), out=q_of(new_q, mx))
        self.comm.all_reduce(new_q, ReduceOp.SUM, tag=tag)
        new_q.div_(n)
        for mx in plan.matrices:
            torch.matmul(p_of(mx), q_of(new_q, mx).T, out=out[mx.offset:mx.offset + mx.n * mx.m].view(mx.n, mx.m))
        return out, new_q


class BucketedDDP(contract.BucketedDDP):
    wire_class = PowerSGDWire
