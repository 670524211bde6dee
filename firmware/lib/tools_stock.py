"""The stock xiaozhi tools (protocol reference §4.6), registered for what the HAL supports.

Names, argument schemas, result texts and order match the stock firmware, so a backend tuned to
stock devices sees the same tool set. Descriptions are our own and kept short to save RAM.
"""

from mcp_server import boolean, integer, string


def register(server, hal):
    """Add the stock tools the HAL supports, in stock order."""
    server.add_tool(
        "self.get_device_status",
        "Current device state (speaker volume, screen, network, chip). Call it before changing "
        "a setting relative to its current value.",
        [],
        lambda args: device_status(hal),
    )
    if hal.has("speaker"):
        server.add_tool(
            "self.audio_speaker.set_volume",
            "Set the speaker volume (0-100). Read the current volume first when asked to turn "
            "it up or down.",
            [integer("volume", minimum=0, maximum=100)],
            lambda args: _set_volume(hal, args),
        )
    if hal.has("backlight"):
        server.add_tool(
            "self.screen.set_brightness",
            "Set the screen brightness (0-100).",
            [integer("brightness", minimum=0, maximum=100)],
            lambda args: _set_brightness(hal, args),
        )
    if hal.has("theme"):
        server.add_tool(
            "self.screen.set_theme",
            'Set the screen theme: "light" or "dark". Returns false for an unknown theme.',
            [string("theme")],
            lambda args: hal.set_theme(args["theme"]),
        )
    if hal.has("led"):
        server.add_tool(
            "self.led.set",
            "Switch the LED on or off, optionally with a brightness (0-100).",
            [boolean("on"), integer("brightness", 100, 0, 100)],
            lambda args: _set_led(hal, args),
        )
    server.add_tool(
        "self.get_system_info",
        "System information of the device (chip, firmware, board, network).",
        [],
        lambda args: hal.system_info(),
        user_only=True,
    )
    server.add_tool(
        "self.reboot",
        "Reboot the device.",
        [],
        lambda args: _reboot(hal),
        user_only=True,
    )


def device_status(hal) -> dict:
    """The get_device_status object: a key only for hardware the device has."""
    status = {}
    if hal.has("speaker"):
        status["audio_speaker"] = {"volume": hal.get_volume()}
    screen = {}
    if hal.has("backlight"):
        screen["brightness"] = hal.get_brightness()
    if hal.has("theme"):
        screen["theme"] = hal.get_theme()
    if screen:
        status["screen"] = screen
    status["network"] = hal.network_status()
    temperature = hal.chip_temperature()
    if temperature is not None:
        status["chip"] = {"temperature": temperature}
    return status


def _set_volume(hal, args) -> bool:
    hal.set_volume(args["volume"])
    return True


def _set_brightness(hal, args) -> bool:
    hal.set_brightness(args["brightness"])
    return True


def _set_led(hal, args) -> bool:
    hal.set_led(args["on"], args["brightness"])
    return True


def _reboot(hal) -> bool:
    # The HAL must defer the real reset (~1 s, like stock) so this reply still goes out.
    hal.reboot()
    return True
