"""``nicswitch-agent demo``: a job on an embedded ClusterD simulator, ranks as threads or processes,
one failover and back (run.py), or against a ClusterD of yours (``--server``)."""

from nicswitch_agent.demo.run import run_demo, run_job

__all__ = ["run_demo", "run_job"]
