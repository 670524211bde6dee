"""Every table the CLI prints, built by the functions the commands use, from rows with long,
realistic values, rendered at 80 and 120 columns: every header and every key value (what one
copies into the next command) appears whole, nothing is cut with "…", no line runs past the
terminal; `--wide` keeps each row on one line. Also: no emoji or markup read from data."""

import contextlib
import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from backend.cli import audit, cluster, devices, firmware, keys, main, mcp
from backend.cli.output import Listing, listing

MAC = "a4:cf:12:34:56:78"
OTHER_MAC = "02:00:00:00:03:e8"
CLIENT = "9f1c2d3e-4b5a-6789-abcd-ef0123456789"
AT = "2026-11-29T15:31:30.123456+00:00"
LATER = "2026-11-29T16:02:11.654321+00:00"
SHA = "3b7e0c2a9d4f1e6b8c5a7d2e9f0b1c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b"


def _devices(clustered: bool) -> tuple[Listing, list[str]]:
    rows = [
        {
            "device_id": MAC,
            "state": "connecting",
            "transport": "websocket",
            "tool_count": 12,
            "server_info": {"name": "xiaozhi-esp32-s3-box3", "version": "1.6.2-rc3"},
            "connected_at": AT,
            "last_seen": LATER,
            **({"instance": "bridge-eu-west-1a"} if clustered else {}),
        },
        {
            "device_id": OTHER_MAC,
            "state": "offline",
            "transport": "mqtt",
            "tool_count": 3,
            "ota": {"board_type": "esp32-s3-korvo-2-v3", "firmware_version": "2.0.0+build.77"},
            "connected_at": None,
            "last_seen": AT,
            **({"instance": None} if clustered else {}),
        },
    ]
    keys_ = [MAC, OTHER_MAC] + (["bridge-eu-west-1a"] if clustered else [])
    return devices.devices_table(rows), keys_


def _pending() -> tuple[Listing, list[str]]:
    rows = [
        {
            "code": "482913",
            "device_id": MAC,
            "client_id": CLIENT,
            "board": "esp32-s3-box3-lcd-korvo",
            "firmware": "1.6.2-rc3+build.77",
            "serial_number": "SN00112233445566",
            "serial_check": "verified",
            "remote": "192.168.100.123",
            "created_at": AT,
            "candidates": 2,
        },
        {
            "code": "771204",
            "device_id": MAC,
            "client_id": "0a1b2c3d-4e5f-6789-0abc-def012345678",
            "board": "bread-compact-wifi",
            "firmware": "1.5.9",
            "serial_number": None,
            "serial_check": None,
            "remote": "2001:db8:85a3::8a2e:370:7334",
            "created_at": LATER,
            "candidates": 2,
        },
    ]
    return devices.pending_table(rows), ["482913", "771204", MAC, CLIENT]


def _audit() -> tuple[Listing, list[str]]:
    entries = [
        {
            "at": AT,
            "actor": "chat:key:bcdc0f3a9e21",
            "device_id": MAC,
            "tool": "self.audio_speaker.set_volume",
            "outcome": "ok",
            "error": None,
            "confirmed": False,
            "duration_ms": 12.345,
            "arguments_sha256": SHA,
        },
        {
            "at": LATER,
            "actor": "admin",
            "device_id": OTHER_MAC,
            "tool": "self.reboot",
            "outcome": "error",
            "error": "DeviceTimeout",
            "confirmed": True,
            "duration_ms": 30000.0,
            "arguments_sha256": SHA,
        },
    ]
    return audit.audit_table(entries), [
        "chat:key:bcdc0f3a9e21",
        MAC,
        OTHER_MAC,
        "self.audio_speaker.set_volume",
        "self.reboot",
    ]


