"""Lesson 09's helpers (long sequences: context parallelism), kept out of the lesson script.

- ring.py: the ring's point-to-point exchange that ring attention calls (Ring), with its counters and timeline.
- threads.py: N ranks as N threads of one process (a mailbox in place of isend/irecv and all-to-all), for the
  notebook's live figures and the tests of the TODOs.
- options.py: the lesson's command line, the checks that refuse what cannot run (in one line), and the attempt
  that shows why the built-in cannot run on a CPU.
- measure.py: what a run measures (the ring's work, bytes, time and timeline, Ulysses' bytes, attention's memory).
- figures.py: the notebook's tables and plots.
"""
