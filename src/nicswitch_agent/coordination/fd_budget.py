"""File descriptors on the Store's host: how many the job needs, and clients that say when they ran out.

Every Store client is a socket, so a descriptor, in the process hosting the Store (the launcher,
torchrun's agent, or rank 0). Past its soft ``RLIMIT_NOFILE`` (often 1,024) torch's Store server
drops new connections, and a client retries for its whole timeout (30 min with the job's default
Store) before a bare "Connection reset by peer" (docs/torch-store.md#a-store-host-out-of-file-descriptors).
So the launcher raises its soft limit before hosting, and the agent's clients give up after
``store_connect_timeout_s`` with the likely cause and the fix.
"""

from __future__ import annotations

import datetime
import logging
import resource
import socket
import threading
from typing import Any

from nicswitch_agent.errors import ConfigError

logger = logging.getLogger("nicswitch_agent.coordination")

# A member's connection and the one its stop() wakes it through. With node-local fan-out the job's
# Store holds 2 per node (the relay's) plus one per rank while the ranks start (finding their node's
# Store): 2 per rank stays the bound to plan for.
STORE_SOCKETS_PER_RANK = 2
TORCH_SOCKETS_PER_RANK = 1  # the process group's own connection, when the Store is the job's default one
HOST_MARGIN = 128  # the host's own: listening socket, the leader's connections, gRPC, logs, libraries
UNLIMITED = resource.RLIM_INFINITY
DIAL_GRACE_S = 3.0  # at least this long past store_connect_timeout_s, for torch's own retries to end
PROBE_TIMEOUT_S = 2.0  # the plain TCP connect that tells "nothing listens" from "listens, cannot answer"
_DROPPED = ("reset by peer", "broken pipe", "got 0 bytes", "was likely closed", "end of file")  # torch's words


def per_rank(*, torch_store: bool = False) -> int:  # torch_store: the job's default Store
    return STORE_SOCKETS_PER_RANK + (TORCH_SOCKETS_PER_RANK if torch_store else 0)


def descriptors_needed(world_size: int, *, torch_store: bool = False) -> int:
    return world_size * per_rank(torch_store=torch_store) + HOST_MARGIN


