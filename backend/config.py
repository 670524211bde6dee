"""Bridge settings: one TOML file plus `BRIDGE_*` environment overrides.

Precedence, highest first: command-line flags, environment (`BRIDGE_WS_PORT=9000`), the TOML
file (`--config` or `BRIDGE_CONFIG`), the defaults below. Every default is listed in the README.
"""

import os
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from backend.errors import BridgeError


class ConfigError(BridgeError):
    """The configuration cannot be loaded; the message is one line for the user."""


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "esp32-bridge"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BRIDGE_", extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir)
    # Device endpoint (WebSocket). Devices live on the LAN, so it listens on every interface.
    ws_host: str = "0.0.0.0"
    ws_port: int = Field(8000, ge=0, le=65535)
    ws_path: str = "/xiaozhi/v1/"
    ws_backlog: int = Field(4096, ge=16)
    # Admin API: localhost only unless explicitly changed.
    http_host: str = "127.0.0.1"
    http_port: int = Field(8003, ge=0, le=65535)
    # Tokens; when unset, `serve` creates them in data_dir (mode 0600).
    admin_token: SecretStr | None = None
    device_token: SecretStr | None = None
    device_auth: bool = True
    # Limits and timeouts.
    max_message_bytes: int = Field(65536, ge=1024)
    max_queue: int = Field(16, ge=1)
    max_pending_calls: int = Field(256, ge=1)
    # Bounds per device, so one hostile device cannot take memory, log space or time from others.
    max_tools_per_device: int = Field(2000, ge=1)
    max_tool_bytes_per_device: int = Field(1 << 20, ge=1024)
    max_inbound_messages_per_s: float = Field(200.0, gt=0)
    max_inbound_bytes_per_s: float = Field(2_000_000.0, gt=0)
    write_timeout_s: float = Field(10.0, gt=0)
    max_pending_handshakes: int = Field(1024, ge=1)
    # Connection attempts: a burst, then a steady rate, per device id and per remote address.
    handshakes_per_device_burst: float = Field(20.0, ge=1)
    handshakes_per_device_per_s: float = Field(1.0, gt=0)
    connections_per_address_burst: float = Field(50.0, ge=1)
    connections_per_address_per_s: float = Field(20.0, gt=0)
    # Local processes (a simulated fleet, tools) are not limited per address unless asked.
    limit_loopback: bool = False
    hello_timeout_s: float = Field(10.0, gt=0)
    init_timeout_s: float = Field(10.0, gt=0)
    call_timeout_s: float = Field(10.0, gt=0)
    tool_timeouts: dict[str, float] = Field(
        default_factory=lambda: {"self.camera.take_photo": 30.0}
    )
    ping_interval_s: float | None = Field(20.0, gt=0)
    list_user_tools: bool = True
    # Sent to devices in initialize as capabilities.vision (used by self.camera.take_photo).
    vision_url: str | None = None
    vision_token: SecretStr | None = None
    # Downlink audio parameters announced in the server hello.
    audio_sample_rate: int = 24000
    audio_frame_duration: int = 60
    log_level: str = "info"
    log_format: str = Field("auto", pattern="^(auto|json|console)$")
    # ---- MQTT + UDP transport (docs/mqtt.md): off unless mqtt_url is set. "embedded" runs the
    # embedded broker on mqtt_host:mqtt_port; mqtt[s]://[user:pass@]host[:port] is an external one.
    mqtt_url: str | None = Field(None, repr=False)  # may hold the bridge's broker password
    mqtt_host: str = "0.0.0.0"
    mqtt_port: int = Field(1883, ge=0, le=65535)
    mqtt_client_id: str = "esp32-mcp-bridge"
    mqtt_topic_prefix: str = "xiaozhi"
    mqtt_keepalive_s: int = Field(60, ge=5, le=65535)
    mqtt_silence_timeout_s: float = Field(360.0, gt=0)
    mqtt_ca_file: Path | None = None  # CA bundle for mqtts:// (default: the system's)
    # Derives every device's broker password; when unset, `serve` creates it in data_dir (0600).
    mqtt_secret: SecretStr | None = None
    udp_host: str = "0.0.0.0"
    udp_port: int = Field(8884, ge=0, le=65535)
    udp_public_host: str | None = None  # the UDP address devices are told in the hello

    @field_validator("ws_path")
    @classmethod
    def _path_has_slash(cls, value: str) -> str:
        return value if value.startswith("/") else "/" + value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    def timeout_for(self, tool_name: str) -> float:
        return self.tool_timeouts.get(tool_name, self.call_timeout_s)

    # ---- chat pipeline (backend/chat, docs/chat.md)
    llm_provider: str = Field("ollama", pattern="^(openai|ollama|none)$")
    llm_base_url: str = "http://localhost:11434"
    llm_api_key: SecretStr | None = None
    llm_model: str = "qwen2.5:7b-instruct"
    guardrail_model: str = "qwen2.5:3b-instruct"
    llm_timeout_s: float = Field(60.0, gt=0)
    search_enabled: bool = True
    search_timeout_s: float = Field(3.0, gt=0)
    search_results: int = Field(5, ge=1, le=20)


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Load settings; `overrides` are command-line flags (None means "not given")."""
    path = config_file or os.environ.get("BRIDGE_CONFIG")
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=path)

    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return _FileSettings(**given)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ConfigError(f"invalid setting {where!r}: {error['msg']}") from None
    except ValueError as exc:  # TOML syntax errors
        raise ConfigError(f"cannot read config {path}: {exc}") from None
