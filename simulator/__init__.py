"""Simulated xiaozhi devices running the real firmware code (firmware/lib) on CPython."""

from simulator.fleet import MqttOptions, SimulatedDevice, run_fleet

__all__ = ["MqttOptions", "SimulatedDevice", "run_fleet"]
