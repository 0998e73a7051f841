"""A run: the typed config, the builder that turns it into a Run, the loop that drives it, and what the loop
calls around the step (callbacks, resume policy, checkpoints, trackers, the run lock, the summary)."""
