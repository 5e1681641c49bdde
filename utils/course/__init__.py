"""The course's machinery, which a learner never needs to read: launching ranks (warm_ranks, notebook), loading a
lesson's solution (lessons), the debugging labs' runner (lab), generating exercises (make_exercises), re-executing
notebooks (refresh_notebook), where a timing came from (measured), differences between torch releases (compat)
and the private torch APIs the course relies on (internals), fault injection (faults)."""
