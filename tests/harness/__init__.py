"""The test harness: launching ranks, the pytest plugin, the per-TODO report, GPU and floor checks, Slurm."""
