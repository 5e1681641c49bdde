"""Lesson 01's helpers (collectives), kept out of the lesson script and the notebook's cells.

- collectives.py: what each collective must leave on every rank, from what the ranks held before (the notebook's
  checks of the cells typed on live ranks).
- figures.py: the picture of a collective, every rank's tensor before and after, with arrows for what moved.
- reference.py: the stored ring-versus-library timings (notebooks/data/01_ring_vs_library.json) as a table, and the
  figures behind the notebook's statements about them.
"""
