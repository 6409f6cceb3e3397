"""Above rank 2, computes P's QR and drops it: P stays as summed, and only rank-3 runs go wrong."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract import powersgd as contract


def _orthonormal(columns: torch.Tensor, epsilon: float) -> None:
    if columns.shape[1] > 2:
        q, _ = torch.linalg.qr(columns)  # the orthonormal Q computed -- and never written back into P
        return
    for i in range(columns.shape[1]):
        col = columns[:, i:i + 1]
        norm = torch.norm(col, dim=0, keepdim=True)
        col /= norm + epsilon if epsilon else norm
        if i + 1 < columns.shape[1]:
            later = columns[:, i + 1:]
            later -= torch.sum(col * later, dim=0, keepdim=True) * col


class PowerSGDWire(contract.PowerSGDWire):
    def power_step(self, carried: torch.Tensor, plan, q: torch.Tensor, tag) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.comm.world_size
        out = torch.empty_like(carried)
        if plan.rest:
            rest = torch.cat([carried[a:a + k] for a, k in plan.rest])
            if rest.numel():
                self.comm.all_reduce(rest, ReduceOp.SUM, tag=tag)
            rest = rest / n
            at = 0
            for a, k in plan.rest:
                out[a:a + k] = rest[at:at + k]
                at += k
        if not plan.matrices:
            return out, q
        mats = [carried[mx.offset:mx.offset + mx.n * mx.m].view(mx.n, mx.m) for mx in plan.matrices]
        p = carried.new_empty(plan.p_size)
        ps = [p[mx.p_offset:mx.p_offset + mx.n * mx.r].view(mx.n, mx.r) for mx in plan.matrices]
        for m, mx, pv in zip(mats, plan.matrices, ps, strict=True):
            pv.copy_(m @ q[mx.q_offset:mx.q_offset + mx.m * mx.r].view(mx.m, mx.r))
        self.comm.all_reduce(p, ReduceOp.SUM, tag=tag)
        for pv in ps:
            _orthonormal(pv, self.settings.epsilon)
        new_q = carried.new_empty(plan.q_size)
        for m, mx, pv in zip(mats, plan.matrices, ps, strict=True):
            new_q[mx.q_offset:mx.q_offset + mx.m * mx.r].view(mx.m, mx.r).copy_(m.T @ pv)
        self.comm.all_reduce(new_q, ReduceOp.SUM, tag=tag)
        new_q /= n
        for mx, pv in zip(plan.matrices, ps, strict=True):
            out[mx.offset:mx.offset + mx.n * mx.m].view(mx.n, mx.m).copy_(
                pv @ new_q[mx.q_offset:mx.q_offset + mx.m * mx.r].view(mx.m, mx.r).T)
        return out, new_q


class BucketedDDP(contract.BucketedDDP):
    wire_class = PowerSGDWire
