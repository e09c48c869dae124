"""The one grammar of a server address: ``parse_server``, for the library, every environment
variable and every subcommand (docs/configuration.md, "Server addresses").

One parser, so that ``AgentConfig(server=...)``, ``NICSWITCH_SERVER``, ``MINDX_SERVER_IP`` and
``--server`` of every subcommand make the same decision and say the same words, led by where the
value came from.
"""

from __future__ import annotations

import ipaddress
import re

from nicswitch_agent.errors import ConfigError

CLUSTERD_PORT = 8899  # ClusterD's gRPC port (its GrpcPort); MindCluster dials MINDX_SERVER_IP at it

# A DNS name (Kubernetes service names included): dot-separated labels of letters, digits, "-" and
# "_" (seen in some internal resolvers), none empty or longer than 63 characters.
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def parse_server(text: str, source: str = "server", *, default_port: int | None = CLUSTERD_PORT) -> str:
    """The one grammar of a ClusterD (or Store) address, for the library, every environment
    variable and every subcommand: the address normalised, or a ConfigError.

    - ``host:port``: the host an IPv4 address, a DNS name, or an IPv6 address in brackets
      (``[fd00::5]:8899``); the port a decimal in 1-65535.
    - A host without a port gets ``default_port`` (ClusterD's 8899: MindCluster itself dials
      ``MINDX_SERVER_IP`` + ``:8899``); with ``default_port=None`` (a Store) the port is required.
    - An IPv6 address without brackets is refused: ``fd00::5:8899`` could be an address, or an
      address and a port.
    - No scheme (``http://``): gRPC dials the address itself. gRPC's ``dns:`` targets are checked
      after the prefix; ``unix:`` ones pass as they are.
    - Spaces around the value are ignored.

    Args:
        text: The address as given.
        source: What to call it in a message: ``server``, ``NICSWITCH_SERVER``, ``--server``...

    Raises:
        ConfigError: ``{source}={text!r}: {problem}``, the problem in the same words wherever the
            address came from.
    """
    try:
        return _normalize_address(text.strip(), default_port)
    except ValueError as exc:
        raise ConfigError(f"{source}={text!r}: {exc}") from None


def _normalize_address(value: str, default_port: int | None) -> str:
    if not value:
        raise ValueError("is empty (give host:port)")
    if value.startswith(("unix:", "unix-abstract:")):
        return value
    prefix, address = "", value
    if value.startswith("dns:"):  # gRPC name syntax: dns:[//authority/]host:port
        rest = value[len("dns:"):]
        if rest.startswith("//"):
            _authority, slash, address = rest[2:].partition("/")
            if not slash:
                raise ValueError("give dns:///host:port (or host:port alone)")
        else:
            address = rest
        prefix = value[:len(value) - len(address)]
    elif "://" in value:
        rest = value.partition("://")[2].rstrip("/")
        try:
            hint = f", e.g. {_normalize_address(rest, default_port)!r}"
        except ValueError:
            hint = ""
        raise ValueError(f"give host:port without a scheme (gRPC dials it directly){hint}")
    return prefix + _host_and_port(address, default_port)


def _host_and_port(address: str, default_port: int | None) -> str:
    port_text: str | None
    if address.startswith("["):
        inner, closed, rest = address[1:].partition("]")
        if not closed:
            raise ValueError("an IPv6 address in brackets needs its closing ']', e.g. [::1]:8899")
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ValueError(f"{inner!r} is not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise ValueError(f"expected ':port' after the address in brackets, not {rest!r}")
        host, port_text = f"[{inner}]", (rest[1:] if rest else None)
    elif address.count(":") > 1:
        raise ValueError(f"put an IPv6 address in brackets, e.g. {_bracketed_example(address, default_port)}")
    else:
        host, colon, after = address.partition(":")
        port_text = after if colon else None
        if not host:
            raise ValueError("the host is missing (give host:port)")
        _check_host(host)
    return f"{host}:{_port(port_text, default_port)}"


def _bracketed_example(address: str, default_port: int | None) -> str:
    """``[fd00::5]:8899`` for ``fd00::5:8899`` (an address and a port), or for ``fd00::5``."""
    head, _, tail = address.rpartition(":")
    for host, port in ((head, tail), (address, str(default_port or CLUSTERD_PORT))):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            continue
        if port.isascii() and port.isdigit():
            return f"[{host}]:{port}"
    return "[addr]:port"


def _port(text: str | None, default_port: int | None) -> int:
    if text is None:
        if default_port is None:
            raise ValueError("the port is missing (give host:port)")
        return default_port
    if not text:
        raise ValueError("the port after ':' is missing")
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"the port {text!r} is not a number")
    if not 0 < int(text) < 65536:
        raise ValueError(f"the port {int(text)} is outside 1-65535")
    return int(text)


def _check_host(host: str) -> None:
    if host.replace(".", "").isdigit():  # looks like IPv4: it has to be one
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
        return
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")  # a trailing dot: fully qualified
    if len(host) > 253 or not all(label.isascii() and _HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{host!r} is not a host name or IP address "
                         "(dot-separated labels of 1-63 letters, digits, '-' or '_', not starting or ending with '-')")


__all__ = ["CLUSTERD_PORT", "parse_server"]
