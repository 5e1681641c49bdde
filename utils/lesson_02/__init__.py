"""Lesson 02's helpers (data parallelism), kept out of the lesson script.

- samplers.py: four ways to give each rank its share of the data (dataset, iterable and batch-sampler sharding,
  dispatching from rank 0), every sample once per epoch.
- host_memory.py: the host memory a process holds for its data (RSS, and PSS: its share of shared pages).
- benchmarks.py: what each sharding costs in memory and time, memory copied vs mapped, and the lesson's throughput
  (run as a script under torchrun or python).
- ddp_options.py: DistributedDataParallel's options and Join, each tried on a tiny model (a script for torchrun).
- figures.py: the notebook's tables and plots.
"""
