"""Lesson 09, context parallelism (TODOs 1-5): the mistakes a learner makes, each of which its test must catch."""

from tests.mutants import Mutant  # noqa: F401

MUTANTS = []
