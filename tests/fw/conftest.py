# The modules here are tinytest suites for MicroPython as well as CPython (run them with run.py);
# pytest runs them through tests/test_firmware_runtimes.py and must not collect them itself.
collect_ignore_glob = ["*.py"]
