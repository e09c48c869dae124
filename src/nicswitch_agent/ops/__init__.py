"""Operator tools: the ``nicswitch-agent`` command, the O&M client (switch, watch), ``doctor``, the
status reader and the launcher that hosts a job's leader beside torchrun."""