def _keys() -> tuple[Listing, list[str]]:
    rows = [
        {
            "id": "k_7f3a9c2e1b",
            "name": "kitchen tablet with a rather long name",
            "scopes": ["devices:read", "devices:call", "chat:use", "mcp:home-assistant"],
            "device_ids": [MAC, OTHER_MAC],
            "created_at": AT,
            "last_used_at": LATER,
            "active": True,
            "revoked_at": None,
        },
        {
            "id": "k_00c1d2e3f4",
            "name": "old script",
            "scopes": ["admin"],
            "device_ids": [],
            "created_at": AT,
            "last_used_at": None,
            "active": False,
            "revoked_at": LATER,
        },
    ]
    return keys.keys_table(rows), ["k_7f3a9c2e1b", "k_00c1d2e3f4"]


def _tools() -> tuple[Listing, list[str]]:
    tools = [
        {
            "name": "self.audio_speaker.set_volume",
            "description": "Set the volume of the audio speaker. If the current volume is "
            "unknown, you must call `self.get_device_status` tool first and then call this tool.",
            "inputSchema": {
                "type": "object",
                "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
                "required": ["volume"],
            },
            "annotations": {"audience": ["assistant", "user"]},
            "needs_confirmation": False,
        },
        {
            "name": "self.reboot",
            "description": "Reboot the device.",
            "inputSchema": {"type": "object", "properties": {}},
            "annotations": None,
            "needs_confirmation": True,  # the bridge's rules, in its listing
        },
    ]
    table = main.tools_table(tools)
    return table, ["self.audio_speaker.set_volume", "self.reboot"]


def _releases() -> tuple[Listing, list[str]]:
    rows = [
        {
            "board": "esp32-s3-box3-lcd-korvo",
            "version": "2.4.3",
            "size": 1834752,
            "sha256": SHA,
            "published_at": AT,
            "downloads": 1234,
        },
        {
            "board": "bread-compact-wifi",
            "version": "10.20.300",
            "size": 912,
            "sha256": SHA,
            "published_at": LATER,
            "downloads": 0,
        },
    ]
    return firmware.releases_table(rows), [
        "esp32-s3-box3-lcd-korvo",
        "bread-compact-wifi",
        "2.4.3",
        "10.20.300",
    ]


def _mcp() -> tuple[Listing, list[str]]:
    rows = [
        {
            "name": "home-assistant",
            "kind": "streamable-http",
            "state": "failed",
            "since": AT,
            "last_error": "connect to https://homeassistant.local:8123/mcp_server/sse failed: "
            "[Errno 111] Connection refused",
            "tools": [{"name": "HassTurnOn", "risky": True}, {"name": "GetLiveContext"}],
        },
        {
            "name": "time",
            "kind": "stdio",
            "state": "ready",
            "since": LATER,
            "last_error": None,
            "tools": [{"name": "get_current_time"}, {"name": "convert_time"}],
        },
    ]
    return mcp.servers_table(rows), ["home-assistant", "time"]


def _cluster() -> tuple[Listing, list[str]]:
    answer = {
        "instance": "bridge-eu-west-1a",
        "instances": [
            {
                "instance_id": "bridge-eu-west-1a",
                "alive": True,
                "draining": False,
                "heartbeat_lag_s": 0.4,
                "devices": 2048,
                "shards": list(range(0, 32, 2)),
                "api_url": "http://10.0.12.34:8766",
            },
            {
                "instance_id": "bridge-eu-west-1b",
                "alive": False,
                "draining": True,
                "heartbeat_lag_s": None,
                "devices": 0,
                "shards": [],
                "api_url": None,
            },
        ],
    }
    return cluster.instances_table(answer), ["bridge-eu-west-1a (this)", "bridge-eu-west-1b"]


def _build() -> tuple[Listing, list[str]]:
    table = listing("file", "bytes", ids=("file",))
    table.add_row("lib/xiaozhi/protocol_websocket.mpy", "18234")
    return table, ["lib/xiaozhi/protocol_websocket.mpy"]


TABLES = {
    "devices": lambda: _devices(False),
    "devices (cluster)": lambda: _devices(True),
    "devices pending": _pending,
    "audit": _audit,
    "keys list": _keys,
    "tools": _tools,
    "firmware releases": _releases,
    "mcp servers": _mcp,
    "cluster status": _cluster,
    "firmware build": _build,
}


def render(table: Listing, width: int) -> str:
    out = Console(width=width, file=io.StringIO(), emoji=False, color_system=None)
    out.print(table, crop=False)
    text = out.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("name", list(TABLES))
