"""Bridge settings: one TOML file plus `BRIDGE_*` environment overrides.

Precedence, highest first: command-line flags, environment (`BRIDGE_WS_PORT=9000`), the TOML
file (`--config` or `BRIDGE_CONFIG`), the defaults below. Every default is listed in
docs/configuration.md (tests/test_docs.py keeps it whole).
"""

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from backend.config_errors import closest, explain, explain_source_error
from backend.errors import BridgeError
from backend.mcp_servers.settings import McpServerSettings, check_server_list


class ConfigError(BridgeError):
    """The configuration cannot be loaded; the message is one line for the user."""


DeviceAuth = Literal["device", "shared", "off"]
# Web search providers (backend/chat/search.py), tried in the order `search_providers` lists.
SearchProvider = Literal["duckduckgo", "google", "searxng"]


class RateLimit(BaseModel):
    """A token bucket: `per_s` requests a second on average, bursts of up to `burst`."""

    per_s: float = Field(gt=0)
    burst: int = Field(ge=1)


# Per client IP and per Device-Id, for the WebSocket handshake, the OTA check and activation.
DEFAULT_RATE_LIMITS: dict[str, RateLimit] = {
    # TCP connections to the device endpoint, counted at accept (before a byte is parsed).
    "connection_ip": RateLimit(per_s=20, burst=50),
    "handshake_ip": RateLimit(per_s=20, burst=200),
    "handshake_device": RateLimit(per_s=1, burst=10),
    "ota_ip": RateLimit(per_s=10, burst=100),
    "ota_device": RateLimit(per_s=1, burst=10),
    "activate_ip": RateLimit(per_s=10, burst=100),
    "activate_device": RateLimit(per_s=1, burst=10),
    # Photo uploads to the bridge's vision endpoint (each one costs a model call).
    "vision_ip": RateLimit(per_s=1, burst=20),
    "vision_device": RateLimit(per_s=0.2, burst=3),
}
DEFAULT_CONFIRM_TOOLS = ("*.reboot", "*upgrade*", "*reconfigure*", "*.set_download_url")


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/esp32-bridge`, else `~/.local/share/esp32-bridge`."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "esp32-bridge"


class Settings(BaseSettings):
    """Every setting of the bridge: init values, then `BRIDGE_*` variables, then the TOML file."""

    model_config = SettingsConfigDict(env_prefix="BRIDGE_", extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir)
    # The database (docs/storage.md): unset, the SQLite file in data_dir; a postgresql:// URL, a
    # PostgreSQL server that several bridges share. Kept out of repr: it may hold a password.
    database_url: str | None = Field(None, repr=False)
    # Device endpoint (WebSocket). Devices live on the LAN, so it listens on every interface.
    ws_host: str = "0.0.0.0"
    ws_port: int = Field(8000, ge=0, le=65535)
    ws_path: str = "/xiaozhi/v1/"
    ws_backlog: int = Field(4096, ge=16)
    # Admin API: localhost only unless explicitly changed.
    http_host: str = "127.0.0.1"
    http_port: int = Field(8003, ge=0, le=65535)
    # Connections to the admin listener and the metrics listener (docs/reliability.md): a whole
    # request head within http_head_timeout_s of opening or of the last response, an idle
    # kept-alive one closed after http_keep_alive_s; at most http_max_connections open (never
    # over a quarter of the open-file limit), http_max_connections_per_address from one address
    # outside rate_limit_exempt, which opens at most rate_limits.connection_ip new ones.
    http_head_timeout_s: float = Field(10.0, gt=0)
    http_keep_alive_s: float = Field(5.0, gt=0)
    http_max_connections: int = Field(1024, ge=1)
    http_max_connections_per_address: int = Field(64, ge=1)
    # Tokens; when unset, `serve` creates them in data_dir (mode 0600).
    admin_token: SecretStr | None = None
    device_token: SecretStr | None = None
    # "device": per-device tokens from OTA activation (docs/provisioning.md); "shared": every
    # device uses device_token (development); "off": no device check. true/false mean device/off.
    device_auth: DeviceAuth = "device"
    # The secret every device token derives from (docs/provisioning.md); unset: the file
    # device-credentials.secret in data_dir (0600, created by `serve`). A cluster needs it, the
    # same on every instance, so that each derives the same tokens.
    device_secret: SecretStr | None = None
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
    # Per address (outside `rate_limit_exempt`): idle sockets from one host cannot fill the cap.
    max_pending_handshakes_per_address: int = Field(64, ge=1)
    max_http_body_bytes: int = Field(65536, ge=1024)  # admin API bodies; larger: 413
    # Browser origins (`https://app.example`) allowed to call the HTTP API (CORS). Empty: no
    # cross-origin call is allowed (no Access-Control-* header is ever sent).
    cors_origins: list[str] = Field(default_factory=list)
    # The web console at `/` of the admin listener (docs/console.md); off: the API alone.
    console_enabled: bool = True
    # Prometheus metrics (docs/metrics.md): GET /metrics on the admin listener (scope
    # metrics:read). Off: nothing is recorded and no /metrics is served. A listener of its own
    # when metrics_port is set (0: any free port), on metrics_host; metrics_auth = false lets a
    # scraper in without a key there only (never on the admin listener).
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_auth: bool = True
    hello_timeout_s: float = Field(10.0, gt=0)
    init_timeout_s: float = Field(10.0, gt=0)
    call_timeout_s: float = Field(10.0, gt=0)
    tool_timeouts: dict[str, float] = Field(
        default_factory=lambda: {"self.camera.take_photo": 30.0}
    )
    ping_interval_s: float | None = Field(20.0, gt=0)
    list_user_tools: bool = True
    # Sent to devices in initialize as capabilities.vision (used by self.camera.take_photo): an
    # external vision server and its one token. Unset: the bridge's own endpoint (POST
    # /vision/explain on the device HTTP listener, docs/vision.md), each device its own token.
    vision_url: str | None = None
    vision_token: SecretStr | None = None
    # The OpenAI-compatible model the bridge's endpoint asks (`POST {base}/v1/chat/completions`
    # with the photo as a data: URL). Unset: devices hear that no vision model is configured.
    vision_base_url: str | None = None
    vision_api_key: SecretStr | None = None
    vision_model: str = "gpt-4o-mini"
    vision_timeout_s: float = Field(20.0, gt=0)  # under the take_photo tool's 30 s
    vision_max_bytes: int = Field(2 * 1024 * 1024, ge=1024)  # the upload body; larger: 413
    # Downlink audio parameters announced in the server hello (Opus devices; a device whose
    # hello says `format: "pcm16"` gets PCM16 at 16 kHz, or the rate its hello asks for).
    audio_sample_rate: int = Field(24000, ge=8000, le=48000)
    audio_frame_duration: int = 60

    # ---- voice (backend/voice, docs/voice.md) -------------------------------------------------
    voice_enabled: bool = True  # off, or without the voice packages: devices get text only
    # Speech recognition: the embedded Whisper tiny.en (English) with the embedded Vietnamese
    # recognizer when the `voice-vi` extra is installed, an OpenAI-compatible
    # /v1/audio/transcriptions server (embedded behind it), or none.
    asr_provider: Literal["embedded", "openai", "none"] = "embedded"
    asr_base_url: str = "http://localhost:8000"
    asr_api_key: SecretStr | None = None
    asr_model: str = "whisper-1"
    # A device's language when it has none of its own: "en", "vi", or None (auto: the language
    # of its last turns, English at first).
    asr_language: Literal["en", "vi"] | None = None
    asr_timeout_s: float = Field(10.0, gt=0)
    asr_workers: int = Field(1, ge=1, le=16)  # decoding processes (each holds the model)
    # Threads per decoding process; None: half the cores (1 on 2 cores, where one thread decoded
    # a command faster than two and left the event loop its core: docs/benchmarks.md).
    asr_threads: int | None = Field(None, ge=1, le=32)
    asr_queue_max: int = Field(8, ge=0, le=10_000)  # utterances waiting; more hear an apology
    asr_vietnamese: bool = True  # use the Vietnamese recognizer when `viet-asr` is installed
    # Speech synthesis: the embedded eSpeak NG (Vietnamese and English), or an OpenAI-compatible
    # /v1/audio/speech server (response_format "pcm"); eSpeak stays its fallback.
    tts_provider: Literal["embedded", "openai", "none"] = "embedded"
    tts_base_url: str = "http://localhost:8000"
    tts_api_key: SecretStr | None = None
    tts_model: str = "tts-1"
    tts_voice: str = "alloy"
    tts_speed: float = Field(1.0, ge=0.25, le=4.0)
    tts_timeout_s: float = Field(10.0, gt=0)
    # Turn taking: silence that ends an utterance (auto and realtime modes), the longest
    # utterance kept, and how long a listening channel may hear nothing before a goodbye.
    # 500: on bench.voice_recognition's set, 250 to 800 ms were heard the same (docs/voice.md).
    voice_silence_ms: int = Field(500, ge=100, le=5000)
    voice_max_utterance_s: float = Field(20.0, gt=1, le=120)
    voice_idle_close_s: float = Field(30.0, gt=0)
    # Pacing: frames sent ahead of the playout clock (the stock device buffers 40), and the
    # wait after the last frame is due before `tts stop` (the device resets its decoder on it).
    voice_lead_frames: int = Field(2, ge=0, le=30)
    voice_stop_margin_ms: int = Field(180, ge=0, le=5000)
    voice_max_sessions: int = Field(512, ge=1)  # talking devices at once; more hear an apology
    log_level: str = "info"
    log_format: str = Field("auto", pattern="^(auto|json|console)$")
    # ---- MQTT + UDP transport (docs/mqtt.md): off unless mqtt_url is set. "embedded" runs the
    # bridge's own MQTT endpoint on mqtt_host:mqtt_port; mqtt[s]://[user:pass@]host[:port] is an
    # external broker.
    mqtt_url: str | None = Field(None, repr=False)  # may hold the bridge's broker password
    mqtt_host: str = "0.0.0.0"
    mqtt_port: int = Field(1883, ge=0, le=65535)
    mqtt_client_id: str = "esp32-mcp-bridge"
    mqtt_topic_prefix: str = "xiaozhi"
    # Several bridge instances on one external broker (docs/mqtt.md, "Several bridge instances"):
    # with N > 1 a device's topics are <prefix>/s<shard>/<key>/…, shard = CRC-32(key) mod N, and
    # each instance subscribes to the shards it owns. 1: <prefix>/<key>/… (one instance).
    mqtt_shards: int = Field(1, ge=1, le=1024)
    mqtt_keepalive_s: int = Field(60, ge=5, le=65535)
    mqtt_silence_timeout_s: float = Field(360.0, gt=0)
    mqtt_ca_file: Path | None = None  # CA bundle for mqtts:// (default: the system's)
    # Derives every device's broker password; when unset, `serve` creates it in data_dir (0600).
    mqtt_secret: SecretStr | None = None
    udp_host: str = "0.0.0.0"
    udp_port: int = Field(8884, ge=0, le=65535)
    udp_public_host: str | None = None  # the UDP address devices are told in the hello
    # ---- several instances on one fleet (docs/cluster.md): set cluster_url (the broker the
    # instances talk over, with this instance's own account) and a PostgreSQL database_url.
    cluster_url: str | None = Field(None, repr=False)  # mqtt[s]://user:password@host:port
    instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # default: host name
    lease_ttl_s: float = Field(6.0, ge=1.0, le=300.0)  # a dead instance's devices expire after
    lease_renew_s: float = Field(2.0, gt=0)  # how often leases are renewed (ttl/3 or less)
    # A drain (`cluster drain`, SIGTERM) keeps its devices this long after readiness turns 503,
    # so the balancer stops routing to it first: deploy/haproxy.cfg checks every `inter 2s` and
    # takes a server out after `fall 2` failures, 2 s x 2 = 4 s. Change it with those values.
    drain_notice_s: float = Field(4.0, ge=0, le=300)
    # Devices a drain then moves per second (each once its calls in flight finished); 50/s costs
    # the receiving instances ~8 % of a core (1.6 ms CPU per device connect, docs/benchmarks.md).
    drain_rate_per_s: float = Field(50.0, gt=0, le=10000)
    # An instance holding over 110 % of its fair share (and 3+ devices over) moves the excess to
    # emptier instances at `rebalance_rate_per_s`, never below its share; false: never.
    cluster_rebalance: bool = True
    rebalance_rate_per_s: float = Field(10.0, gt=0, le=10000)
    # ---- external MCP servers the chat may use (docs/mcp-servers.md): [[mcp_servers]] tables,
    # each a stdio command or a Streamable HTTP url; an API key needs the scope mcp:<name>.
    mcp_servers: list[McpServerSettings] = Field(default_factory=list)
    # ---- the MCP endpoint users' MCP servers dial in to (ws://<api>/v1/mcp-endpoint/?token=,
    # backend/mcp_dialin): dial-ins open or handshaking, in all and per key; the initialize +
    # tools/list deadline; the largest text frame (the API listener's WebSocket frame cap too).
    mcp_endpoint_max_connections: int = Field(64, ge=1)
    mcp_endpoint_max_per_key: int = Field(2, ge=1)
    mcp_endpoint_init_timeout_s: float = Field(10.0, gt=0)
    mcp_endpoint_max_frame_bytes: int = Field(1 << 20, ge=1024)

    @field_validator("mcp_servers")
    @classmethod
    def _unique_mcp_servers(cls, value: list[McpServerSettings]) -> list[McpServerSettings]:
        return check_server_list(value)

    @field_validator("device_auth", mode="before")
    @classmethod
    def _auth_mode(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "device" if value else "off"
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return "device" if value.strip().lower() in ("true", "1") else "off"
        return value

    @field_validator("rate_limits", mode="before")
    @classmethod
    def _merged_limits(cls, value: Any) -> Any:
        """A table names only the limits it changes; the others keep their defaults."""
        if not isinstance(value, dict):
            return value
        unknown = set(value) - set(DEFAULT_RATE_LIMITS)
        if unknown:
            hint = closest(min(unknown), DEFAULT_RATE_LIMITS)
            raise ValueError(
                f"unknown rate limit(s) {sorted(unknown)}: {sorted(DEFAULT_RATE_LIMITS)}"
                + (f'; did you mean "{hint}"?' if hint else "")
            )
        return {**DEFAULT_RATE_LIMITS, **value}

    @field_validator("search_providers", mode="before")
    @classmethod
    def _provider_list(cls, value: Any) -> Any:
        """`BRIDGE_SEARCH_PROVIDERS=searxng,duckduckgo` as well as a JSON or TOML list."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except ValueError:
                    raise ValueError(f"not a JSON list of provider names: {text}") from None
            return [part.strip().lower() for part in text.split(",") if part.strip()]
        return value

    @field_validator("search_providers")
    @classmethod
    def _providers_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"a provider is listed twice: {value}")
        return value

    @model_validator(mode="after")
    def _search_configured(self) -> "Settings":
        """A listed provider must be usable: caught at start-up rather than at the first turn."""
        if not self.search_enabled:
            return self
        google = self.search_google_api_key is not None and self.search_google_engine_id
        if "google" in self.search_providers and not google:
            raise ValueError(
                "search_providers lists google: set search_google_api_key and "
                "search_google_engine_id"
            )
        if "searxng" in self.search_providers and not self.search_searxng_url:
            raise ValueError("search_providers lists searxng: set search_searxng_url")
        return self

    @model_validator(mode="after")
    def _shards_need_a_broker(self) -> "Settings":
        """The embedded endpoint is one bridge's own: its topics are never sharded."""
        if self.mqtt_shards > 1 and self.mqtt_url == "embedded":
            raise ValueError('mqtt_shards > 1 needs an external broker (mqtt_url "mqtt[s]://…")')
        return self

    @field_validator("instance_id")
    @classmethod
    def _not_a_topic_kind(cls, value: str | None) -> str | None:
        # With MQTT shards a device may publish on <prefix>/+/<its key>/up|status: an instance
        # named like a topic kind would let a device keyed "rpc" or "reply" reach its channel.
        if value in ("up", "down", "status"):
            raise ValueError("instance_id must not be up, down or status (MQTT topic kinds)")
        return value

    @model_validator(mode="after")
    def _cluster_needs_postgres(self) -> "Settings":
        if self.cluster_url is None:
            return self
        if self.database_url is None:
            raise ValueError(
                "cluster_url needs a PostgreSQL database_url that every instance shares"
            )
        if self.lease_renew_s * 2 >= self.lease_ttl_s:
            raise ValueError("lease_renew_s must be under half of lease_ttl_s")
        return self

    @model_validator(mode="after")
    def _cluster_shares_secrets(self) -> "Settings":
        """Tokens and broker passwords are derived from a secret: every instance needs the same
        one, not a file of its own in its data dir."""
        if self.cluster_url is None:
            return self
        if self.device_auth == "device" and not _is_set(self.device_secret):
            raise ValueError(
                'a cluster with device_auth = "device" needs device_secret '
                "(BRIDGE_DEVICE_SECRET), the same on every instance: every instance must derive "
                "the same device tokens"
            )
        # With per-device tokens the broker password is the device's token; otherwise it is
        # derived from mqtt_secret (backend/transports/mqtt_setup.py).
        if self.mqtt_url and self.device_auth != "device" and not _is_set(self.mqtt_secret):
            raise ValueError(
                "a cluster with mqtt_url needs mqtt_secret (BRIDGE_MQTT_SECRET), the same on "
                "every instance: every instance must derive the same device broker passwords"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        """Only PostgreSQL URLs; the message never repeats the URL (it may hold a password)."""
        if value is None or not value.strip():
            return None
        scheme = value.strip().partition("://")[0].lower() if "://" in value else ""
        if scheme not in ("postgresql", "postgres"):
            raise ValueError(
                "expected a postgresql://user:password@host:port/database URL "
                "(unset: the SQLite file in data_dir)"
            )
        return value.strip()

    @field_validator("ws_path", "ota_path")
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
        """Init values win over `BRIDGE_*` variables, which win over the TOML file; no .env or
        secret files."""
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @classmethod
    def on_loopback(cls, data_dir: Path, **values: Any) -> "Settings":
        """Every listener on 127.0.0.1 with an ephemeral port and devices on one shared token
        (the development mode): the bridge that tests, benchmarks and measurements start."""
        loopback: dict[str, Any] = {
            "data_dir": data_dir,
            "ws_host": "127.0.0.1",
            "ws_port": 0,
            "http_port": 0,
            "device_http_host": "127.0.0.1",
            "device_http_port": 0,
            "device_auth": "shared",
        }
        return cls(**{**loopback, **values})

    def timeout_for(self, tool_name: str) -> float:
        """The tools/call timeout of a tool in seconds: its own, else `call_timeout_s`."""
        return self.tool_timeouts.get(tool_name, self.call_timeout_s)

    # ---- chat pipeline (backend/chat, docs/chat.md)
    llm_provider: str = Field("ollama", pattern="^(openai|ollama|none)$")
    llm_base_url: str = "http://localhost:11434"
    llm_api_key: SecretStr | None = None
    llm_model: str = "qwen2.5:7b-instruct"
    guardrail_model: str = "qwen2.5:3b-instruct"
    # The models a request may ask for (`chat_model`, `guardrail_model`: the console's settings),
    # besides the two above. None: any the model service has; [] : only the configured ones.
    chat_models_allowed: list[str] | None = None
    llm_timeout_s: float = Field(60.0, gt=0)
    search_enabled: bool = True
    # Tried in this order until one answers with results (env: "searxng,duckduckgo" or JSON).
    search_providers: Annotated[list[SearchProvider], NoDecode] = Field(
        default_factory=lambda: list[SearchProvider](["duckduckgo"]), min_length=1
    )
    search_timeout_s: float = Field(3.0, gt=0)  # per provider tried
    search_results: int = Field(5, ge=1, le=20)
    # Google Programmable Search (Custom Search JSON API): an API key and the engine id (`cx`).
    search_google_api_key: SecretStr | None = None
    search_google_engine_id: str | None = None
    search_google_url: str = "https://www.googleapis.com/customsearch/v1"
    search_searxng_url: str | None = None  # a SearxNG instance allowing format=json
    # Knowledge-base entries less relevant than this (BM25 × the share of the question's words
    # they hold; real questions 2.5 and up) are neither sent to the model nor shown.
    kb_min_score: float = Field(2.0, ge=0)
    # The conversation summary kept and sent to the model (docs/chat.md, step 9).
    chat_summary_max_chars: int = Field(4000, ge=200, le=200_000)
    chat_summary_max_tokens: int = Field(1000, ge=50, le=50_000)
    # A whole chat turn ends within this (every model round, tool call and the summary), and an
    # answer within this many tokens (`finish_reason: "length"`); a client's `max_tokens` may
    # ask for less, never more.
    chat_turn_timeout_s: float = Field(120.0, gt=0, le=3600)
    chat_max_answer_tokens: int = Field(1024, ge=16, le=128_000)
    # The functions a turn offers the model: at most this many, and this many bytes of their
    # declarations; the most relevant to the request when there are more (chat/tool_budget.py).
    chat_max_tools_per_turn: int = Field(32, ge=1, le=1024)
    chat_max_tool_bytes_per_turn: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)

    # ---- provisioning (backend/provisioning, docs/provisioning.md) -------------------------------
    # The device-facing HTTP listener: the OTA/activation endpoint and firmware downloads.
    device_http_host: str = "0.0.0.0"
    device_http_port: int = Field(8002, ge=0, le=65535)
    device_http_max_connections: int = Field(1024, ge=1)  # more at once: 503 at once
    # An OTA or activation body must arrive whole within this after its head (408, closed).
    device_http_body_timeout_s: float = Field(10.0, gt=0)
    # The audit log (docs/provisioning.md#audit-log): rows older than this many days, and the
    # oldest rows past `audit_max_rows`, are deleted every hour; 0 keeps them.
    audit_retention_days: float = Field(90.0, ge=0)
    audit_max_rows: int = Field(1_000_000, ge=0)
    ota_path: str = "/xiaozhi/ota/"
    # What the OTA answer tells devices; by default built from the Host the device used.
    ota_websocket_url: str | None = None
    ota_mqtt_endpoint: str | None = None  # "host:port" of the broker, as devices reach it
    device_transport: Literal["websocket", "mqtt"] = "websocket"  # per device: devices transport
    ota_timezone_offset_min: int | None = Field(None, ge=-720, le=840)  # default: the bridge's
    activation_message: str = "Activation code {code}"
    activation_ttl_s: float = Field(86400.0, gt=0)  # a pending request not polled for this long
    max_pending_activations: int = Field(4096, ge=1)
    activation_auto_approve_macs: list[str] = Field(default_factory=list)  # MAC prefixes
    activation_require_hmac: bool = False  # devices with a serial number must prove its key
    firmware_max_attempts: int = Field(3, ge=1)  # offers of one version before giving up
    # Tools that need an explicit confirmation (fnmatch patterns, "DEVICE/TOOL" for one device,
    # "!" exempts; the last matching entry wins), and MCP `destructiveHint: true` tools.
    confirm_tools: list[str] = Field(default_factory=lambda: list(DEFAULT_CONFIRM_TOOLS))
    confirm_destructive_hint: bool = True
    rate_limits: dict[str, RateLimit] = Field(default_factory=lambda: dict(DEFAULT_RATE_LIMITS))
    rate_limit_exempt: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])


def _is_set(secret: SecretStr | None) -> bool:
    return secret is not None and bool(secret.get_secret_value().strip())


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Load settings; `overrides` are command-line flags (None means "not given"). A bad value
    or an unknown key raises ConfigError naming where it came from: the config file and line,
    the `BRIDGE_*` variable, or the command line."""
    path = config_file or os.environ.get("BRIDGE_CONFIG")
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=path)

    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return _FileSettings(**given)
    except ValidationError as exc:
        raise ConfigError(explain(exc, Settings, path, given)) from None
    except SettingsError as exc:  # a BRIDGE_* value that is not JSON where JSON is needed
        raise ConfigError(explain_source_error(exc)) from None
    except ValueError as exc:  # TOML syntax errors (tomllib names the line and column)
        raise ConfigError(f"cannot read config {path}: {exc}") from None
