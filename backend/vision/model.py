"""The OpenAI-compatible vision model: `POST {base}/v1/chat/completions` with the photo as an
`image_url` content part holding a `data:` URL (OpenAI, vLLM, LM Studio, llama.cpp server,
Ollama's `/v1`)."""

import asyncio
import base64
from typing import Any

import httpx

SYSTEM_PROMPT = (
    "You describe a photo taken by a small voice assistant's camera. Answer the question about "
    "it in two or three short spoken sentences, in the language of the question; no markdown."
)
DEFAULT_QUESTION = "What is in this photo?"
MAX_ANSWER_TOKENS = 300


class VisionFailed(Exception):
    """The model gave no answer; the message says why (for the log, never the device)."""


class VisionModel:
    """A client of an OpenAI-compatible chat endpoint that takes an image (the vision model)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        timeout_s: float,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        self.url = (
            f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"
        )
        self.model = model
        self._timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), headers=headers, transport=transport
        )

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()

    async def describe(self, question: str, image: bytes, media_type: str) -> str:
        """Ask the model the question about the image; its answer as text (raises on failure)."""
        data_url = f"data:{media_type};base64,{base64.b64encode(image).decode('ascii')}"
        body = {
            "model": self.model,
            "max_tokens": MAX_ANSWER_TOKENS,
            "stream": False,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": question or DEFAULT_QUESTION},
                        {"type": "image_url", "image_url": {"url": data_url}},
                    ],
                },
            ],
        }
        try:
            # httpx times each read; this bounds the whole answer (a model trickling bytes).
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.post(self.url, json=body)
        except (httpx.TimeoutException, TimeoutError):
            raise VisionFailed(f"no answer within {self._timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise VisionFailed(f"unreachable ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise VisionFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        try:
            return _answer_text(response.json())
        except ValueError as exc:
            raise VisionFailed(f"unreadable answer: {exc}") from None


def _answer_text(payload: Any) -> str:
    """choices[0].message.content: a string, or a list of text parts."""
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("no choices[0].message.content") from None
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip():
        raise ValueError("empty content")
    return content.strip()
