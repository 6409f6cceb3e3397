"""The harness: experiments and their results, the one definition of "equivalent", the same-casts reference,
torch's implementations as oracles, and the tasks, models and optimizers they draw from."""
