"""The parts every stage is built from, written once: flat buffers and the sharded layout, buckets, ZeRO-3's units,
the sharded optimizer, mixed precision, offload, activation checkpointing.  A stage calls them by name."""
