"""What communication costs, by formula: the ring's bytes per rank, the alpha-beta time of a collective on a
cluster, and the scaling model that replays a stage's schedule."""
