"""Lesson 10's helpers (mixture of experts, expert parallelism), kept out of the lesson script.

- reference.py: the seeded weights (a rank builds only its own experts) and the same MoE model on one process,
  written as plain loops: what every parallel run is checked against (and the slots' check, the matmul loop).
- options.py: the lesson's command line and the checks that refuse what cannot run, in one line; a run's options
  from its command line (what the one-process reference trains with).
- record.py: what a run records (losses, the load-balancing loss per layer, each expert's choices and kept rows,
  the all-to-all's rows and bytes, each rank's time in its experts and in the combine) and the full weights.
- figures.py: the notebook's tables and plots.
- runs.py: the notebook's runs of the lesson script (launched in one line each) and the refusal of what cannot run.
- bias_balancing.py: DeepSeek-V3's sigmoid router with auxiliary-loss-free bias balancing, trained on one process
  (the notebook's section 5).
"""
