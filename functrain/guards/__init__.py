"""A run's guards: one job per run directory (the lock), stop signals turned into a save at the next call boundary,
and the supervisor that restarts a run that died."""
