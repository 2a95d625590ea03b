"""Registers the built-in studies, in report order (importing a module registers its study)."""
from . import correctness, throughput, error, rank, recall, horizon, rules, learned, mqar  # noqa: F401
