"""Benchmark: a camera board's photo upload to the bridge's vision endpoint, to its answer.

One process: a real `Bridge` (shared device token, its device-facing HTTP listener), the fake
OpenAI-compatible vision model (`testkit.vision_model`, zero latency, in a thread) and the
load, one request at a time, each on a fresh TCP connection as the firmware opens one per photo.

Paths, interleaved in rounds (`bench.common.interleaved`):
- **vision upload**: a 100 KB JPEG sent byte for byte as stock firmware sends it (chunked
  multipart, `testkit.camera_upload`) to `POST /vision/explain`, through the token check, the
  streaming multipart reader and the magic-byte check, then the model call (the photo as a
  base64 `data:` URL in an OpenAI chat request), to the JSON answer;
- **model call alone**: the bridge's `VisionModel.describe` of the same photo (what the model
  round trip costs: base64, JSON, loopback HTTP, the fake's parsing), for the decomposition;
- **baseline**: a plain small POST to the same listener, a stock OTA check (~1 KB of JSON).

The per-device rate limits of uploads and OTA checks are lifted (the bench asks thousands of
times a minute for one device).
"""

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

from bench.common import (
    Plan,
    Stats,
    bench_main,
    interleaved,
    ms,
    quiet_logging,
    running_bridge,
    table,
    verdict,
)
from bench.report import environment
from simulator.stock_ota import stock_headers, system_info
from testkit.camera_upload import fake_jpeg, send_raw, stock_upload
from testkit.vision_model import FakeVisionModel

NAME = "vision"
PHOTO_BYTES = 100 * 1024
DEVICE = "a4:cf:00:00:00:01"
CLIENT = "11111111-0000-4000-8000-000000000001"
QUESTION = "What is in front of me?"
UNLIMITED = {"per_s": 1e6, "burst": 1_000_000}
TARGET_P50_MS = 50.0  # set by this bench (the issue names no target): well under a spoken turn


async def run(quick: bool) -> str:
    quiet_logging()
    plan = Plan(warmup=5, rounds=2, block=10) if quick else Plan(warmup=30, rounds=10, block=50)
    photo = fake_jpeg(PHOTO_BYTES)
    model = FakeVisionModel().start()
    try:
        async with running_bridge(
            vision_base_url=model.url,
            rate_limits={name: UNLIMITED for name in ("vision_device", "ota_device")},
        ) as bridge:
            port = bridge.provisioning.http_port
            url = f"http://127.0.0.1:{port}/vision/explain"
            token = bridge.provisioning.vision.token_for(DEVICE)
            vision_model = bridge.provisioning.vision.model
            assert vision_model is not None
            ota_url = bridge.provisioning.ota_url

            async def upload(_index: int) -> None:
                answer = await stock_upload(
                    url,
                    device_id=DEVICE,
                    client_id=CLIENT,
                    token=token,
                    question=QUESTION,
                    image=photo,
                )
                assert answer.status == 200 and b'"success":true' in answer.body, answer

            async def model_alone(_index: int) -> None:
                await vision_model.describe(QUESTION, photo, "image/jpeg")

            ota_body = _ota_body()
            ota_head = _ota_head(ota_url, len(ota_body))

            async def small_post(_index: int) -> None:
                answer = await send_raw(ota_url, ota_head, _one(ota_body))
                assert answer.status == 200, answer

            paths: dict[str, Callable[[int], Awaitable[None]]] = {
                "vision": upload,
                "model": model_alone,
                "baseline": small_post,
            }
            began = time.perf_counter()
            results = await interleaved(paths, plan)
            elapsed = time.perf_counter() - began
            received = model.requests[-1].image
            assert received == photo, "the model did not get the photo byte for byte"
    finally:
        model.stop()
    stats = {name: result.stats for name, result in results.items()}
    return _report(stats, quick, elapsed)


def _report(stats: dict[str, Stats], quick: bool, elapsed: float) -> str:
    vision, model, baseline = stats["vision"], stats["model"], stats["baseline"]
    own = vision.p50 - model.p50 - baseline.p50
    rows = [
        ["vision upload of a 100 KB JPEG to its answer", vision.count, ms(vision.p50),
         ms(vision.p99), ms(vision.mean)],
        ["model call alone (same photo, zero-latency fake)", model.count, ms(model.p50),
         ms(model.p99), ms(model.mean)],
        ["small POST to the same listener: OTA check (**baseline**)", baseline.count,
         ms(baseline.p50), ms(baseline.p99), ms(baseline.mean)],
    ]  # fmt: skip
    met = vision.p50 / 1e6 <= TARGET_P50_MS
    kind = "quick run (few samples)" if quick else "full run"
    return "\n".join(
        [
            "## Vision upload (bench/vision.py)",
            "",
            f"{environment()}; {kind}, {elapsed:.1f} s. One process: the bridge, the fake vision "
            "model (zero latency, in a thread) and the load, one request at a time, each on a "
            "fresh TCP connection.",
            "",
            table(["path", "samples", "p50 ms", "p99 ms", "mean ms"], rows),
            "",
            f"Upload to answer p50 {ms(vision.p50)} ms = baseline {ms(baseline.p50)} ms + model "
            f"call {ms(model.p50)} ms + {ms(max(own, 0.0))} ms of the endpoint's own (receiving "
            "and parsing 100 KB of chunked multipart, token and magic-byte checks, the audit "
            "row).",
            "",
            f"Target (set by this bench; the issue names none): p50 ≤ {TARGET_P50_MS:.0f} ms "
            f"with a zero-latency model: {verdict(met)}.",
        ]
    )


def _ota_body() -> bytes:
    return json.dumps(system_info(DEVICE, CLIENT), separators=(",", ":")).encode()


def _ota_head(url: str, length: int) -> bytes:
    parts = urlsplit(url)
    headers = {"Host": parts.netloc, **stock_headers(DEVICE, CLIENT), "Content-Length": str(length)}
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"POST {parts.path} HTTP/1.1\r\n{lines}\r\n".encode()


async def _one(body: bytes) -> AsyncIterator[bytes]:
    yield body


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
