"""Planning a run before renting the hardware: the run built as ``train`` builds it, its train call compiled ahead
of time for a TPU topology, and what XLA says of it (memory, FLOPs, bytes over the data-centre network)."""
