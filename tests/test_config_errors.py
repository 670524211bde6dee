"""Config errors that say where and what would do: the file and line of a bad key or value, the
closest known key, the allowed values of a fixed set, the `BRIDGE_*` variable a value came from;
unknown `BRIDGE_*` variables warned about once."""

import re
from pathlib import Path

import pytest

from backend import config_errors
from backend.config import ConfigError, Settings, load_settings
from backend.config_errors import (
    OTHER_VARIABLES,
    setting_variable,
    toml_key_lines,
    unknown_variables,
    warn_unknown_variables,
)
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent


def refusal(tmp_path: Path, text: str) -> tuple[Path, str]:
    path = tmp_path / "bridge.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_settings(path)
    message = str(refused.value)
    assert "\n" not in message  # one line for the user
    return path, message


def test_an_unknown_key_names_the_file_the_line_and_the_closest_key(tmp_path):
    path, message = refusal(tmp_path, "# my bridge\n\nws_host = '0.0.0.0'\nws_prot = 47200\n")
    assert message == f'{path}, line 4: unknown setting "ws_prot"; did you mean "ws_port"?'


def test_an_unknown_key_far_from_any_gets_no_guess(tmp_path):
    path, message = refusal(tmp_path, "zzzz_qqqq = 1\n")
    assert message == f'{path}, line 1: unknown setting "zzzz_qqqq"'


def test_a_key_inside_a_table_array_is_found_in_its_own_entry(tmp_path):
    text = (
        '[[mcp_servers]]\nname = "a"\ncommand = "x"\n\n[[mcp_servers]]\nname = "b"\ncomand = "y"\n'
    )
    path, message = refusal(tmp_path, text)
    assert message == (
        f'{path}, line 7: unknown key "comand" in mcp_servers[1]; did you mean "command"?'
    )


def test_the_line_is_the_real_key_not_a_comment_a_string_or_another_table(tmp_path):
    text = (
        "# llm_provider = 'ollama'\n"  # 1: a comment
        'activation_message = """\n'  # 2
        "llm_provider = 'in a string'\n"  # 3: inside a multi-line string
        '"""\n'  # 4
        "[tool_timeouts]\n"  # 5
        '"self.x" = 3\n'  # 6
        "[rate_limits.handshake_ip]\n"  # 7
        "per_s = 1\n"  # 8
        "burst = 0\n"  # 9: the bad one
    )
    path, message = refusal(tmp_path, text)
    assert message.startswith(f"{path}, line 9: invalid setting 'rate_limits.handshake_ip.burst'")
    lines = toml_key_lines(text)
    assert ("llm_provider",) not in lines
    assert lines[("tool_timeouts", "self.x")] == 6
    assert lines[("rate_limits", "handshake_ip", "per_s")] == 8


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # a pattern of alternatives
        (
            'llm_provider = "openia"',
            "invalid setting 'llm_provider': \"openia\" is not one of: openai, ollama, none; "
            'did you mean "openai"?',
        ),
        # a Literal
        (
            'device_auth = "devise"',
            "invalid setting 'device_auth': \"devise\" is not one of: device, shared, off; "
            'did you mean "device"?',
        ),
        # a Literal in a list
        (
            'search_providers = ["duckduckgo", "gogle"]',
            "invalid setting 'search_providers[1]': \"gogle\" is not one of: duckduckgo, "
            'google, searxng; did you mean "google"?',
        ),
        # nothing close: the allowed values, no guess
        ('asr_language = "fr"', "invalid setting 'asr_language': \"fr\" is not one of: en, vi"),
    ],
)
def test_a_value_outside_a_fixed_set_lists_the_allowed_ones(tmp_path, line, expected):
    path, message = refusal(tmp_path, f"ws_port = 9000\n{line}\n")
    assert message == f"{path}, line 2: {expected}"


def test_a_value_of_another_kind_still_names_the_file_and_line(tmp_path):
    path, message = refusal(tmp_path, "\nws_port = 'abc'\n")
    assert message.startswith(f"{path}, line 2: invalid setting 'ws_port': Input should be")


def test_a_check_across_settings_points_at_the_setting_it_names(tmp_path):
    path, message = refusal(tmp_path, 'ws_port = 9000\ncluster_url = "mqtt://u:p@broker"\n')
    assert message.startswith(f"{path}, line 2: invalid settings: cluster_url needs")


