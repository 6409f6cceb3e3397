"""What one rank -- or the reference -- measured over an experiment."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankResult:
    """What one rank (or the reference) measured over an experiment."""

    params: list[dict]  # every parameter's full value after each step
    losses: list[float]  # this rank's summed loss per step (add over ranks for the global loss)
    global_count: int = 0
    step_s: list[float] = field(default_factory=list)
    sent_bytes: int = 0  # training traffic the ledger counted, fingerprints excluded
    sent_by_kind: dict = field(default_factory=dict)
    sent_by_link: dict = field(default_factory=dict)  # on a cluster of nodes: "intra" / "inter" -> bytes
    sent_per_step: list[int] = field(default_factory=list)  # training traffic of each step (a cost failure names its step)
    check_bytes: int = 0  # the fingerprints' own traffic
    psi: int = 0  # trainable parameters
    grad_bytes: int = 0  # bytes per gradient element on the wire
    param_bytes: int = 0  # bytes per parameter element
    held_bytes: dict = field(default_factory=dict)  # model state held at the end, by kind
    gathered_peak_bytes: int = 0  # ZeRO-3: the largest gathered working set
    gathered_after_bytes: int = 0  # ... and what the memory observer counts gathered after the last step
    parameter_storage_bytes: int = 0  # the storages the model's parameters point into then, as allocated (each once)
    optimizer_state: dict | None = None  # consolidated, at the end
    optimizer_states: list = field(default_factory=list)  # consolidated, after each step (record_states)
    loss_scales: list[float] = field(default_factory=list)  # the loss scale after each step (fp16)
    skipped_steps: int = 0  # steps skipped for overflow (fp16 dynamic loss scaling)
    cuda_peak_bytes: int = 0  # torch.cuda.max_memory_allocated() over the run (device="cuda")
    cuda_steps: list = field(default_factory=list)  # (allocated as it began, the most during it) per step (CUDA)
    host_steps: list = field(default_factory=list)  # the same of malloc's bytes, sampled (CPU, host_step_peaks)
    host_copied: dict = field(default_factory=dict)  # optimizer offload: bytes copied "to_host", "to_device"
    wire_sent_bytes_per_step: float | None = None  # a codec's wire: its formula on this rank's own buffers
    wire_sent_by_kind_per_step: dict | None = None  # ... by the collective the wire sends with
    weight_sent_bytes_per_step: float | None = None  # ZeRO-3's quantized weights: the gathers' formula
