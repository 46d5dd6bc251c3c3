"""Grading a patch: the evaluation run, its test services, validation of tasks, predictions."""
