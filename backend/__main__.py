"""`python -m backend`: the bridge's command line (`esp32-bridge`)."""

from backend.cli.main import main

main()
