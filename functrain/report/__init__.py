"""What a run reports: metrics.jsonl and TensorBoard, experiment trackers, the progress bar and console lines,
events.jsonl and the goodput read from it, samples and lm-eval scores at evaluations, throughput and MFU, the
closing summary and the plots."""
