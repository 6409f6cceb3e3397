"""The commands of ``python -m minizero``: compare, soak, bench, scale, memory, train, compress-study."""
