"""When does compression pay?  Its wire's time on the alpha-beta ring, its compute, and the break-even bandwidth.

Averaging Psi fp32 gradients on a ring costs ``2(N-1) alpha + 2(N-1)/N * 4 Psi / beta``.  A compressor changes
both terms and adds its own compute C (encode, decode -- N messages for a gathered codec -- or PowerSGD's
matrix products and orthogonalizations):

* the 16-bit wire: the same ring, half the bytes;
* a gathered codec (int8, int4, top-k, sign): an all-gather of each rank's message m,
  ``(N-1) alpha + (N-1) m / beta`` -- its bytes grow with N where the ring's do not, so beyond some N it sends
  *more* than fp32 (int8 from N = 8 on: (N-1) 1.016 Psi bytes against the ring's 8(N-1)/N Psi), the reason ZeRO++ reduce-scatters
  its int8 gradients through an all-to-all instead;
* PowerSGD: three ring all-reduces (the uncompressed tensors, P, Q) of (n + m) r per matrix -- its bytes do
  not grow with N, and its latency is three rings' where DDP pays one.

Writing each as ``T = A + B / beta`` (A: the latency and compute, B: the bytes on the critical path), a wire
that sends fewer bytes but costs more latency or compute is faster exactly when ``beta < (B_fp32 - B_c) /
(A_c + C - A_fp32)``: the **break-even bandwidth**.  One that sends fewer bytes *and* costs no more pays on any
network; one that sends more bytes but less latency (an all-gather at large N) pays only on networks faster
than its break-even; one that costs more of both, on none.  The model is of the gradient averaging alone, not overlapped with
backward (``ddp``); overlap hides part of the uncompressed time and moves the break-even lower.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...comm.network import Network
from ...compress import Codec, PowerSGD, parse
from ...compress.powersgd import PowerState, power_step
from ...compress.powersgd_layout import lay_out

SAMPLE = 1 << 20  # compute is timed on at most this many elements and scaled linearly to Psi


def gpt_shapes(params: float, layers: int = 12) -> list[tuple[str, torch.Size]]:
    """A GPT's tensors for ``params`` parameters in ``layers`` blocks (12 d^2 per block): attention's 3d x d and
    d x d, the MLP's 4d x d and d x 4d, and the two layer norms' weights and biases -- vectors, which PowerSGD
    sends as they are.  (Embeddings are left out: a sketch of where the bytes are.)"""
    d = max(1, round((params / (12 * layers)) ** 0.5))
    block = [("ln1.weight", (d,)), ("ln1.bias", (d,)), ("qkv", (3 * d, d)), ("proj", (d, d)),
             ("ln2.weight", (d,)), ("ln2.bias", (d,)), ("fc", (4 * d, d)), ("out", (d, 4 * d))]
    return [(f"{i}.{name}", torch.Size(shape)) for i in range(layers) for name, shape in block]


def numel(shapes) -> int:
    return sum(int(torch.Size(s).numel()) for _, s in shapes)


def wire_terms(spec: str, shapes, world_size: int, network: Network,
               averages_with: str = "all_reduce") -> tuple[float, float, float]:
    """(A seconds: latency; B bytes on the critical path; bytes each rank sends) of one step's averaging --
    an all-reduce (``ddp``), or a reduce-scatter (ZeRO: a codec's shards then go through an all-to-all, qgZ)."""
    n, alpha, psi = world_size, network.alpha, numel(shapes)
    if n == 1:
        return 0.0, 0.0, 0.0
    wire, scatter = parse(spec), averages_with == "reduce_scatter"
    if scatter and isinstance(wire, PowerSGD):
        raise ValueError(f"{spec}: PowerSGD rides on an all-reduce; a reduce-scatter has no low-rank factors")
    phases = 1 if scatter else 2  # a ring reduce-scatter is half an all-reduce
    ring = lambda nbytes, k=1: (phases * (n - 1) * alpha * k, phases * (n - 1) / n * nbytes)  # noqa: E731
    if wire is None or isinstance(wire, torch.dtype):
        element = 4 if wire is None else torch.empty(0, dtype=wire).element_size()
        a, b = ring(psi * element)
        return a, b, b
    if isinstance(wire, Codec):  # N-1 messages: whole ones (all-gather), or of one shard each (all-to-all)
        message = wire.message_bytes(-(-psi // n) if scatter else psi, torch.float32)
        return (n - 1) * alpha, (n - 1) * message, (n - 1) * message
    layout = lay_out(shapes, wire)
    sizes = [k for k in (sum(k for _, k in layout.rest), layout.p_size, layout.q_size) if k]
    return 2 * (n - 1) * alpha * len(sizes), 2 * (n - 1) / n * 4 * sum(sizes), layout.sent_bytes(n, 4)


@dataclass(frozen=True)
class Compute:
    """A compressor's compute per step on this machine, as two timed terms: what a rank does once (encode its
    message, cast there and back, PowerSGD's products and orthogonalizations) and what it does per message it
    decodes.  Timed once per codec, then read at every world size (:meth:`at`): the timing does not depend on N."""

    once_s: float
    per_decode_s: float = 0.0

    def at(self, world_size: int, averages_with: str = "all_reduce") -> float:
        """Seconds per step at ``world_size``: a gathered codec decodes N messages through the all-gather, and
        N shards -- one whole message's worth -- through the all-to-all."""
        return self.once_s + (1 if averages_with == "reduce_scatter" else world_size) * self.per_decode_s


def codec_compute(spec: str, shapes, repeats: int = 3) -> Compute:
    """The compressor's own compute on this machine, timed (best of ``repeats``) on at most :data:`SAMPLE`
    elements and scaled to the model's: encode one message, decode one into the buffer the mean is summed in
    (:meth:`Compute.at` counts N of them), cast there and back (16 bits), or PowerSGD's products and
    orthogonalizations.  On a GPU these are far cheaper than on a CPU; the wire-alone break-even leaves them out."""
    wire, psi = parse(spec), numel(shapes)
    if wire is None:
        return Compute(0.0)
    if isinstance(wire, PowerSGD):  # a slice of the model holding every shape it has (a block), scaled up
        kinds, sample, seen = {tuple(shape) for _, shape in shapes}, [], set()
        for name, shape in shapes:
            if numel(sample) >= SAMPLE and seen >= kinds:
                break
            sample.append((name, shape))
            seen.add(tuple(shape))
        scale, x = psi / numel(sample), torch.randn(numel(sample))
        state = PowerState(wire)

        def step():  # the warm start's orthogonalization of last step's Q, then the step itself (N only divides)
            layout = lay_out(sample, wire)
            q = state.starting_q(0, layout, x.dtype, x.device, "timing")
            state.keep(0, power_step([x], layout, q, lambda ts: ts[0], 2, wire.epsilon, "timing")[1])
        step()
        return Compute(_best(step, repeats) * scale)
    x = torch.randn(min(psi, SAMPLE))
    scale = psi / x.numel()
    if isinstance(wire, torch.dtype):
        return Compute(_best(lambda: x.to(wire).to(torch.float32), repeats) * scale)
    message, total = wire.encode(x, torch.Generator().manual_seed(0) if wire.stochastic else None), x.clone()
    encode = _best(lambda: wire.encode(x, torch.Generator().manual_seed(0) if wire.stochastic else None), repeats)
    decode = _best(lambda: wire.add_decoded(message, total), repeats)  # into the buffer the wire sums in
    return Compute(encode * scale, decode * scale)


def compute_s(spec: str, shapes, world_size: int, repeats: int = 3, averages_with: str = "all_reduce") -> float:
    """:func:`codec_compute` at one world size: seconds per step."""
    return codec_compute(spec, shapes, repeats).at(world_size, averages_with)


def _best(work, repeats: int) -> float:
    """The fastest of ``repeats`` timings, after one untimed call (first-touch allocations, lazy kernels)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def break_even(fp32: tuple[float, float], compressed: tuple[float, float], compute: float) -> tuple[str, float]:
    """Where the compressed averaging is faster, from ``fp32``'s and ``compressed``'s (A seconds, B bytes)
    (:func:`wire_terms`) and the compressor's compute: ``("below", beta)`` -- on networks slower than beta
    bytes/s (it saves bytes, costs latency or compute); ``("above", beta)`` -- faster than beta (it saves
    latency, sends more bytes: a gathered codec at large N); ``("any", inf)`` or ``("never", 0)``."""
    saved_bytes, extra_s = fp32[1] - compressed[1], compressed[0] + compute - fp32[0]
    if saved_bytes > 0:
        return ("below", saved_bytes / extra_s) if extra_s > 0 else ("any", float("inf"))
    if extra_s < 0:
        return ("above", -saved_bytes / -extra_s) if saved_bytes < 0 else ("any", float("inf"))
    return "never", 0.0


def table(specs: list[str], params: float, sizes: list[int], network: Network, layers: int = 12) -> list[dict]:
    """Per compressor, averaging collective and world size: bytes sent, the averaging's time on ``network``
    with and without it, the compressor's compute, and the break-even bandwidth.  A codec is costed on both
    collectives it rides on (``ddp``'s all-reduce: an all-gather; ZeRO's reduce-scatter: an all-to-all)."""
    shapes = gpt_shapes(params, layers)
    rows = []
    for spec in specs:
        timed = codec_compute(spec, shapes)  # once: the same at every N
        for via in ("all_reduce",) if isinstance(parse(spec), PowerSGD) else ("all_reduce", "reduce_scatter"):
            for n in sizes:
                base = wire_terms("none", shapes, n, network, via)
                wire = wire_terms(spec, shapes, n, network, via)
                compute = timed.at(n, via) if n > 1 else 0.0
                time_of = lambda t, c=0.0: t[0] + c + t[1] / network.bandwidth  # noqa: E731
                rows.append({"compress": spec, "averages_with": via, "world_size": n, "sent_bytes": wire[2],
                             "fp32_sent_bytes": base[2], "comm_ms": time_of(wire) * 1e3,
                             "fp32_comm_ms": time_of(base) * 1e3, "compute_ms": compute * 1e3,
                             "total_ms": time_of(wire, compute) * 1e3, "pays": break_even(base[:2], wire[:2], compute),
                             "pays_wire_alone": break_even(base[:2], wire[:2], 0.0)})
    return rows


def _rate(bps: float) -> str:
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= size:
            return f"{bps / size:.3g} {unit}"
    return f"{bps:.3g} B/s"


def pays_on(pays: tuple[str, float]) -> str:
    where, bps = pays
    return {"below": f"< {_rate(bps)}", "above": f"> {_rate(bps)}"}.get(where, where)


def format_table(rows: list[dict], params: float, network: Network) -> str:
    lines = [f"when compression pays: averaging Psi={params:.3g} gradients (a GPT's matrices), not overlapped, on "
             f"{network.describe()}; the compressor's compute timed on this machine's CPU",
             f"{'compress':<20}{'averaging':>15}{'N':>6}{'sent B/rank':>19}{'x fewer':>9}{'comm ms':>11}{'compute ms':>12}"
             f"{'fp32 ms':>10}{'pays on (wire)':>16}{'(+ compute)':>14}"]
    for r in rows:
        fewer = r["fp32_sent_bytes"] / r["sent_bytes"] if r["sent_bytes"] else float("nan")
        on = r["averages_with"].replace("_", "-")
        lines.append(f"{r['compress']:<20}{on:>15}{r['world_size']:>6}{r['sent_bytes']:>19,.0f}{fewer:>8.2f}x"
                     f"{r['comm_ms']:>11.2f}{r['compute_ms']:>12.1f}{r['fp32_comm_ms']:>10.2f}"
                     f"{pays_on(r['pays_wire_alone']):>16}{pays_on(r['pays']):>14}")
    lines.append("pays on: the networks (bandwidth per rank) where the compressed averaging is faster -- '< X' slower "
                 "than X, '> X' faster than X (less latency, more bytes), 'any' or 'never'; (wire): its bytes and "
                 "latency alone, as on a GPU where the compute is small; (+ compute): with this CPU's compute; averaging: "
                 "an all-reduce (DDP; a codec all-gathers), or a reduce-scatter (ZeRO; a codec's shards go all-to-all)")
    return "\n".join(lines)


__all__ = ["break_even", "compute_s", "format_table", "gpt_shapes", "pays_on", "table", "wire_terms"]
