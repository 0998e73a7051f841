"""What the loop and the rest of a run say to each other: the events (:class:`~functrain.callbacks.base.Callback`)
and the requests they return (``Control``), the read-only view of where the run stands, and how a run ends
(``StopKind``, ``FitResult``)."""
