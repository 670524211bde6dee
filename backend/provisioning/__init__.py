"""Provisioning: the OTA/activation endpoint for devices, per-device credentials, firmware
offers, abuse limits (docs/provisioning.md).

- `store`: approved devices, pending activations, enrollment codes, serial keys (in memory,
  written to the bridge database); the per-device token check for handshakes and brokers.
  `pending` holds the pending activations and their fair shares, `records` the records,
  `tables` their rows and schema.
- `ota`: the stock OTA request and answer (protocol reference §5) as data.
- `releases`: the firmware an operator published per board, and which device is offered what.
- `bundle`: the OTA bundle format of our MicroPython firmware (packed by `firmware bundle`).
- `service`: `Provisioning`, what the bridge wires in: the store, firmware releases, rate
  limits, the device-facing HTTP listener (`http`), and the operator's actions.
"""
