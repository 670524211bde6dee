"""The harness the tests and the benchmarks share, never shipped in the wheel: the fake LLM and
vision model on loopback, throwaway Mosquitto, PostgreSQL and HAProxy, `serve` processes, a
TCP balancer and in-process clusters, the hostile and siege clients, fuzzing corpora, firmware
run in-process and under MicroPython's memory limits, the spoken recognition set.

`simulator/` is what users run (`esp32-bridge simulate`, the voice client); this package is
what tests and `bench/` use to attack and measure the bridge."""
