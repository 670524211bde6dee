"""The model's answer: up to `max_tool_rounds` rounds of streamed text and tool calls, within
the turn's deadline and the answer's token budget, every call's usage added to the turn's.

When the model cannot answer, the stage says why (`Answer.failure`) and the offline stage
takes over (service.py). `complete` is the one-shot call the guardrail and the summary make.
"""

import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Literal

from backend.chat import prompts
from backend.chat.confirm import PendingConfirmation
from backend.chat.errors import LlmError
from backend.chat.events import ChatEvent, Token, ToolFailed
from backend.chat.llm.base import (
    Completion,
    FunctionSpec,
    LlmProvider,
    Message,
    Sampling,
    StreamEnd,
    TextDelta,
    TokenCount,
    ToolCall,
)
from backend.chat.search import format_results
from backend.chat.tokens import count_prompt, count_tokens, cut_to_tokens
from backend.chat.tool_budget import (
    MAX_TOOL_BYTES_PER_TURN,
    MAX_TOOLS_PER_TURN,
    within_budget,
)
from backend.chat.tool_runs import run_tool
from backend.chat.turn import (
    Answer,
    Context,
    Found,
    ToolRun,
    Turn,
    TurnDeadline,
    log,
    went_offline,
)
from backend.metrics import record_chat_stage


class ModelAnswer:
    """The model stage of a turn; `llm` None: no model (the service never asks this stage)."""

    def __init__(
        self,
        llm: LlmProvider | None,
        *,
        max_tool_rounds: int,
        max_answer_tokens: int,
        max_tools: int = MAX_TOOLS_PER_TURN,
        max_tool_bytes: int = MAX_TOOL_BYTES_PER_TURN,
    ) -> None:
        self.llm = llm
        self.max_tool_rounds = max_tool_rounds
        self.max_answer_tokens = max_answer_tokens
        self.max_tools = max_tools  # functions offered per turn (tool_budget.py)
        self.max_tool_bytes = max_tool_bytes

    async def answer(
        self, turn: Turn, context: Context, found: Found, about_device: bool
    ) -> AsyncIterator[ChatEvent | Answer]:
        """The model's answer, with up to `max_tool_rounds` rounds of tool calls."""
        toolbox = turn.toolbox
        unavailable = toolbox.unavailable_reason if about_device else None
        offered = list(toolbox.functions()) if about_device and unavailable is None else []
        if not offered:  # external MCP servers' tools are not device tools (backend/mcp_servers)
            offered = toolbox.external_functions()
        offered = within_budget(
            offered,
            turn.reading.text,
            max_tools=self.max_tools,
            max_bytes=self.max_tool_bytes,
        )
        user = prompts.user_prompt(
            turn.language,
            turn.query,
            summary=context.summary,
            search_results=format_results(found.results),
            tools_unavailable=unavailable,
        )
        messages = [Message("system", prompts.system_prompt(turn.language, context.instructions))]
        messages += context.history
        messages.append(Message("user", user))
        log.debug("chat prompt", conversation_id=turn.log.conversation_id, prompt=user)

        began = time.perf_counter()
        said: list[str] = []
        runs: list[ToolRun] = []
        rounds = 0
        finish: Literal["stop", "length"] = "stop"
        confirmation: PendingConfirmation | None = None
        failure: str | None = None
        invalid_rounds = 0
        tool_time = 0.0
        try:
            for round_index in range(self.max_tool_rounds + 1):
                tools = offered if round_index < self.max_tool_rounds else []
                if offered and not tools:
                    messages.append(Message("system", prompts.TOO_MANY_ROUNDS_NOTE[turn.language]))
                calls: list[ToolCall] = []
                text: list[str] = []
                first = round_index == 0
                async for item in self._stream_round(turn, messages, tools, said):
                    if first:
                        record_chat_stage("llm_first_token", time.perf_counter() - began)
                        first = False
                    if isinstance(item, StreamEnd):
                        finish = "length" if item.finish_reason == "length" else finish
                    elif isinstance(item, TextDelta):
                        text.append(item.text)
                        said.append(item.text)
                        yield Token(text=item.text)
                    else:
                        calls.append(item)
                if not calls or finish == "length":
                    break
                rounds += 1
                messages.append(Message("assistant", "".join(text), tool_calls=tuple(calls)))
                tools_began = time.perf_counter()
                invalid = False
                for call in calls:
                    async for event, reply, run in self._model_call(turn, call):
                        if event is not None:
                            yield event
                        if reply is not None:
                            messages.append(reply)
                        if run is not None and run.needs_confirmation:
                            confirmation = run.pending(turn.request.device_id)
                        elif run is not None:
                            runs.append(run)
                    invalid = invalid or call.arguments is None
                tool_time += time.perf_counter() - tools_began
                if confirmation is not None:
                    break  # a risky call: the user is asked before anything else happens
                invalid_rounds += invalid
                if invalid_rounds >= 2:
                    text_end = prompts.INVALID_TOOL_CALL_ANSWER[turn.language]
                    said.append(("\n\n" if said else "") + text_end)
                    yield Token(text=said[-1])
                    break
        except TurnDeadline as exc:
            if "".join(said).strip():
                finish = "length"  # the answer so far is the answer, cut
            else:
                failure = went_offline(turn, exc)
        except LlmError as exc:
            failure = went_offline(turn, exc)
            if said:
                said.append("\n\n")
                yield Token(text="\n\n")
        steps = turn.log.steps
        steps["tools"] = round(tool_time * 1000, 3)
        turn.log.step("llm", began, rounds=rounds, offline=failure is not None)
        steps["llm"] = round(steps["llm"] - steps["tools"], 3)
        log.debug("chat answer", conversation_id=turn.log.conversation_id, answer="".join(said))
        yield Answer(tuple(said), tuple(runs), confirmation, rounds, finish, failure)

    async def _model_call(
        self, turn: Turn, call: ToolCall
    ) -> AsyncIterator[tuple[ChatEvent | None, Message | None, ToolRun | None]]:
        """Events for one call the model asked for, the tool message that answers it, and the
        run (none for invalid arguments: those go back to the model unrun)."""
        if call.arguments is None:
            tool = turn.toolbox.device_tool_name(call.name)
            error = call.error or "invalid arguments"
            yield ToolFailed(tool=tool, llm_name=call.name, error=error), None, None
            content = f"error: {error}. Call the function again with a valid JSON object."
            yield None, Message("tool", content, tool_call_id=call.id, name=call.name), None
            return
        async for item in run_tool(turn, call.name, call.arguments):
            if isinstance(item, ToolRun):
                reply = Message("tool", item.outcome.text, tool_call_id=call.id, name=call.name)
                yield None, reply, item
            else:
                yield item, None, None

    async def _stream_round(
        self,
        turn: Turn,
        messages: list[Message],
        tools: Sequence[FunctionSpec],
        said: Sequence[str],
    ) -> AsyncIterator[TextDelta | ToolCall | StreamEnd]:
        """One model round: its text (cut at the answer's token budget, `said` being what the
        turn said so far) and tool calls, within the turn's deadline, its usage added to the
        turn's; last, a `StreamEnd` saying "length" when the answer was cut."""
        assert self.llm is not None
        budget = self._answer_budget(turn, said)
        sampling = with_max_tokens(turn.request.sampling, budget)
        # The model counts with its own tokenizer: the bridge cuts only a server that clearly
        # ignores max_tokens (one that keeps talking), with room for the tokenizers to differ.
        budget += budget // 2 + 8
        model = turn.request.chat_model  # None: the provider's own chat model
        stream = self.llm.stream(messages, model=model, tools=tools, sampling=sampling)
        text: list[str] = []
        calls: list[ToolCall] = []
        used = 0
        end = StreamEnd()
        try:
            while True:
                item = await turn.deadline.run(anext(stream, None))
                if item is None:
                    break
                if isinstance(item, StreamEnd):
                    end = item
                    continue
                if isinstance(item, ToolCall):
                    calls.append(item)
                    yield item
                    continue
                tokens = count_tokens(item.text)
                if used + tokens > budget:  # a server that ignores max_tokens
                    kept = cut_to_tokens(item.text, budget - used)
                    if kept:
                        text.append(kept)
                        yield TextDelta(kept)
                    end = StreamEnd("length", end.usage)
                    break
                used += tokens
                text.append(item.text)
                yield item
        finally:
            if isinstance(stream, AsyncGenerator):
                await stream.aclose()
            reply_text = "".join(text) + "".join(call.raw_arguments for call in calls)
            count_usage(turn, messages, reply_text, end.usage)
        if end.finish_reason == "length" and not calls:
            yield StreamEnd("length", end.usage)

    def _answer_budget(self, turn: Turn, said: Sequence[str]) -> int:
        asked = turn.request.sampling.max_tokens
        cap = self.max_answer_tokens if asked is None else min(asked, self.max_answer_tokens)
        spent = sum(count_tokens(piece) for piece in said)
        return max(1, cap - spent)


