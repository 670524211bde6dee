"""The addresses a device on the network can use to reach a listener of this machine.

A listener bound to every interface (0.0.0.0 or ::) is reached on loopback from this machine
only: a device needs one of the host's interface addresses, which `serve` prints.
"""

import ipaddress
import socket
from urllib.parse import urlsplit, urlunsplit

import psutil

from backend.common import WILDCARD_HOSTS, url_host


def network_addresses(bind_host: str) -> list[str]:
    """Where a device reaches a listener bound to `bind_host`: the host itself, or for a wildcard
    every interface address that is not loopback or link-local (IPv4 for 0.0.0.0, both for ::),
    interfaces in the system's order."""
    if bind_host not in WILDCARD_HOSTS:
        return [bind_host]
    families = {socket.AF_INET} if bind_host == "0.0.0.0" else {socket.AF_INET, socket.AF_INET6}
    found: list[str] = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in families:
                continue
            ip = ipaddress.ip_address(address.address.split("%", 1)[0])
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
                continue
            if str(ip) not in found:
                found.append(str(ip))
    return found


def urls_for(bind_host: str, local_url: str) -> list[str]:
    """`local_url` (on loopback for a wildcard listener) with each network address instead; the
    URL itself when no address other than loopback exists."""
    parts = urlsplit(local_url)
    hosts = network_addresses(bind_host)
    if not hosts:
        return [local_url]
    urls = []
    for host in hosts:
        urls.append(urlunsplit(parts._replace(netloc=f"{url_host(host)}:{parts.port}")))
    return urls
