"""Lab ``powersgd`` filled in from the guided skeleton's docstrings, step by step (``tests/test_labs.py`` checks it
passes)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.compress.powersgd_layout import back_project, matrix, orthogonalize, p_of, project, q_of, rest_of
from minizero.course.labs.skeletons.guided import powersgd as skeleton


class PowerSGDWire(skeleton.PowerSGDWire):
    def power_step(self, carried: torch.Tensor, plan, q: torch.Tensor, tag) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.comm.world_size
        out = torch.empty_like(carried)
        rest = rest_of(carried, plan)
        if rest.numel():
            self.comm.all_reduce(rest, ReduceOp.SUM, tag=tag)
        rest /= n
        at = 0
        for offset, numel in plan.rest:
            out[offset:offset + numel] = rest[at:at + numel]
            at += numel
        if not plan.matrices:
            return out, q
        p = project(carried, plan, q)
        self.comm.all_reduce(p, ReduceOp.SUM, tag=tag)
        for mx in plan.matrices:
            orthogonalize(p_of(p, mx), self.settings.epsilon, f"P of {mx.name}")
        new_q = back_project(carried, plan, p)
        self.comm.all_reduce(new_q, ReduceOp.SUM, tag=tag)
        new_q /= n
        for mx in plan.matrices:
            matrix(out, mx).copy_(p_of(p, mx) @ q_of(new_q, mx).T)
        return out, new_q


class BucketedDDP(skeleton.BucketedDDP):
    wire_class = PowerSGDWire
