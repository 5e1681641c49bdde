"""Lesson 08's helpers (fault tolerance), kept out of the lesson script and the notebook's cells.

- runs.py: the notebook's runs of the lesson script under torchrun, with restarts that work.
- contents.py: what a checkpoint folder holds, read back from its files (DCP's .metadata, meta.json, rank-R.pt).
- figures.py: the notebook's plot of the checkpoint interval trade-off.
"""