async def complete(
    llm: LlmProvider, turn: Turn, messages: list[Message], model: str | None, sampling: Sampling
) -> Completion:
    """One model call without tools (the guardrail's, the summary's), within the turn's
    deadline, its usage added to the turn's."""
    reply = await turn.deadline.run(llm.complete(messages, model=model, sampling=sampling))
    count_usage(turn, messages, reply.text, reply.usage)
    return reply


def count_usage(
    turn: Turn, messages: Sequence[Message], reply: str, reported: TokenCount | None
) -> None:
    """Add a model call's tokens to the turn's: as the model reported them, else counted."""
    usage = turn.usage
    if reported is not None:
        usage.prompt += reported.prompt
        usage.completion += reported.completion
        return
    usage.counted = True
    if not turn.request.count_usage:
        return  # tokenizing every prompt costs ~0.1 ms per KB; only the OpenAI API needs it
    usage.prompt += count_prompt(message.content for message in messages)
    usage.completion += count_tokens(reply)


def with_max_tokens(sampling: Sampling, max_tokens: int) -> Sampling:
    """`sampling` with at most `max_tokens` (a lower limit it already has stands)."""
    if sampling.max_tokens is not None and sampling.max_tokens <= max_tokens:
        return sampling
    return dataclasses.replace(sampling, max_tokens=max_tokens)
