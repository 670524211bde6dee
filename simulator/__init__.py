"""Simulated xiaozhi devices running the real firmware code (firmware/lib) on CPython."""

from simulator.fleet import SimulatedDevice, run_fleet

__all__ = ["SimulatedDevice", "run_fleet"]
