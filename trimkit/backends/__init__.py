"""Backends: the seam between trimkit and a model engine (see :mod:`trimkit.backends.base`)."""

from trimkit.backends.base import Backend, Measurement, TimedStream

__all__ = ["Backend", "Measurement", "TimedStream"]
