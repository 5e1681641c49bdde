"""Lesson 05's helpers (pipeline parallelism), kept out of the lesson script.

- plumbing.py: the checks that refuse a layout that cannot run (in one line), the run's metrics and rank 0's report,
  a built-in schedule's own order of actions and its ideal-machine simulation, and cost-aware partitioning.
- timing.py: when each F, B and W ran (from scratch and built-in), the measured bubble, the rendezvous check that
  finds a deadlocking plan, and `--bubble-sweep` with where it was measured.
- lab.py: the debugging lab (TODO 8), its pure-Python grading and its run on live ranks.
- runs.py: the notebook's runs of the lesson script, their output shown without what varies, their models kept.
- figures.py: the notebook's charts and tables (schedules drawn as timelines, the zero-bubble table, the bubble
  sweep, the partitions compared in FLOPs).
"""