def ranks_within(limit: int, *, torch_store: bool = False) -> int:  # a finite limit
    return max(0, (limit - HOST_MARGIN) // per_rank(torch_store=torch_store))


def nofile_limits() -> tuple[int, int]:  # (soft, hard), UNLIMITED for none
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def show(limit: int) -> str:
    return "unlimited" if limit == UNLIMITED else f"{limit:,}"


def below(limit: int, needed: int) -> bool:
    return limit != UNLIMITED and limit < needed


def how_to_raise(needed: int, hard: int) -> str:
    """What to do about a limit below ``needed``, given the ``hard`` limit that caps the soft one."""
    if not below(hard, needed):
        return (f"raise the soft limit where the Store is hosted: `ulimit -n {needed}` in the shell that starts it "
                "(the hard limit allows it), or run under `nicswitch-agent launch`, which raises its own")
    return (f"the hard limit is too low as well: raise the container's nofile limit to at least {needed} (docker run "
            f"--ulimit nofile={needed}:{needed}; on Kubernetes, the container runtime's default ulimits), then "
            f"`ulimit -n {needed}` where the Store is hosted")


def prepare_store_host(world_size: int) -> None:
    """Raise this process's soft limit to what hosting the Store for ``world_size`` ranks needs;
    ConfigError (naming the limit, the need and the fix) if even the hard limit is too low."""
    soft, hard = nofile_limits()
    needed = descriptors_needed(world_size)
    if not below(soft, needed):
        return
    if below(hard, needed):
        raise ConfigError(
            f"the Store for world_size={world_size} needs {needed:,} file descriptors ({STORE_SOCKETS_PER_RANK} "
            f"per rank + {HOST_MARGIN}), but this process's limit (RLIMIT_NOFILE) is soft {show(soft)}, hard "
            f"{show(hard)}: members would stop connecting after about {ranks_within(hard):,} ranks; "
            + how_to_raise(needed, hard))
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    logger.info("raised the soft file-descriptor limit (RLIMIT_NOFILE) from %s to %s (hard %s): the Store of %d "
                "ranks needs %d per rank + %d", show(soft), show(needed), show(hard), world_size,
                STORE_SOCKETS_PER_RANK, HOST_MARGIN)


def assess(world_size: int | None, *, launcher: bool) -> tuple[bool, str]:
    """``doctor``'s verdict on this process's limits for a Store host of ``world_size`` ranks (hosted by
    the launcher, else the job's default Store): (enough?, in words with what to do)."""
    soft, hard = nofile_limits()
    limits = f"soft {show(soft)}, hard {show(hard)}"
    if world_size is None or world_size < 1:
        room = "any number of" if soft == UNLIMITED else f"about {ranks_within(soft, torch_store=True):,}"
        return True, f"{limits}: a Store host takes {room} ranks; pass --world-size N to check a job"
    needed = descriptors_needed(world_size, torch_store=not launcher)
    host = f"the {'launcher' if launcher else 'job'}'s Store for {world_size:,} ranks needs {needed:,}"
    if not below(soft, needed) or (launcher and not below(hard, needed)):
        return True, f"{limits}: {host}" + (": the launcher raises its soft limit" if below(soft, needed) else "")
    who = "the launcher" if launcher else "the process hosting it (torchrun's agent, or rank 0)"
    room = f"{ranks_within(hard if launcher else soft, torch_store=not launcher):,}"  # the launcher raises soft
    return False, (f"{limits}: {host} ({per_rank(torch_store=not launcher)} per rank + {HOST_MARGIN}), more than "
                   f"{who} may open: agents would stop connecting after about {room} ranks; "
                   + how_to_raise(needed, hard))


def listening(host: str, port: int, timeout_s: float) -> bool | None:
    """Whether a TCP connect to ``host:port`` completes: True (something listens; the kernel accepts
    into the listen backlog even when the process cannot take the connection), False (refused,
    unreachable), None (no answer within ``timeout_s``: a dropped SYN, a full backlog, a firewall)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except TimeoutError:
        return None
    except OSError:
        return False


def explain_store_connect_failure(exc: BaseException | None, host: str, port: int, timeout_s: float,
                                  world_size: int, *, torch_store: bool) -> str:
    """Why a client could not connect to the Store at ``host:port``, in words, with what to do.

    ``exc`` is what torch raised, or None when its connect had not returned by the dial's bound.
    torch says "timed out ... while trying to connect" both when nothing listens (it retries a
    refused connect) and when the host accepted but could not answer (out of descriptors, or slow
    to drop the connection it could not take): a plain TCP connect tells the two apart.
    """
    which = "the job's torch Store" if torch_store else "the Store at store_address"
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc is None:
        text = f"no answer from torch's connect within {dial_bound_s(timeout_s):g} s"
        head = f"cannot connect to {which} ({address}) within store_connect_timeout_s={timeout_s:g} ({text})"
    else:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        head = (f"cannot connect to {which} ({address}) within store_connect_timeout_s={timeout_s:g} "
                f"({type(exc).__name__}: {text})")
    needed = descriptors_needed(world_size, torch_store=torch_store)
    soft, hard = nofile_limits()
    fix = (f"For {world_size:,} ranks it needs about {needed:,}; this process's limit is soft {show(soft)}, hard "
           f"{show(hard)}, and processes started the same way (torchrun's agent, its ranks) usually have the "
           f"same. To fix: " + how_to_raise(needed, hard) + " (docs/operations.md)")
    if any(word in text.lower() for word in _DROPPED):
        return (f"{head}. The Store's host took the connection and dropped it at once: most likely it is out of "
                f"file descriptors (RLIMIT_NOFILE). " + fix)
    if exc is not None and "while trying to connect" not in text and "refused" not in text.lower():
        return head
    reachable = listening(host, port, min(timeout_s, PROBE_TIMEOUT_S))
    if reachable is False:
        return f"{head}: nothing answered there (is the process hosting the Store up, and is the port right?)"
    if reachable is None:
        return (f"{head}: no answer at all (a wrong host, a firewall, or a Store host too busy to accept; is the "
                f"process hosting the Store up?)")
    return (f"{head}. Something listens there but the Store did not answer: most likely its host is out of file "
            f"descriptors (RLIMIT_NOFILE) or too loaded to answer in time (or it is frozen or stopped, or the port "
            f"is not a torch Store's). " + fix)


def dial_bound_s(timeout_s: float) -> float:
    """How long a dial may take before it is given up on: torch's own connect overruns its
    timeout by its last retry's backoff (a 1 s timeout gave up after 1.5-3.9 s, a 5 s one after
    5.3-8.9 s: docs/torch-store.md), so the bound leaves it that much room."""
    return timeout_s + max(DIAL_GRACE_S, timeout_s)


class StoreClient:
    """A TCPStore client that connects within ``timeout_s`` and explains a connection it could not make.

    It connects on first use and :meth:`clone` returns a connected one (as torch's does), so the
    object clones come from costs the Store's host no socket. Other calls are passed through.
    """

    def __init__(self, host: str, port: int, timeout_s: float, world_size: int, *, torch_store: bool = False,
                 connect: bool = False, libuv: bool = False) -> None:
        self.host, self.port, self.timeout_s, self.world_size = host, port, timeout_s, world_size
        self._torch_store = torch_store
        self._libuv = libuv  # ask for torch's libuv client (queues: a legacy client refuses them)
        self._store: Any = None
        if connect:
            self._connected()

    def clone(self) -> StoreClient:
        return StoreClient(self.host, self.port, self.timeout_s, self.world_size, torch_store=self._torch_store,
                           connect=True, libuv=self._libuv)

    def _connected(self) -> Any:
        if self._store is None:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            timeout = datetime.timedelta(seconds=self.timeout_s)
            dialled: list[Any] = []
            failed: list[BaseException] = []

            def dial() -> None:
                try:
                    options = {"use_libuv": True} if self._libuv else {}
                    dialled.append(TCPStore(self.host, self.port, None, False, timeout, wait_for_workers=False,
                                            **options))
                except BaseException as exc:  # handed to the caller below
                    failed.append(exc)

            # torch bounds the connect but not the first exchange after it: a host that accepts and never
            # answers (frozen, stopped, or not a Store) would block start() forever. The dial runs on a
            # thread given up on after the bound; it stays blocked until that host closes the socket.
            dialler = threading.Thread(target=dial, name="nicswitch-store-dial", daemon=True)
            dialler.start()
            dialler.join(dial_bound_s(self.timeout_s))
            if failed and not isinstance(failed[0], RuntimeError):
                raise failed[0]
            if not dialled:
                cause = failed[0] if failed else None
                raise ConfigError(explain_store_connect_failure(cause, self.host, self.port, self.timeout_s,
                                                                self.world_size, torch_store=self._torch_store)) \
                    from cause
            self._store = dialled[0]
        return self._store

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:  # connects on the first call, not on hasattr()
            return getattr(self._connected(), name)(*args, **kwargs)

        return call


def client_of(store: Any, timeout_s: float, world_size: int) -> StoreClient | None:
    """A :class:`StoreClient` of the TCPStore under ``store`` (the job's default Store), else None.
    Its clones connect within ``timeout_s``; torch's ``clone()`` would retry for the process group's
    timeout (30 min by default), which only the shared base store can change."""
    base = getattr(store, "_underlying_non_prefix_store", store)
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    if type(base).__name__ != "TCPStore" or not isinstance(host, str) or not isinstance(port, int):
        return None
    return StoreClient(host, port, timeout_s, world_size, torch_store=True)