def test_several_errors_report_the_first_in_the_file_and_count_the_others(tmp_path):
    path, message = refusal(tmp_path, 'ws_port = "x"\nws_prot = 1\nlog_format = "jsn"\n')
    assert message.startswith(f"{path}, line 1: invalid setting 'ws_port'")
    assert message.endswith("(and 2 more)")


def test_an_environment_variable_error_names_the_variable(tmp_path, monkeypatch):
    path = tmp_path / "bridge.toml"
    path.write_text('llm_provider = "openai"\n')  # valid: the variable wins over it
    monkeypatch.setenv("BRIDGE_LLM_PROVIDER", "openia")
    with pytest.raises(ConfigError) as refused:
        load_settings(path)
    assert str(refused.value) == (
        "environment variable BRIDGE_LLM_PROVIDER: invalid setting 'llm_provider': \"openia\" "
        'is not one of: openai, ollama, none; did you mean "openai"?'
    )
    monkeypatch.delenv("BRIDGE_LLM_PROVIDER")
    monkeypatch.setenv("BRIDGE_WS_PORT", "eighty")
    with pytest.raises(
        ConfigError, match=r"^environment variable BRIDGE_WS_PORT: invalid setting 'ws_port'"
    ):
        load_settings(path)
    monkeypatch.delenv("BRIDGE_WS_PORT")
    monkeypatch.setenv("BRIDGE_TOOL_TIMEOUTS", "{not json")
    with pytest.raises(ConfigError) as refused:
        load_settings(path)
    assert str(refused.value).startswith(
        "environment variable BRIDGE_TOOL_TIMEOUTS: invalid setting 'tool_timeouts': not valid JSON"
    )


def test_a_secret_value_is_never_repeated(monkeypatch, tmp_path):
    monkeypatch.setenv("BRIDGE_DATABASE_URL", "mysql://root:s3cret@db/bridge")
    with pytest.raises(ConfigError) as refused:
        load_settings(data_dir=tmp_path)
    message = str(refused.value)
    assert message.startswith("environment variable BRIDGE_DATABASE_URL: invalid setting")
    assert "s3cret" not in message


def test_an_unknown_bridge_variable_is_warned_about_once(monkeypatch):
    monkeypatch.setattr(config_errors, "_warned_variables", set())
    monkeypatch.setenv("BRIDGE_WS_PROT", "47200")
    for name in OTHER_VARIABLES:  # read outside Settings: known
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("BRIDGE_WS_PORT", "9000")
    said: list[str] = []
    warn_unknown_variables(Settings, said.append)
    warn_unknown_variables(Settings, said.append)
    assert said == [
        "BRIDGE_WS_PROT is not a known variable (ignored); did you mean BRIDGE_WS_PORT?"
    ]


async def test_the_cli_warns_on_stderr_and_not_about_its_own_variables(tmp_path):
    _code, out, err = await run_cli(
        "devices",
        "--data-dir",
        str(tmp_path),
        env={
            "BRIDGE_WS_PROT": "47200",
            "BRIDGE_ADMIN_TOKEN": "",
            "BRIDGE_SERVER": "http://127.0.0.1:1",  # read by the CLI, not a setting
            "BRIDGE_API_KEY": "k",
            "BRIDGE_SIMULATE_OTA": "http://127.0.0.1:1/",
        },
    )
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: BRIDGE_WS_PROT is not a known variable (ignored); did you mean BRIDGE_WS_PORT?"
    ], err
    assert "BRIDGE_WS_PROT" not in out and "Traceback" not in err


def test_every_bridge_variable_the_project_names_is_known():
    """A variable read outside Settings must be in OTHER_VARIABLES, or users setting it would
    be told it is a typo."""
    known = {setting_variable(field) for field in Settings.model_fields} | OTHER_VARIABLES
    assert unknown_variables(Settings, {name: "1" for name in known}) == []
    named: dict[str, str] = {}
    suffixes = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".env", ".txt", ".cfg", ""}
    for top in ("backend", "simulator", "scripts", "docs", "deploy", "bench", "tools"):
        for path in (ROOT / top).rglob("*"):
            if "node_modules" in path.parts or not path.is_file() or path.suffix not in suffixes:
                continue
            text = path.read_text(errors="replace")
            for found in re.finditer(r"(?<![\w])BRIDGE_[A-Z0-9_]*[A-Z0-9](?![\w{])", text):
                named.setdefault(found.group(), str(path.relative_to(ROOT)))
    assert "BRIDGE_SERVER" in named and "BRIDGE_WS_PORT" in named  # the scan sees them
    strangers = {name: where for name, where in named.items() if name not in known}
    assert strangers == {}