def test_every_header_and_key_value_is_whole(name, width):
    table, key_values = TABLES[name]()
    text = render(table, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    assert "…" not in text, text
    for header in table.columns:
        assert re.search(rf"(^|[\s│┃]){re.escape(header)}(:|[\s│┃]|$)", text, re.M), (header, text)
    for value in key_values:
        assert any(value in line for line in lines), (value, text)


@pytest.mark.parametrize("name", list(TABLES))
def test_wide_shows_every_row_on_one_line(name):
    table, _keys = TABLES[name]()
    table.wide = True
    lines = render(table, 80).splitlines()
    for row in table.rows:
        cells = [cell.plain for cell in row if cell.plain]
        assert any(all(cell in line for cell in cells) for line in lines), (cells, lines)


def _is_table(text: str) -> bool:
    """A table has its header rule on the second line; blocks start with `header: value`."""
    lines = text.splitlines()
    return len(lines) > 1 and set(lines[1]) == {"─"}


def test_the_tables_are_tables_on_a_wide_terminal_and_blocks_on_a_narrow_one():
    table, _ = _pending()
    assert _is_table(render(table, 200))
    narrow = render(table, 60)
    assert not _is_table(narrow)
    assert "code:      482913" in narrow and "client_id: " + CLIENT in narrow
    # A bridge's devices fit at 120 columns as a table, their times folded or whole.
    devices_table, _ = _devices(False)
    assert _is_table(render(devices_table, 120))


def test_risky_tools_are_marked():
    table, _ = _tools()
    risky = {row[0].plain: row[-1].plain for row in table.rows}
    assert risky == {"self.audio_speaker.set_volume": "", "self.reboot": "yes"}
    assert table.columns[-1] == "risky"


def test_audit_shows_actors_verbatim(monkeypatch):
    """rich would read `chat:key:bcdc...` as an emoji code (a key) and `[...]` as markup."""
    entries = [
        {
            "at": AT,
            "actor": "chat:key:bcdc0f3a9e21",
            "device_id": MAC,
            "tool": "self.audio_speaker.set_volume",
            "outcome": "error",
            "error": "[bold]DeviceTimeout[/] :smile:",
            "confirmed": False,
            "duration_ms": 1.0,
            "arguments_sha256": SHA,
        }
    ]

    class Admin:
        def get(self, path, params=None):
            assert path == "/api/audit"
            return {"entries": entries}

    @contextlib.contextmanager
    def admin_client(*_args, **_kwargs):
        yield Admin()

    monkeypatch.setattr(audit, "admin_client", admin_client)
    for width in ("80", "200"):
        result = CliRunner().invoke(main.app, ["audit"], env={"COLUMNS": width})
        assert result.exit_code == 0, result.output
        assert "chat:key:bcdc0f3a9e21" in result.output, result.output
        assert "🔑" not in result.output and "😄" not in result.output
        assert "[bold]DeviceTimeout[/]" in " ".join(result.output.split()), result.output


def test_unknown_argument_names_get_a_did_you_mean():
    schema = {"type": "object", "properties": {"volume": {"type": "integer"}}}
    message = main.unknown_argument("self.audio_speaker.set_volume", schema, {"vol": 5})
    assert message == (
        'unknown argument "vol"; did you mean "volume"? '
        "(self.audio_speaker.set_volume takes volume)"
    )
    assert main.unknown_argument("t", schema, {"volume": 5}) is None
    assert main.unknown_argument("t", {"type": "object"}, {"x": 1}) is None  # no properties
    open_schema = {**schema, "additionalProperties": True}
    assert main.unknown_argument("t", open_schema, {"x": 1}) is None
    none = main.unknown_argument("t", {"type": "object", "properties": {}}, {"x": 1})
    assert none == 'unknown argument "x" (t takes no arguments)'


def test_version():
    result = CliRunner().invoke(main.app, ["--version"])
    assert result.exit_code == 0
    import importlib.metadata

    assert result.output.strip().endswith(importlib.metadata.version("esp32-mcp-bridge"))
