"""TLS files checked with Python's ssl before gRPC sees them: gRPC reports a bad file only as a
port it cannot bind (a server) or a handshake that fails (a client), naming neither file.

Each check returns what is wrong, in words, or None; the caller names its own setting or flag
(the agent's ``tls_*`` fields, the simulator's ``--tls-*`` flags). Files are named by path and
never quoted.
"""

from __future__ import annotations

from typing import Any

_ENCRYPTED = (b"ENCRYPTED",)  # "BEGIN ENCRYPTED PRIVATE KEY" (PKCS#8) or "Proc-Type: 4,ENCRYPTED" (PEM)


def unreadable(path: str) -> str | None:
    """Why ``path`` cannot be read, or None."""
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def key_pair_problem(cert_file: str, key_file: str, *, server: bool) -> str | None:
    """Why the certificate and key cannot serve together (not PEM, the key encrypted or of
    another certificate), or None. An encrypted key fails here instead of prompting on the terminal."""
    ssl = _ssl()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except (ssl.SSLError, ValueError) as exc:
        return "the key is encrypted" if _encrypted(key_file) else _reason(exc)
    return None


def ca_problem(ca_file: str, *, server: bool) -> str | None:
    """Why ``ca_file`` holds no usable PEM certificate, or None."""
    ssl = _ssl()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, ValueError) as exc:
        return _reason(exc)
    return None


def _ssl() -> Any:
    import ssl  # only when TLS files are given: ~5 MB resident

    return ssl


def _encrypted(key_file: str) -> bool:
    try:
        with open(key_file, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    return any(mark in head for mark in _ENCRYPTED)


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason) if reason else type(exc).__name__


__all__ = ["ca_problem", "key_pair_problem", "unreadable"]
