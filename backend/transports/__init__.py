"""Device transports: bytes and envelopes in, `DeviceSession` calls out. No MCP here."""
