"""Lesson 09, expert parallelism (TODOs 6-10): the mistakes a learner makes, each of which its test must catch."""

from tests.mutants import Mutant  # noqa: F401

MUTANTS = []
