"""`python -m backend.cli`: the same command line as `esp32-bridge`."""

from backend.cli.main import main

main()
