"""Comparisons that cancel drift: the things compared (backends of one shape, a hooked and a plain forward, a tuned
mix and a single backend) run in rounds, each round every one of them once, the order reversed every other round
(ABBA: A B C, C B A, A B C, ...), so that a host or a clock drifting steadily through the rounds weighs on each
alike. The H200's host stepped 1.47x faster between two cells run once each in a fixed order, which read as one
backend 1.42x faster than the same kernels forced."""
from __future__ import annotations

from typing import Callable, Hashable


def abba(names: list, rounds: int) -> list:
    """The order the names run in over `rounds` rounds: forward in even rounds, reversed in odd ones."""
    return [name for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def interleaved(runs: dict[Hashable, Callable[[], float]], rounds: int) -> dict[Hashable, list[float]]:
    """Each run's samples (each call of it returns one sample, in ms), taken in ABBA rounds; at least two rounds, so
    that every run is measured both early and late."""
    if rounds < 2:
        raise ValueError(f"interleaved comparisons take at least two rounds, not {rounds}")
    samples: dict[Hashable, list[float]] = {name: [] for name in runs}
    for name in abba(list(runs), rounds):
        samples[name].append(runs[name]())
    return samples
