"""PowerSGD's view of a flat gradient buffer: which of its tensors are compressed as matrices, and where each one's P
and Q lie in the two flat buffers that are all-reduced (:mod:`.powersgd`); and the products on it -- P = M Q, Q = M^T P,
the columns made orthonormal, the uncompressed rest -- which the PowerSGD step (:func:`.powersgd.power_step`) composes.

A tensor is a matrix of its first dimension by the rest (as torch's hook flattens it); it is compressed only if
``(n + m) r * min_rate < n m``.  Matrices are grouped by shape, in first-seen order, as torch's hook orders them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..costs.formulas import all_reduce_bytes


@dataclass(frozen=True)
class Matrix:
    """One compressed tensor of a buffer: where it lies, its matrix shape, and where its P and Q lie."""
    name: str
    offset: int
    n: int
    m: int
    r: int
    p_offset: int
    q_offset: int


@dataclass
class Layout:
    """A buffer cut into its tensors: the compressed matrices (grouped by shape, in first-seen order, as torch's
    hook orders them -- so its random Q and ours are the same numbers) and the rest, sent as it is."""
    matrices: list[Matrix] = field(default_factory=list)
    rest: list[tuple[int, int]] = field(default_factory=list)  # (offset, numel) of each uncompressed tensor
    p_size: int = 0
    q_size: int = 0

    def sent_bytes(self, world_size: int, element: int) -> float:
        """The formula: three all-reduces per step -- the rest, P (n r per matrix), Q (m r per matrix) --
        each 2(N-1)/N of its bytes per rank; so (n + m) r per matrix where plain DDP sends n m."""
        rest = sum(numel for _, numel in self.rest)
        return sum(all_reduce_bytes(k * element, world_size) for k in (rest, self.p_size, self.q_size))


def lay_out(tensors: list[tuple[str, torch.Size]], settings) -> Layout:
    """Which tensors of a flat buffer (``name, shape`` in buffer order) are compressed, and where P and Q go."""
    layout, by_shape, offset = Layout(), {}, 0
    for name, shape in tensors:
        numel = int(np.prod(shape)) if len(shape) else 1
        n, m = (shape[0], numel // shape[0]) if len(shape) and numel else (numel, 1)
        r = min(n, m, settings.rank)
        if len(shape) and numel and (n + m) * r * settings.min_rate < n * m:
            by_shape.setdefault((n, m), []).append((name, offset, n, m, r))
        else:
            layout.rest.append((offset, numel))
        offset += numel
    for group in by_shape.values():
        for name, at, n, m, r in group:
            layout.matrices.append(Matrix(name, at, n, m, r, layout.p_size, layout.q_size))
            layout.p_size += n * r
            layout.q_size += m * r
    return layout


def matrix(flat: torch.Tensor, mx: Matrix) -> torch.Tensor:
    return flat[mx.offset:mx.offset + mx.n * mx.m].view(mx.n, mx.m)


def p_of(p: torch.Tensor, mx: Matrix) -> torch.Tensor:
    return p[mx.p_offset:mx.p_offset + mx.n * mx.r].view(mx.n, mx.r)


def q_of(q: torch.Tensor, mx: Matrix) -> torch.Tensor:
    return q[mx.q_offset:mx.q_offset + mx.m * mx.r].view(mx.m, mx.r)


def orthogonalize(columns: torch.Tensor, epsilon: float, what: str) -> None:
    """Make the r columns orthonormal, in place: Gram-Schmidt for r <= 2 or 16-bit columns, QR otherwise (torch's
    choice: QR is faster for larger r, and has no 16-bit kernel).  A zero column -- a matrix whose gradient is zero
    on every rank (unused, ReLU-dead), or whose mean gradient has rank below r (an embedding one token touched) --
    has no direction: refused with epsilon = 0, as dividing by its norm would write NaN."""
    if columns.shape[1] > 2 and columns.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(columns, out=(columns, columns.new_empty(columns.shape[1], columns.shape[1])))
        return
    for i in range(columns.shape[1]):
        col = columns[:, i:i + 1]
        norm = torch.norm(col, dim=0, keepdim=True)
        if epsilon == 0 and not bool(norm.all()):
            raise FloatingPointError(f"{what}: a column of PowerSGD's P or Q is all zeros (the gradient is zero on "
                                     f"every rank, or its mean has rank below r), so it cannot be normalized; set "
                                     f"powersgd:epsilon=1e-8, or a smaller rank")
        col /= norm + epsilon if epsilon else norm
        if i + 1 < columns.shape[1]:
            rest = columns[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


def project(flat: torch.Tensor, layout: Layout, q: torch.Tensor) -> torch.Tensor:
    """P = M Q for every matrix (step 3, before the all-reduce)."""
    p = flat.new_empty(layout.p_size)
    for mx in layout.matrices:
        torch.bmm(matrix(flat, mx)[None], q_of(q, mx)[None], out=p_of(p, mx)[None])  # bmm, as torch's hook: mm rounds otherwise
    return p


def back_project(flat: torch.Tensor, layout: Layout, p: torch.Tensor) -> torch.Tensor:
    """Q = M^T P for every matrix (step 5, before the all-reduce), P orthonormal."""
    q = flat.new_empty(layout.q_size)
    for mx in layout.matrices:
        torch.bmm(matrix(flat, mx).t()[None], p_of(p, mx)[None], out=q_of(q, mx)[None])
    return q


def rest_of(flat: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The uncompressed tensors, packed: they travel in one all-reduce."""
    return torch.cat([flat[a:a + k] for a, k in layout.rest]) if layout.rest else flat.new_empty(0)
