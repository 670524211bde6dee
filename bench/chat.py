"""Benchmark: the chat pipeline's own cost per turn, its throughput, and offline-mode accuracy.

1. Backend overhead per turn: everything but the model and the web search, which are
   zero-latency in-process fakes (`ZeroLlm`, `ZeroSearch`). What is timed is the real
   `ChatService` on a real SQLite database in a temporary folder: language, guardrail, memory
   read, knowledge-base BM25, prompt, the streamed answer, sources, the atomic message pair, the
   summary. Two kinds of turn: a dental question, and a device command that the model answers
   with one tool call on an in-process device running the real firmware tool code.
2. Turns per second one process sustains with the same fakes, with 1 and with 100 concurrent
   conversations.
3. Offline mode (no model at all) on the fixed request set `backend/chat/data/offline_eval.json`
   (Vietnamese and English device commands, dental questions, off-topic requests): the share of
   device commands routed to the right tool with the right arguments, the share of off-topic
   requests refused, the share of dental questions answered. The test suite asserts the same
   shares (`tests/test_chat_offline.py`).
4. Conversations (issue #31): labelled multi-turn sets in `tests/data/` (follow-ups, names,
   greetings, device questions, relative commands, mixed requests, off-topic turns mid-way),
   each conversation through one stored conversation: offline (rules and the knowledge base),
   and with a strict in-process model whose guardrail answers NO to everything it is asked
   (what passes then passed by the conversation rules; its answers say nothing, so only the
   guardrail's decisions are judged). `chat_multiturn_dev.json` was written with the rules;
   the two `heldout` sets were written by someone who had not read the code.
"""

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatService,
    DeviceToolBox,
    InputMessage,
    SearchResult,
    SqliteMemoryStore,
    TurnRequest,
    collect,
)
from backend.chat.evaluation import (
    ConversationReport,
    evaluate_conversations,
    evaluate_offline,
    load_conversation_set,
)
from backend.chat.events import Done
from backend.chat.llm.base import (
    ANY_SAMPLING,
    Completion,
    FunctionSpec,
    Message,
    Sampling,
    StreamEnd,
    StreamItem,
    TextDelta,
    ToolCall,
    Usage,
)
from backend.storage import Database
from bench.common import Stats, bench_main, ms, quiet_logging, table, verdict
from bench.report import environment
from testkit.in_process import FirmwareDevice

NAME = "chat"
TARGET_P50_MS = 5.0
TARGET_SHARE = 0.90
SETS = Path(__file__).resolve().parent.parent / "tests" / "data"
CONVERSATION_SETS = ("chat_multiturn_dev", "chat_multiturn_heldout", "chat_multiturn_heldout2")
# The figures for conversations: follow-ups on topic, off-topic refused, commands.
CONVERSATION_TARGETS = (0.90, 0.95, 0.95)
ANSWER = (
    "Brush twice a day for about two minutes with a fluoride toothpaste, and clean between your "
    "teeth once a day. See your dentist regularly."
)


# ---- in-process parts -------------------------------------------------------------------------


