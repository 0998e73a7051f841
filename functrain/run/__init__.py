"""A run: the builder that turns a config and the caller's objects into a Run (its parts, its backend), and the
loop that drives it (reading finished calls, evaluating, saving, resuming)."""
