"""Shared pieces of the speech-recognition tests: speech rendered the same on every run (eSpeak NG
in a fresh process) and the simulated device's functions as the offline router sees them."""

import json
import subprocess
import sys
from pathlib import Path

from backend.chat.llm import FunctionSpec
from backend.chat.offline import with_description_choices
from backend.chat.tools import DeviceToolBox
from testkit.in_process import FirmwareDevice

_ROOT = Path(__file__).resolve().parent.parent
# eSpeak's output for a text depends on everything it synthesized before in the process (its
# pitch flutter runs on across utterances; neither a seed nor re-initializing resets it), so a
# set rendered after other tests' speech differed from run to run ("thirty" heard as "13" in
# one run of three). Rendered in a fresh process, in a fixed order, it is the same every time.
_RENDER_ALL = """
import json, sys
from backend.voice.tts import render
for text, voice in json.loads(sys.stdin.read()):
    pcm = render(text, voice=voice).pcm
    sys.stdout.buffer.write(len(pcm).to_bytes(4, "big") + pcm)
"""


def render_fresh(items: list[tuple[str, str | None]]) -> list[bytes]:
    """16 kHz PCM16 of each (text, eSpeak voice), rendered in a new process in this order:
    the same bytes on every run, whatever this process synthesized before."""
    done = subprocess.run(
        [sys.executable, "-c", _RENDER_ALL],
        input=json.dumps(items).encode(),
        capture_output=True,
        cwd=_ROOT,
        timeout=120,
        check=True,
    )
    out, clips = done.stdout, []
    while out:
        size = int.from_bytes(out[:4], "big")
        clips.append(out[4 : 4 + size])
        out = out[4 + size :]
    assert len(clips) == len(items), done.stderr[-2000:]
    return clips


def device_functions() -> list[FunctionSpec]:
    """The simulated device's tools as the offline router reads them (with their choices)."""
    return [with_description_choices(s) for s in DeviceToolBox(FirmwareDevice()).functions()]
