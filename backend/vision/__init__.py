"""The bridge's own vision endpoint: camera boards upload a photo, a vision model describes it.

See docs/vision.md. `VisionService` holds the per-device tokens, the limits, the model client and
the audit rows; `backend.vision.http` is its route on the device-facing HTTP listener.
"""

from backend.vision.service import VISION_PATH, VisionService

__all__ = ["VISION_PATH", "VisionService"]
