"""The one interface every data-parallel wrapper offers the training loop -- minizero's stages and
the torch oracles (:mod:`minizero.lab.oracle`) alike, so nothing has to probe what a stage can do."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class DataParallel(Protocol):
    world_size: int

    def __call__(self, *args, **kwargs): ...

    def no_sync(self) -> AbstractContextManager: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def full_optimizer_state_dict(self) -> dict: ...

    def held_tensors(self) -> dict[str, list[torch.Tensor]]: ...

    def add_observer(self, observer: Callable[..., None]) -> None: ...
