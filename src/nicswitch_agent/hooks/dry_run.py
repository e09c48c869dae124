"""DryRunSwitcher: log what would be switched and succeed, so operators can rehearse."""

from __future__ import annotations

import logging

from nicswitch_agent.hooks.base import Switcher
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.hooks")


class DryRunSwitcher(Switcher):
    """Records and logs each order instead of touching any link."""

    def __init__(self) -> None:
        self.orders: list[SwitchOrder] = []

    def __call__(self, order: SwitchOrder) -> bool:
        self.orders.append(order)
        logger.info("dry run: would switch %s", order.summary())
        return True
