"""The `esp32-bridge` command line."""
