"""Running a stage: the one training loop, the ranks (a persistent local pool, or torchrun's processes)."""
