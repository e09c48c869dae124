"""nicswitch-agent benchmark suite: ``python -m benchmarks`` (``--quick`` for the CI smoke run).

Every number is a ratio or a latency measured side by side in one run; timing never goes into the
tests. docs/performance.md describes the method and records a full run on the reference machine.

Benchmarks (one module each):

- :mod:`benchmarks.idle`: ``agent.step()`` against a bare call; idle CPU and resident memory.
- :mod:`benchmarks.notify`: simulator sends a list -> switch hook starts, against a bare grpcio floor.
- :mod:`benchmarks.resubscribe`: clean end of the notify stream -> the next subscribe arrives.
- :mod:`benchmarks.e2e`: SwitchNicTrack accepted -> "switch nic finish", split into its parts
  (also the coordination time at 16 threads / 8 processes, and the pause alignment at 50 ms steps).
- :mod:`benchmarks.scale`: a 65,536-rank list; the leader's Store round trips per rank.
- :mod:`benchmarks.store_scale`: one switch at 64-16,384 ranks over one real TCPStore (the real
  Coordinator and Members, ranks as threads of node processes): phases, Store requests, bytes, the
  server's CPU and sockets, fitted per rank (``python -m benchmarks.store_scale --sizes ...``).
"""

SCHEMA_VERSION = 1
