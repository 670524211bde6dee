"""Loopback ports for servers that bind later (another process, or the same one after a restart),
safe when tests run in parallel workers.

Probing a free port (bind to 0, close, hand the number over) leaves a window in which another
worker's socket, a listener or an outgoing connection's local port, can take it. A reserved port
stays bound by a socket that never listens, with SO_REUSEADDR: Linux then gives it to no other
`bind(0)` and no outgoing connection, while a server that also sets SO_REUSEADDR (Mosquitto,
asyncio's and so uvicorn's and websockets' listeners) still binds and listens on it. The
reservation lasts as long as its owner object, so a server restarted on the same port finds it
still free.
"""

import socket
import weakref


def reserve_port(owner: object) -> int:
    """A loopback TCP port that no one else gets while `owner` lives."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    weakref.finalize(owner, holder.close)
    return int(holder.getsockname()[1])
