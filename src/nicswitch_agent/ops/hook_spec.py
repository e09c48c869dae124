"""A switch hook named on a command line: ``module:callable`` (``nicswitch-agent doctor --switch-hook``).

The grammar of Python entry points: ``package.module:attribute``, the attribute possibly dotted
(``pkg.hooks:Switchers.rdma``). The module is imported and the attribute looked up; a class is
instantiated without arguments, as a training script writes ``switch_hook=MySwitcher()``. Then
what the agent checks at ``start()`` is checked here too: the hook can be called with one
argument (the order), and its own ``check()``, when it has one, passes (the default hook's looks
for torch_npu's switch function). The hook itself is never called.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from nicswitch_agent.hooks.base import check_hook, require_callable

FLAG = "--switch-hook"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--switch-hook MODULE:CALLABLE`` (``doctor``'s)."""
    parser.add_argument(FLAG, metavar="MODULE:CALLABLE", help="the job's own switch hook, checked instead of "
                        "torch_npu's as the agent would at start (a class is built without arguments)")


def load_hook(spec: str) -> Any:
    """The object ``spec`` (``module:attribute``) names; a class is instantiated without arguments.

    Raises:
        ValueError: naming the flag, the spec and what is wrong with it.
    """
    module_name, sep, attribute = spec.strip().partition(":")
    if not sep or not module_name or not attribute or any(not part for part in attribute.split(".")):
        raise ValueError(f"{FLAG} {spec!r} is not module:callable (e.g. mypkg.hooks:switch_links)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python train.py` in this directory would find the module
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the module raises while it loads
        raise ValueError(f"{FLAG} {spec}: cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    for depth, part in enumerate(attribute.split(".")):
        try:
            target = getattr(target, part)
        except AttributeError:
            where = ".".join([module_name, *attribute.split(".")[:depth]])
            raise ValueError(f"{FLAG} {spec}: {where} has no attribute {part!r}") from None
    if isinstance(target, type):
        try:
            target = target()
        except Exception as exc:
            raise ValueError(f"{FLAG} {spec}: {target.__name__}() failed ({type(exc).__name__}: {exc}); the "
                             "doctor builds a class without arguments, name an instance instead") from None
    return target


def check_switch_hook(spec: str) -> tuple[bool, str]:
    """(ok, what was found) for the hook ``spec`` names, as the agent's ``start()`` would judge it."""
    try:
        hook = load_hook(spec)
        require_callable(f"{FLAG} {spec}", hook, "one argument (the order)")
    except ValueError as exc:  # ConfigError included
        return False, str(exc)
    try:
        check_hook(hook)
    except Exception as exc:  # the hook's own readiness check: the agent would refuse to start
        return False, f"{spec}: its check() failed, so the agent would not start: {type(exc).__name__}: {exc}"
    checked = " and its check() passed" if callable(getattr(hook, "check", None)) else ""
    return True, f"{spec} can be called with the order{checked}"


__all__ = ["FLAG", "add_argument", "check_switch_hook", "load_hook"]
