"""Lesson 06's helpers (3D parallelism), kept out of the lesson script.

- placements.py: how each parameter of a stage is stored on a rank, and the last stage's logits made its own.
- measure.py: what one step did (the bytes saved for backward, the collectives each rank ran).
- reference.py: one process's gradient norms, written with PyTorch alone, that the grid's are compared with.
- timeline.py: the timeline of one from-scratch step (COURSE_TIMELINE), read back and drawn.
- figures.py: the notebook's pictures and tables, and the bookkeeping behind its checks.
- runs.py: the notebook's launches of the lesson scripts, rank 0's output without its timings.
"""
