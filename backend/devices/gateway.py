"""The bridge's `LinkAcceptor`: every link a transport admits becomes a `DeviceSession`."""

from collections.abc import Callable

from backend.config import Settings
from backend.devices.conversation import ConversationHub
from backend.devices.registry import DeviceRegistry
from backend.devices.session import DeviceSession, timeout_policy
from backend.logs import DeviceBudgets
from backend.transports.base import DeviceLink, LinkHandler


class DeviceGateway:
    """Turns links into sessions; the same for every transport."""

    def __init__(
        self,
        registry: DeviceRegistry,
        hub: ConversationHub,
        settings: Settings,
        vision: Callable[[str], dict[str, str] | None] | None = None,
    ) -> None:
        """`vision` gives a device's `capabilities.vision` for initialize (its own token)."""
        self._registry = registry
        self._hub = hub
        self._settings = settings
        self._timeouts = timeout_policy(settings)
        # Log budgets outlive links: a noisy device gets no fresh burst by reconnecting.
        self._log_budgets = DeviceBudgets(burst=5)
        self._vision = vision

    def open_link(self, link: DeviceLink) -> LinkHandler:
        """Start a `DeviceSession` for a new transport link; the transport feeds it what arrives."""
        session = DeviceSession(
            link,
            self._registry,
            self._hub,
            self._settings,
            self._timeouts,
            self._log_budgets,
            vision=self._vision,
        )
        session.start()
        return session
