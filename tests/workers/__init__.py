"""Helpers the tests run or import, not tests themselves: worker processes (``python -m
tests.workers.<name>`` or forkserver targets), drivers of several peers, fuzzing pieces, and the one
set of tiny-trainer overrides (:mod:`tests.workers.tiny`)."""
