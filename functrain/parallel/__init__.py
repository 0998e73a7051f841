"""Parallelism: the device mesh and sharding rules, multi-process setup, optimizer-state offload."""
