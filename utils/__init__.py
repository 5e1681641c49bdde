"""The course's code beside the lesson scripts, in three rooms, one rule: where a module lives says who it is for.

What several lessons share, and a learner reads (the top of utils/):
- distributed_utils.py: start, talk and stop as one distributed job (setup, print0, save0, run_main, teardown).
- model.py: the course's one model, a small decoder-only Transformer, and its FLOPs and parameter counts.
- data.py: the tokens it trains on (a generated corpus, or WikiText-2 through `datasets` on the cluster).
- training.py: the plumbing every training script shares: command line, optimizer, endless batches, logging.
- metrics.py: the metrics file each run writes (losses, checksum, bytes per rank) and the peak of saved activations.
- gather.py: whole parameters back from any layout (DTensor, hand-written shards, pipeline stages), and a checksum.
- collective_counter.py: the collectives a piece of code runs and the bytes they move.
- memory.py: model-state memory per rank under ZeRO 0-3, and the bytes autograd saves for backward.
- planner/: the layout planner for real scale (which dp, tp, pp, cp, ep fits and runs fastest), by concern.
- published_runs.py: published training runs beside the planner's prediction, with the error.
- measure_at_scale.py: the planner's memory against what PyTorch allocates for a 70B-like model, under a fake group.
- monitor.py: --watch, how busy each device and process is while a job runs, and the job report read from it.
- stacks.py: every rank's Python stack of a hung job (py-spy), and which ranks wait somewhere else.
- report.py: the scaling report (tokens/s, speed-up, efficiency) from a folder of metrics files.

What one lesson uses, in utils/lesson_NN/ (each package's __init__ lists its modules): its options and checks,
its labs, its counters and timelines, and the notebook's tables and figures. A lesson's package never imports another
lesson's; a lesson that builds on an earlier one uses that lesson's solution (utils.course.lessons.lesson("04")).

The course's machinery, which a learner never needs to read, in utils/course/: launching ranks (warm_ranks,
notebook), generating exercises (make_exercises), hints (hints), grading a class (grade), the labs' plumbing (lab),
the one loader of solutions/ (lessons), re-executing notebooks (refresh_notebook), where a timing came from
(measured), differences between PyTorch releases (compat), internal PyTorch APIs relied on (internals), and fault
injection (faults).
"""
