"""ToolNameMap: device tool names <-> LLM function names, and the LLM function list."""

import hashlib
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.mcp_session import Tool, ToolNameMap, UnknownToolName, llm_functions
from testkit.stock_device import stock_tools

LLM_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

# Mix of arbitrary unicode and names close to the interesting edges (dots, valid ASCII, length).
names_strategy = st.lists(
    st.one_of(
        st.text(max_size=80),
        st.text(alphabet="ab._-", max_size=6),
        st.text(alphabet="xyz.", min_size=60, max_size=70),
        st.from_regex(r"[a-z][a-z0-9_]{0,70}", fullmatch=True),
    ),
    max_size=25,
)


def short_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:8]


@given(names_strategy)
def test_every_name_maps_to_a_valid_unique_reversible_llm_name(names: list[str]) -> None:
    mapping = ToolNameMap(names)
    llm_names = [mapping.to_llm(name) for name in set(names)]
    assert len(mapping) == len(set(names))
    assert len(set(llm_names)) == len(llm_names)
    for name in set(names):
        llm_name = mapping.to_llm(name)
        assert LLM_NAME.match(llm_name), llm_name
        assert len(llm_name) <= 64
        assert mapping.from_llm(llm_name) == name
        if LLM_NAME.match(name):
            assert llm_name == name


@given(names_strategy, st.randoms(use_true_random=False))
def test_mapping_does_not_depend_on_order_or_repetition(
    names: list[str], rng: random.Random
) -> None:
    shuffled = names * 2
    rng.shuffle(shuffled)
    first, second = ToolNameMap(names), ToolNameMap(shuffled)
    assert list(first.items()) == list(second.items())


def test_stock_names_are_readable() -> None:
    names = [tool["name"] for tool in stock_tools()]
    mapping = ToolNameMap(names)
    assert mapping.to_llm("self.audio_speaker.set_volume") == "self_audio_speaker_set_volume"
    assert mapping.to_llm("self.get_device_status") == "self_get_device_status"
    assert mapping.from_llm("self_led_set") == "self.led.set"
    assert list(mapping) == sorted(names)
    assert "self.reboot" in mapping and "self_reboot" not in mapping


def test_valid_name_keeps_itself_and_the_colliding_one_gets_a_hash() -> None:
    mapping = ToolNameMap(["a.b", "a_b"])
    assert mapping.to_llm("a_b") == "a_b"
    assert mapping.to_llm("a.b") == f"a_b_{short_hash('a.b')}"


def test_two_names_colliding_after_replacement_both_get_hashes() -> None:
    mapping = ToolNameMap(["x.y", "x:y"])
    assert mapping.to_llm("x.y") == f"x_y_{short_hash('x.y')}"
    assert mapping.to_llm("x:y") == f"x_y_{short_hash('x:y')}"


def test_long_names_are_cut_to_64_with_a_hash() -> None:
    long_valid = "a" * 200
    long_dotted = "self." + "b" * 195
    mapping = ToolNameMap([long_valid, long_dotted])
    assert mapping.to_llm(long_valid) == "a" * 55 + "_" + short_hash(long_valid)
    assert mapping.to_llm(long_dotted) == ("self_" + "b" * 50) + "_" + short_hash(long_dotted)
    assert len(mapping.to_llm(long_valid)) == len(mapping.to_llm(long_dotted)) == 64
    exactly_64 = "c" * 64
    assert ToolNameMap([exactly_64]).to_llm(exactly_64) == exactly_64


def test_names_without_ascii_letters_get_a_hashed_stem() -> None:
    mapping = ToolNameMap(["温度", "开灯", "", "..."])
    for name in ("温度", "开灯", "", "..."):
        assert mapping.to_llm(name) == f"tool_{short_hash(name)}"
    assert ToolNameMap(["灯.on"]).to_llm("灯.on") == "__on"


def test_constructed_collisions_with_hashed_names_are_still_avoided() -> None:
    digest = hashlib.sha256(b"a.b").hexdigest()
    squatters = ["a_b"] + [f"a_b_{digest[:n]}" for n in (8, 12, 16, 24, 32)]
    mapping = ToolNameMap(["a.b", *squatters])
    assert mapping.to_llm("a.b") == f"a_b_{digest[:8]}_1"
    assert len({mapping.to_llm(name) for name in ["a.b", *squatters]}) == len(squatters) + 1


def test_unknown_names_raise_unknown_tool_name() -> None:
    mapping = ToolNameMap(["self.reboot"])
    with pytest.raises(UnknownToolName):
        mapping.to_llm("self.missing")
    with pytest.raises(UnknownToolName, match=r"self\.reboot"):
        mapping.from_llm("self.reboot")


def test_non_string_names_are_refused() -> None:
    with pytest.raises(TypeError):
        ToolNameMap(["ok", 3])  # type: ignore[list-item]


def test_llm_functions_keep_schemas_and_rewrite_mentions_longest_first() -> None:
    schema = {
        "type": "object",
        "properties": {"on": {"type": "boolean"}},
        "required": ["on"],
        "additionalProperties": False,
    }
    tools = [
        Tool(
            name="self.led.set", description="Switch. See self.led.set_color.", input_schema=schema
        ),
        Tool(name="self.led.set_color", description="Colour; self.led.set turns it on."),
        Tool(
            name="plain", description="Unlike self.led.settings or xself.led.set, use self.led.set."
        ),
    ]
    functions = llm_functions(tools)
    assert functions == [
        {
            "name": "self_led_set",
            "description": "Switch. See self_led_set_color.",
            "parameters": schema,
        },
        {
            "name": "self_led_set_color",
            "description": "Colour; self_led_set turns it on.",
            "parameters": {"type": "object", "properties": {}},
        },
        {
            "name": "plain",
            "description": "Unlike self.led.settings or xself.led.set, use self_led_set.",
            "parameters": {"type": "object", "properties": {}},
        },
    ]
    assert functions[0]["parameters"] is tools[0].input_schema


def test_llm_functions_use_the_given_map_and_skip_duplicates() -> None:
    tools = [Tool(name="温度"), Tool(name="温度", description="again")]
    mapping = ToolNameMap(["温度", "other"])
    functions = llm_functions(tools, mapping)
    assert [f["name"] for f in functions] == [mapping.to_llm("温度")]
    with pytest.raises(UnknownToolName):
        llm_functions([Tool(name="missing")], mapping)


def test_llm_functions_rewrite_cjk_names_in_descriptions() -> None:
    tools = [Tool(name="温度"), Tool(name="x", description="先调用温度再说")]
    functions = llm_functions(tools)
    assert functions[1]["description"] == f"先调用{functions[0]['name']}再说"


def test_longest_name_wins_where_no_boundary_separates_names() -> None:
    # CJK text has no word boundaries, so only longest-first ordering keeps 灯光 whole.
    tools = [Tool(name="灯"), Tool(name="灯光"), Tool(name="x", description="打开灯光，再关灯")]
    functions = llm_functions(tools)
    lamp, light = functions[0]["name"], functions[1]["name"]
    assert functions[2]["description"] == f"打开{light}，再关{lamp}"
