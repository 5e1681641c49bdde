"""Lesson 03's helpers (ZeRO and FSDP), kept out of the lesson script.

- options.py: the lesson's command line (strategy, precision, replicas, resharding, buckets), validated once.
- metrics.py: what a strategy's first step measures (layout, held and peak bytes, gradients, wire bytes).
- checkpoint.py: full-state and distributed (DCP) checkpoints saved and resumed, every problem in one line.
- lab.py: the debugging lab (TODO 8), a ZeRO-3 unit never gathered again, run on live ranks and graded.
- prefetch.py: FSDP2's prefetching timed in one step (when each all-gather and each block's compute run).
- real_run.py: what a real FSDP2 run adds (meta-device init, clipping, accumulation, DTensors, CPU offload).
- figures.py: the notebook's tables and plots.
"""
