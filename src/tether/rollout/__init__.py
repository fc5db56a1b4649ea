"""Rollout engines: the generator side of the mismatch."""

from tether.rollout.types import Generator, Rollout, SamplingParams

__all__ = ["Generator", "Rollout", "SamplingParams"]
