"""Lesson 11's helpers (where a distributed step's time goes), kept out of the lesson script.

- options.py: the lesson's command line (strategy, overlap, prefetch, the speed-ups, --profile) and the checks that
  refuse what cannot run, in one line.
- profiling.py: torch.profiler around a few steps, one Chrome/Perfetto trace per rank; the trace read back as
  events; the peak memory a step allocates on each rank.
- activations.py: what each operation of a block saves for backward and costs to recompute (the checkpointing
  policy's table), and the checkpointing wrappers.
- exposure.py: the strategies side by side at 2 and 4 ranks, each profiled, beside the formulas of lessons 02-05
  (python -m utils.lesson_11.exposure writes notebooks/data/11_exposure.json).
- speedups.py: the speed-ups one at a time, measured side by side in one run (python -m utils.lesson_11.speedups
  writes notebooks/data/11_speedups.json), and the published figures beside them.
- figures.py: the notebook's per-rank timeline and tables.
"""
