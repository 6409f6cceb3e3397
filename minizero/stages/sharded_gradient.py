"""A ZeRO-3 parameter's gradient where FSDP2 keeps it: on the model's parameter, sharded.

Between uses a ZeRO-3 parameter is an empty placeholder, and after backward its averaged gradient lives only on the
stage's pieces -- this rank's 1-D ranges of it, which the optimizer steps.  Code written for FSDP2 reads the model's
own parameters instead: ``param.grad`` after backward, then ``param.grad.full_tensor()`` (a collective: every rank
gets the whole gradient) or ``param.grad.to_local()`` (this rank's part).  A test written that way found ``None``
on every parameter -- and a loop that clips or steps ``model.parameters()`` did nothing, silently.

So after each synchronising backward, every sharded parameter with a gradient on some rank reads its ``.grad`` as a
:class:`ShardedGradient`: a tensor of the parameter's shape and dtype that holds no storage of its own (the pieces
hold the values, and are what the memory figures count).  Its two methods are the DTensor ones; any other torch
operation on it is refused, naming the parameter and what to call -- never a silent wrong number.  How it differs
from FSDP2's DTensor, said plainly: a rank's part is a range of the *flattened* parameter (ZeRO's flat shard,
``local_range``), not a block of rows; the gradient shows from the end of a synchronising backward until the next
forward with autograd on or ``zero_grad()`` (ZeRO-3's backward needs the real ``.grad`` meanwhile); and after the
optimizer's own ``zero_grad()`` has emptied the pieces, ``full_tensor()`` says no rank holds one any more.

The class swap (:meth:`~minizero.stages.zero3.ZeRO3.show_gradients`) is FSDP2's move too: it replaces each parameter
with a DTensor parameter.  Here the parameter stays the same object, and its class is a subclass of ``nn.Parameter``
only while the gradient is shown -- so ZeRO-3's forward and backward, which read and free the real ``.grad``, run no
code of this file (and a step's reading load is not raised by it: ``tests/test_targets.py``).
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .zero_state import group_full_gradients, piece_gradient

_REAL_GRAD = torch.Tensor.grad  # the C-level descriptor: the gradient autograd writes


class ShardedGradient(torch.Tensor):
    """``param.grad`` of a ZeRO-3 parameter after backward: its shape and dtype, no storage; ``to_local()`` and
    ``full_tensor()`` read the stage's pieces when called."""

    @staticmethod
    def __new__(cls, stage, group: int, segment, dtype: torch.dtype):
        grad = torch.Tensor._make_wrapper_subclass(cls, segment.shape, dtype=dtype,
                                                   device=stage.groups[group].shard.device)
        grad._stage, grad._group, grad._segment = weakref.ref(stage), group, segment
        grad._replicated = stage.groups[group].replicated  # (a module the stage keeps whole: one piece, all of it)
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # A RuntimeError, not a TypeError: torch turns a TypeError under ``g * 2`` into "unsupported operand".
        named = next(a for a in tree_leaves((args, kwargs or {})) if isinstance(a, ShardedGradient))
        kept = "kept whole on every rank, on the stage's pieces" if named._replicated else \
            "sharded across the ranks (ZeRO-3 keeps 1/N of it on each)"
        raise RuntimeError(
            f"{named._segment.name}'s .grad is {kept} and holds no values itself, so {func} cannot run on it: call "
            f".full_tensor() for the whole gradient (a collective: every rank calls it), or .to_local() for this "
            f"rank's part; clip with stage.clip_grad_norm_(), and step the optimizer built over stage.parameters()")

    def __repr__(self) -> str:
        lo, hi = self.local_range
        return (f"ShardedGradient({self._segment.name}, shape {tuple(self.shape)}, {self.dtype}, this rank's part: "
                f"elements [{lo}, {hi}) of the flattened parameter)")

    def _pieces(self):
        return [p for p in self._owner().groups[self._group].pieces if p.segment is self._segment]

    def _owner(self):
        stage = self._stage()
        if stage is None:
            raise RuntimeError(f"{self._segment.name}'s sharded gradient outlived its stage")
        return stage

    @property
    def local_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the flattened parameter this rank holds (empty where it holds none of it)."""
        pieces = self._pieces()
        return (pieces[0].start, pieces[-1].stop) if pieces else (0, 0)

    def to_local(self) -> torch.Tensor:
        """This rank's part of the averaged gradient, 1-D (``local_range``'s elements): the piece's own
        ``.grad``, not a copy -- or zeros where the optimizer's ``zero_grad()`` emptied it; empty where this rank
        owns none of the parameter."""
        stage, pieces = self._owner(), self._pieces()
        if not pieces:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        grad = piece_gradient(stage, pieces[0])
        return grad if grad is not None else torch.zeros(pieces[0].stop - pieces[0].start, dtype=self.dtype,
                                                          device=self.device)

    def full_tensor(self) -> torch.Tensor:
        """The whole averaged gradient, the parameter's shape, on every rank: an all-gather of the parameter's flat
        group (every rank must call it, in the same order -- as FSDP2's ``full_tensor()``)."""
        stage = self._owner()
        full = group_full_gradients(stage, self._group)[self._segment.name]
        if full is None:
            raise RuntimeError(f"rank {stage.rank}: no rank holds a gradient for {self._segment.name}: the optimizer's "
                               f"zero_grad() emptied the pieces after backward (read .grad before it), or fp16 found "
                               f"an overflow and this step is skipped (every master's .grad set to None)")
        return full


class ShardedParameter(nn.Parameter):
    """A ZeRO-3 parameter between the end of a synchronising backward and the next forward with autograd on (or
    ``zero_grad()``): :meth:`~minizero.stages.zero3.ZeRO3.show_gradients` swaps its class, and back -- so a step's
    forward and backward, where ZeRO-3 reads and frees the real ``.grad``, run no code of this file.  ``.grad`` is the
    real gradient whenever autograd left one (a backward run again without a forward), else the sharded one; setting
    it ends the showing, and drops this rank's pieces only when it clears the sharded one."""

    @property
    def grad(self):
        real = _REAL_GRAD.__get__(self)
        if real is not None:
            return real
        stage, group, segment = self.zero3_shown
        return ShardedGradient(stage(), group, segment, _dtype(stage(), group))

    @grad.setter
    def grad(self, value):
        if value is None and _REAL_GRAD.__get__(self) is None:  # FSDP2's param.grad = None: this rank's part is
            stage, group, segment = self.zero3_shown            # not stepped (clearing a real one drops nothing)
            for piece in ShardedGradient(stage(), group, segment, _dtype(stage(), group))._pieces():
                (stage().master.master_of(piece.param) if stage().masters_outside else piece.param).grad = None
        self.__class__ = nn.Parameter  # set by hand: shown no longer
        _REAL_GRAD.__set__(self, value)


def _dtype(stage, group: int) -> torch.dtype:
    """The gradient's dtype: what the optimizer steps (the fp32 masters' under mixed precision, optimizer outside)."""
    return stage.groups[group].optimizer_dtype if stage.masters_outside else stage.groups[group].dtype
