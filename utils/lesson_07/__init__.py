"""Lesson 07's helpers (communication-efficient training), kept out of the lesson script and the notebook's cells.

- buckets.py: a stand-in for DDP's GradBucket, to call a communication hook on a tensor of one's choosing.
- runs.py: the notebook's runs, every method at 2 ranks and a few at 4.
- formulas.py: the bytes one rank sends per step for each method, from the formulas of the notebook's section 1.
- alpha_beta.py: communication time from rounds and bytes (the alpha-beta model), its tables, and the traffic of a
  large model under each method.
"""