class ZeroLlm:
    """A zero-latency `LlmProvider`: answers at once, with a tool call when asked to."""

    name = "zero"

    def __init__(self, tool_call: tuple[str, dict[str, Any]] | None = None) -> None:
        self.models = Usage(chat="zero-chat", guardrail="zero-guard")
        self.tool_call = tool_call
        self._deltas = [word + " " for word in ANSWER.split(" ")]

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> Completion:
        return Completion("YES" if model == self.models.guardrail else "Summary of the answer.")

    async def stream(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> AsyncIterator[StreamItem]:
        if self.tool_call is not None and tools and messages[-1].role != "tool":
            name, arguments = self.tool_call
            yield ToolCall("call_1", name, arguments, json.dumps(arguments))
            yield StreamEnd("tool_calls")
            return
        for delta in self._deltas:
            yield TextDelta(delta)
        yield StreamEnd("stop")

    async def list_models(self) -> list[str]:
        return [self.models.chat, self.models.guardrail]

    async def aclose(self) -> None:
        pass


class StrictLlm(ZeroLlm):
    """A model whose guardrail refuses everything it is asked (one judging the last line
    alone would refuse every follow-up)."""

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> Completion:
        return Completion("NO" if model == self.models.guardrail else "Summary of the answer.")


class ZeroSearch:
    async def search(self, query: str, n: int) -> list[SearchResult]:
        return [SearchResult(f"Result {i}", ANSWER, f"https://example.org/{i}") for i in range(n)]


@dataclass
class Sample:
    samples_ns: list[int] = field(default_factory=list)


# ---- 1 and 2: overhead and throughput ---------------------------------------------------------


async def _service(data_dir: Path, llm: ZeroLlm | None) -> tuple[ChatService, Database]:
    db = Database(data_dir / "bench.sqlite3", CHAT_MIGRATIONS)
    await db.open()
    return ChatService(SqliteMemoryStore(db), llm, ZeroSearch()), db


async def overhead(turns: int, warmup: int) -> dict[str, Stats]:
    results: dict[str, Stats] = {}
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as folder:
        device = FirmwareDevice()
        cases = {
            "dental": (ZeroLlm(), "How often should I brush my teeth?", None),
            "device": (
                ZeroLlm(("self_audio_speaker_set_volume", {"volume": 40})),
                "Set the volume to 40",
                device,
            ),
        }
        for index, (label, (llm, text, source)) in enumerate(cases.items()):
            service, db = await _service(Path(folder) / str(index), llm)
            samples = []
            for turn in range(warmup + turns):
                toolbox = DeviceToolBox(source) if source is not None else None
                request = TurnRequest(text=text, conversation_id=f"c{turn % 50}")
                began = time.perf_counter_ns()
                events = await collect(service.run_turn(request, toolbox))
                elapsed = time.perf_counter_ns() - began
                assert isinstance(events[-1], Done) and events[-1].metadata.stored, events[-1]
                if turn >= warmup:
                    samples.append(elapsed)
            await db.close()
            results[label] = Stats.of(samples)
        results.update(await _client_history(Path(folder) / "client", turns, warmup))
        http, raw = await _over_http(Path(folder) / "http", turns, warmup)
        results["dental, real HTTP client"] = http
        results["(baseline) the same 2 HTTP requests, raw httpx"] = raw
    return results


NO_HISTORY = "dental, client context, no earlier messages"
WITH_HISTORY = "dental, client context, 50 earlier messages"


async def _client_history(folder: Path, turns: int, warmup: int) -> dict[str, Stats]:
    """The OpenAI-client style of turn (`context="messages"`, nothing stored): the question
    alone, and after 50 earlier messages (a system prompt, 49 user/assistant turns), interleaved
    so that both see the same machine."""
    history = [InputMessage(role="system", content="Answer briefly, in plain words.")]
    for n in range(49):
        role = "user" if n % 2 == 0 else "assistant"
        text = f"Question {n}: how should I care for my gums?" if role == "user" else ANSWER
        history.append(InputMessage(role=role, content=text))
    question = InputMessage(role="user", content="How often should I brush my teeth?")
    service, db = await _service(folder, ZeroLlm())
    samples: dict[str, list[int]] = {NO_HISTORY: [], WITH_HISTORY: []}
    for turn in range(warmup + turns):
        for label, messages in ((NO_HISTORY, [question]), (WITH_HISTORY, [*history, question])):
            request = TurnRequest(messages=messages, context="messages", store=False)
            began = time.perf_counter_ns()
            events = await collect(service.run_turn(request))
            elapsed = time.perf_counter_ns() - began
            assert isinstance(events[-1], Done) and not events[-1].metadata.stored
            if turn >= warmup:
                samples[label].append(elapsed)
    await db.close()
    return {label: Stats.of(values) for label, values in samples.items()}


async def _over_http(folder: Path, turns: int, warmup: int) -> tuple[Stats, Stats]:
    """The dental turn with the real OpenAI-compatible provider (httpx, SSE) against the
    loopback fake LLM of the tests, which runs in a thread of this process (its CPU counts);
    and, interleaved, the same two requests sent with bare httpx (the fake's and the socket's
    share)."""
    import httpx

    from backend.chat.llm import OpenAiProvider
    from testkit.llm_server import FakeLlm, Reply

    fake = FakeLlm().start()
    fake.defaults["chat"] = Reply(ANSWER)
    provider = OpenAiProvider(fake.url, Usage("chat", "guard"), timeout_s=10)
    client = httpx.AsyncClient(timeout=10)
    db = Database(folder / "bench.sqlite3", CHAT_MIGRATIONS)
    await db.open()
    service = ChatService(SqliteMemoryStore(db), provider, ZeroSearch())
    url = f"{fake.url}/v1/chat/completions"
    question = [{"role": "user", "content": "How often should I brush?"}]
    samples: list[int] = []
    raw: list[int] = []
    try:
        for turn in range(warmup + turns):
            request = TurnRequest(text="How often should I brush?", conversation_id=f"h{turn % 50}")
            began = time.perf_counter_ns()
            events = await collect(service.run_turn(request))
            elapsed = time.perf_counter_ns() - began
            assert isinstance(events[-1], Done) and not events[-1].metadata.offline
            began = time.perf_counter_ns()
            body = {"model": "chat", "messages": question, "stream": True}
            async with client.stream("POST", url, json=body) as response:
                async for _line in response.aiter_lines():
                    pass
            summary = {"model": "chat", "messages": question, "stream": False}
            (await client.post(url, json=summary)).json()
            bare = time.perf_counter_ns() - began
            if turn >= warmup:
                samples.append(elapsed)
                raw.append(bare)
            fake.requests.clear()
    finally:
        await client.aclose()
        await provider.aclose()
        await db.close()
        fake.stop()
    return Stats.of(samples), Stats.of(raw)


async def throughput(concurrency: int, total: int) -> float:
    """Turns per second with `concurrency` conversations running at once."""
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as folder:
        service, db = await _service(Path(folder), ZeroLlm())
        per_worker = max(1, total // concurrency)

        async def worker(index: int) -> None:
            for _ in range(per_worker):
                request = TurnRequest(text="How often should I floss?", conversation_id=f"w{index}")
                await collect(service.run_turn(request))

        await worker(-1)  # warm up
        began = time.perf_counter()
        await asyncio.gather(*(worker(index) for index in range(concurrency)))
        elapsed = time.perf_counter() - began
        await db.close()
    return per_worker * concurrency / elapsed


# ---- 3: offline accuracy ----------------------------------------------------------------------


# ---- 4: conversations --------------------------------------------------------------------------


async def conversations() -> list[tuple[str, str, ConversationReport]]:
    """Each set offline and with the strict model."""
    reports = []
    for name in CONVERSATION_SETS:
        path = SETS / f"{name}.json"
        if not path.exists():
            continue
        items = load_conversation_set(path)
        offline = await evaluate_conversations(items, FirmwareDevice)
        strict = await evaluate_conversations(
            items, FirmwareDevice, llm=StrictLlm(), judge="guardrail"
        )
        reports += [(name, "offline", offline), (name, "strict model (guardrail)", strict)]
    return reports


def _conversation_rows(reports: list[tuple[str, str, ConversationReport]]) -> list[list[Any]]:
    rows = []
    for name, mode, report in reports:
        turns = len(report.outcomes)
        rows.append(
            [
                f"`{name}` ({turns} turns)",
                mode,
                _pct(report.follow_ups),
                _pct(report.refused),
                _pct(report.commands),
                _pct(report.share("state")),
                _pct(report.share("social")),
            ]
        )
    return rows


def _conversations_met(reports: list[tuple[str, str, ConversationReport]]) -> bool:
    def meets(pair: tuple[int, int], target: float) -> bool:
        return pair[1] > 0 and pair[0] / pair[1] >= target

    follow, refused, commands = CONVERSATION_TARGETS
    return all(
        meets(r.follow_ups, follow) and meets(r.refused, refused) and meets(r.commands, commands)
        for _name, _mode, r in reports
    )


def _conversation_misses(reports: list[tuple[str, str, ConversationReport]]) -> str:
    lines = []
    for name, mode, report in reports:
        if name == "chat_multiturn_dev" or mode != "offline":
            continue
        for o in report.failures()[:12]:
            said = "refused" if o.refused else f"calls {o.calls}" if o.calls else "answered"
            lines.append(
                f"- {name} #{o.conversation}.{o.index} `{o.item['text']}` "
                f"(expected {o.item['expect']}): {said}"
            )
    return "\n".join(lines) or "- none"


# ---- report -----------------------------------------------------------------------------------


def _pct(pair: tuple[int, int]) -> str:
    good, total = pair
    return f"{good}/{total} = {100 * good / total:.0f} %" if total else "n/a"


def _met(pair: tuple[int, int]) -> bool:
    good, total = pair
    return total > 0 and good / total >= TARGET_SHARE


async def run(quick: bool) -> str:
    quiet_logging()
    turns, warmup = (60, 10) if quick else (2000, 200)
    stats = await overhead(turns, warmup)
    total = 200 if quick else 3000
    single = await throughput(1, total // 3 if not quick else 60)
    many = await throughput(100, total)
    report = await evaluate_offline(FirmwareDevice)
    talks = await conversations()

    rows = [[label, ms(s.p50), ms(s.p99), ms(s.mean), s.count] for label, s in stats.items()]
    met = all(stats[kind].p50 / 1e6 <= TARGET_P50_MS for kind in ("dental", "device"))
    http = stats["dental, real HTTP client"]
    history_cost = stats[WITH_HISTORY].p50 - stats[NO_HISTORY].p50
    raw = stats["(baseline) the same 2 HTTP requests, raw httpx"]
    failures = (
        "\n".join(
            f"- `{o.item['text']}` (expected {o.item['expect']}): "
            f"{'refused' if o.refused else 'passed'}, calls {o.calls}"
            for o in report.failures()
        )
        or "- none"
    )
    quick_note = " — **quick run**" if quick else ""
    return f"""## Chat pipeline (`bench/chat.py`)

{environment()}{quick_note}.

**Backend overhead per turn** — the real `ChatService` with a real SQLite database (temporary
folder, WAL), the bundled knowledge base and real device tool code, but a zero-latency
in-process model and web search: what a turn costs the bridge besides the model and the search.
{turns} sequential turns per kind after {warmup} warm-up turns, 50 conversations in rotation.
"dental": guardrail, memory, search, knowledge base, streamed answer ({len(ANSWER.split())}
deltas), sources, stored pair, model summary. "device": a device command (no search), one tool
call (`self.audio_speaker.set_volume` on the firmware's MCP server, in-process) and a second
model round, stored pair, summary. "dental, real HTTP client": the dental turn with the real
OpenAI-compatible provider (httpx, streamed SSE, then the summary request) against the tests'
loopback fake LLM, which runs in a thread of the benchmark process (so its own CPU is included).
"client context": the turn of an OpenAI client without `chat_id` (its own `messages` are the
context, nothing stored or summarised), with the question alone and after 50 earlier messages
(the six newest sent as they are, the rest summarised), interleaved turn by turn.

{table(["turn", "p50 ms", "p99 ms", "mean ms", "turns"], [[*row] for row in rows])}

50 earlier messages add {ms(history_cost)} ms at p50 (target < 2 ms:
{verdict(history_cost / 1e6 < 2)}).

Target (the in-process rows, i.e. everything but the model and the search): p50 ≤
{TARGET_P50_MS:g} ms: {verdict(met)}. Over real HTTP the turn takes {ms(http.p50)} ms at p50,
of which the same two requests sent with bare httpx to the same fake take {ms(raw.p50)} ms (the
fake server is Python's `http.server`, in a thread of this process, competing for the GIL); the
pipeline plus the provider add {ms(http.p50 - raw.p50)} ms.

**Throughput** (same fakes, one process, one event loop; the SQLite thread serialises writes):
{single:.0f} turns/s with 1 conversation, {many:.0f} turns/s with 100 concurrent conversations.

**Offline mode** (no model, no web; rules and the knowledge base) on the fixed set
`backend/chat/data/offline_eval.json` ({len(report.outcomes)} requests, Vietnamese and English):

{
        table(
            ["measure", "result"],
            [
                [
                    "device commands routed to the right tool with the right arguments",
                    _pct(report.routed),
                ],
                ["off-topic requests refused", _pct(report.refused)],
                [
                    "dental questions answered with sources (not refused, no tool call)",
                    _pct(report.answered),
                ],
            ],
        )
    }

Target ≥ {TARGET_SHARE:.0%} routed and ≥ {TARGET_SHARE:.0%} refused:
{verdict(_met(report.routed) and _met(report.refused))}. Misses:
{failures}

The set was written together with the rules (the word lists were tuned on it), so these shares
are an upper bound: phrasings the word lists do not know (relative changes such as "a bit
louder", numbers in words, other device vocabularies) are not routed, and the assistant asks for
a value instead of guessing.

**Conversations** (each set's conversations one after another, each through one stored
conversation and a fresh simulated device; "follow-ups": dental questions after a
conversation's first turn answered on topic, i.e. not refused, no device call, an answer
holding one of the words the set expects):

{
        table(
            [
                "set",
                "mode",
                "follow-ups on topic",
                "off-topic refused",
                "commands routed",
                "state questions",
                "greetings, thanks",
            ],
            _conversation_rows(talks),
        )
    }

Targets (follow-ups ≥ 90 %, off-topic refused ≥ 95 %, commands ≥ 95 %, every set and mode):
{verdict(_conversations_met(talks))}. With the strict model a command is right when it passes
the guardrail (the model then chooses the tool; its choice is the model's, not measured here).
Misses of the held-out sets, offline (first 12 of each):
{_conversation_misses(talks)}
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
