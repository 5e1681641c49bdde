"""Plausible learner mistakes, one list per lesson (`lesson_NN.py`), that each TODO's tests must catch.

A mutant is a wrong version of one TODO's solution: `find` is a piece of the solution's code inside that TODO's
`# BEGIN SOLUTION` region (it must occur exactly once in the whole solution), `replace` the mistake a learner
makes there. `make mutants` (python -m tests.mutants) gives each mutated solution to the lesson's tests as a
learner's completed exercise: the mutant is killed when `make check` shows its TODO as failing and blames no
other TODO, and its line shows the words the entry names (`shows`: what differed, or the likely cause). Run it
before a workshop and for every new or changed TODO; tests/test_mutants.py checks, in `make test`, that every TODO
has at least two mutants that apply.

A TODO whose tests build on an earlier TODO's code (lesson 03's ZeRO-2 on TODO 1's slices, lesson 07's encoding
on TODO 3's quantize) first runs that TODO's own check and, when it fails, fails with "TODO n: needs TODO k
first": the report shows TODO n as waiting, not failing, so one mistake is blamed on one TODO.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    todo: int  # the TODO whose region the mistake is in (and whose test must catch it)
    what: str  # one line: what the mistake gets wrong
    find: str  # solution code, found exactly once, inside TODO `todo`'s region
    replace: str  # the mistake
    # Words the TODO's failing line in `make check` must show (case aside), so that the line diagnoses this mistake:
    # what differed, or its likely cause. `make mutants` fails the entry when the line lacks one. Not for VARIANTS.
    shows: tuple[str, ...] = ()
