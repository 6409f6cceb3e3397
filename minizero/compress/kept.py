"""What a wire keeps between steps, per buffer: this rank's error-feedback residuals.

Every wire has them (the 16-bit wire's rounding error, a codec's, PowerSGD's); a checkpoint saves them
(``state_dict``) and a resumed run in the same layout loads them, so resuming stays bit for bit; the memory
accounting counts them (``held``) -- one full-size buffer each, on top of the paper's formulas.
"""
from __future__ import annotations

import torch


class KeepsResiduals:
    residuals: dict  # key -> what this rank has not yet delivered of that buffer
    error_feedback: bool

    def carry(self, key, carried: torch.Tensor, rank: int) -> None:
        """With error feedback, ``carried += e`` -- what buffer ``key`` did not deliver last time.  A residual of
        another size was loaded from a checkpoint of another layout: refused, saying how to resume."""
        residual = self.residuals.get(key)
        if not self.error_feedback or residual is None:
            return
        if residual.shape != carried.shape:
            raise ValueError(f"rank {rank}: the error-feedback residual of buffer {key!r} has {residual.numel()} "
                             f"elements and the buffer {carried.numel()}: the checkpoint was saved with other buffers; "
                             f"resume with the layout it was saved with (--bucket-mb; ZeRO-3's units)")
        carried += residual

    @property
    def keeps_state(self) -> bool:
        """Does a resumed run need what this wire kept (a checkpoint saves it)?  The residuals, with error feedback."""
        return self.error_feedback

    def held(self) -> list[torch.Tensor]:
        return list(self.residuals.values())

    def state_dict(self) -> dict:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict, device) -> None:
        self.residuals.update({key: value.to(device) for key, value in state["residuals"].items()})
