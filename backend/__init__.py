"""esp32-mcp-bridge: backend for xiaozhi-compatible ESP32 voice devices."""

__version__ = "0.1.0"
