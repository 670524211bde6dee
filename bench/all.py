"""Run every benchmark in sequence, each in a fresh process: `python -m bench.all [--quick]`."""

import subprocess
import sys

from bench.common import REPO, parse_args

# The bridge-core benchmarks, the UDP audio channel, the MQTT transport end to end and its
# reconnect loop, the OTA endpoint, reliability under attack (WebSocket and MQTT), fuzzing, the
# voice loop and speech recognition, the console pages (the talk page with the embedded voice
# stack), then the firmware's heap benchmark (needs the MicroPython unix port).
BENCHMARKS = (
    "tool_call",
    "metrics_overhead",
    "sdk_compare",
    "hello_ready",
    "fleet",
    "disconnect",
    "chat",
    "udp",
    "reliability",
    "reliability_device_http",
    "reliability_admin",
    "reliability_mcp_servers",
    "fuzz",
    "mqtt",
    "mqtt_churn",
    "ota",
    "vision",
    "mcp_servers",
    "mcp_dialin",
    "voice",
    "voice_recognition",
    "console_page",
    "console_devices",
    "console_talk",
    "db_writes",
    "cluster",
    "cluster_outage",
    "firmware_memory",
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "all benchmarks", argv)
    extra = ["--quick"] if args.quick else []
    failed = []
    for name in BENCHMARKS:
        print(f"\n==> python -m bench.{name} {' '.join(extra)}".rstrip(), flush=True)
        done = subprocess.run([sys.executable, "-m", f"bench.{name}", *extra], cwd=REPO)
        if done.returncode != 0:
            failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
