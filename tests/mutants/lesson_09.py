"""Lesson 09's mutants: context parallelism's TODOs (1-5) and expert parallelism's (6-10), one list each."""

from tests.mutants.lesson_09_context import MUTANTS as CONTEXT
from tests.mutants.lesson_09_experts import MUTANTS as EXPERTS

MUTANTS = CONTEXT + EXPERTS
