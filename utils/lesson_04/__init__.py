"""Lesson 04's helpers (tensor parallelism), kept out of the lesson script.

- checks.py: the checks of the hand-written pieces (f and g, the two layers, a block, SP's pair) against one
  process, which the script runs before training with --tp-impl scratch; the pieces are passed in by name.
- layout.py: how a parameter is stored on this rank (DTensor or hand-written shard), for the script's report.
- lab.py: the debugging lab (TODO 8): runs train_parallel_mlp on live ranks, compares with one process, grades it.
- runs.py: the notebook's training runs, launched once each, their metrics and full models kept by name.
- tables.py: the notebook's tables (parity, collectives against the formula, memory, TP and DDP traffic).
- figures.py: the notebook's pictures (the f/g pair around a split MLP, memory per rank against TP size).
"""
