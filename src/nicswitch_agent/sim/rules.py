"""The simulated job's transition table, kept apart so it reads like upstream ``rules.go``.

Handlers are named, not imported: :class:`~nicswitch_agent.sim.machine.Machine` looks each one
up on the controller, so this table imports no handler and the handlers can import the machine.
"""

from __future__ import annotations

from nicswitch_agent.sim import codes as P


class TriggerError(Exception):
    """A handler failed the way upstream returns ``err``: ``selectEventChan`` then resets."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# (state, event) -> (next state, handler name). Upstream rules.go getSwitchNicRules, getOMRules,
# getPreRules, getFixRules and getAfterRules, limited to what a NIC switch can reach (no
# scale-in/out, hot switch, recover-in-place, platform mode or stress test).
RULES: dict[tuple[str, str], tuple[str, str]] = {
    # NIC switch (getSwitchNicRules).
    (P.INIT, P.START_SWITCH_NIC): (P.NOTIFY_PAUSE_TRAIN, "_h_notify_pause_train"),
    (P.WAIT_REPORT_PAUSE_COMPLETE, P.SWITCH_NIC_RECV_PAUSE): (P.NOTIFY_SWITCH_NIC, "_h_notify_switch_nic"),
    (P.NOTIFY_SWITCH_NIC, P.NOTIFY_SUCCESS): (P.WAIT_SWITCH_NIC_FINISHED, "_h_wait_switch_nic_finish"),
    (P.NOTIFY_SWITCH_NIC, P.NOTIFY_FAIL): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_SWITCH_NIC_FINISHED, P.RECEIVE_REPORT): (P.NOTIFY_CONTINUE_TRAIN, "_h_notify_continue_train"),
    (P.WAIT_SWITCH_NIC_FINISHED, P.WAIT_SWITCH_NIC_RECV_FAULT): (P.NOTIFY_STOP_TRAIN, "_h_notify_stop_train"),
    (P.WAIT_SWITCH_NIC_FINISHED, P.RECEIVE_TIMEOUT): (P.NOTIFY_STOP_TRAIN, "_h_notify_stop_train"),
    (P.WAIT_SWITCH_NIC_FINISHED, P.SWITCH_NIC_FAIL): (P.NOTIFY_STOP_TRAIN, "_h_notify_stop_train"),
    (P.WAIT_CONTINUE_TRAIN, P.SWITCH_NIC_RECV_CONTINUE): (P.INIT, "_h_switch_nic_finish"),
    # Pause / continue (getOMRules).
    (P.NOTIFY_PAUSE_TRAIN, P.NOTIFY_SUCCESS): (P.WAIT_REPORT_PAUSE_COMPLETE, "_h_wait_pause_complete"),
    (P.NOTIFY_PAUSE_TRAIN, P.NOTIFY_FAIL): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_REPORT_PAUSE_COMPLETE, P.RECEIVE_TIMEOUT): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_REPORT_PAUSE_COMPLETE, P.PROCESS_PAUSE_FAIL): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.NOTIFY_CONTINUE_TRAIN, P.NOTIFY_CONTINUE_SUCCESS): (P.WAIT_CONTINUE_TRAIN, "_h_wait_continue"),
    (P.NOTIFY_CONTINUE_TRAIN, P.NOTIFY_FAIL): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_CONTINUE_TRAIN, P.CONTINUE_TRAIN_FAIL): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_CONTINUE_TRAIN, P.RECEIVE_TIMEOUT): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    # Fault recovery after a failed switch (getPreRules).
    (P.NOTIFY_STOP_TRAIN, P.NOTIFY_SUCCESS): (P.WAIT_REPORT_STOP_COMPLETE, "_h_wait_stop_complete"),
    (P.NOTIFY_STOP_TRAIN, P.NOTIFY_FAIL): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.WAIT_REPORT_STOP_COMPLETE, P.RECEIVE_REPORT): (P.WAIT_FAULT_FLUSH_FINISHED, "_h_wait_flush"),
    (P.WAIT_REPORT_STOP_COMPLETE, P.RECEIVE_TIMEOUT): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.WAIT_REPORT_STOP_COMPLETE, P.PROCESS_NOT_READY_EVENT): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_FAULT_FLUSH_FINISHED, P.FLUSH_FINISHED): (P.NOTIFY_GLOBAL_FAULT, "_h_notify_global_fault"),
    (P.NOTIFY_GLOBAL_FAULT, P.NOTIFY_SUCCESS): (P.WAIT_REPORT_RECOVER_STRATEGY, "_h_wait_strategy"),
    (P.NOTIFY_GLOBAL_FAULT, P.NOTIFY_FAIL): (P.NOTIFY_KILL_JOB, "_h_kill_job"),
    (P.WAIT_REPORT_RECOVER_STRATEGY, P.RECEIVE_REPORT): (P.NOTIFY_DECIDED_STRATEGY, "_h_notify_decided"),
    (P.WAIT_REPORT_RECOVER_STRATEGY, P.RECEIVE_TIMEOUT): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.NOTIFY_DECIDED_STRATEGY, P.NOTIFY_FAIL): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.NOTIFY_DECIDED_STRATEGY, P.NOTIFY_RETRY_SUCCESS): (P.WAIT_REPORT_STEP_RETRY_STATUS, "_h_decide_retry"),
    (P.NOTIFY_DECIDED_STRATEGY, P.NOTIFY_RECOVER_SUCCESS): (
        P.WAIT_REPORT_PROCESS_RECOVER_STATUS,
        "_h_decide_recover",
    ),
    (P.NOTIFY_DECIDED_STRATEGY, P.NOTIFY_DUMP_SUCCESS): (P.WAIT_REPORT_DUMP_STATUS, "_h_decide_dump"),
    (P.NOTIFY_DECIDED_STRATEGY, P.NOTIFY_EXIT_SUCCESS): (P.CHECK_RECOVER_RESULT, "_h_decide_exit"),
    # getFixRules.
    (P.WAIT_REPORT_STEP_RETRY_STATUS, P.RECEIVE_REPORT): (P.CHECK_RECOVER_RESULT, "_h_check_result"),
    (P.WAIT_REPORT_STEP_RETRY_STATUS, P.RECEIVE_TIMEOUT): (P.FAULT_RETRY, "_h_fault_retry"),
    (P.WAIT_REPORT_PROCESS_RECOVER_STATUS, P.RECEIVE_REPORT): (P.CHECK_RECOVER_RESULT, "_h_check_result"),
    (P.WAIT_REPORT_PROCESS_RECOVER_STATUS, P.RECEIVE_TIMEOUT): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.WAIT_REPORT_DUMP_STATUS, P.RECEIVE_REPORT): (P.CHECK_RECOVER_RESULT, "_h_check_result"),
    (P.WAIT_REPORT_DUMP_STATUS, P.RECEIVE_TIMEOUT): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.CHECK_RECOVER_RESULT, P.RECOVER_SUCCESS): (P.INIT, "_h_finish"),
    (P.CHECK_RECOVER_RESULT, P.RECOVER_FAIL): (P.NOTIFY_DECIDED_STRATEGY, "_h_notify_decided"),
    (P.CHECK_RECOVER_RESULT, P.UN_RECOVERABLE_RETRY_ERROR_EVENT): (
        P.KILL_POD_FOR_UNRECOVERABLE_RETRY,
        "_h_kill_pod",
    ),
    (P.CHECK_RECOVER_RESULT, P.CHECK_FINISH): (P.LISTEN_SCHEDULE_RESULT, "_h_listen_schedule"),
    (P.KILL_POD_FOR_UNRECOVERABLE_RETRY, P.FINISH_KILL_POD): (P.NOTIFY_DECIDED_STRATEGY, "_h_notify_decided"),
    # getAfterRules.
    (P.LISTEN_SCHEDULE_RESULT, P.SCHEDULE_SUCCESS): (P.NOTIFY_RESTART_ALL_PROCESS, "_h_restart_all"),
    (P.NOTIFY_RESTART_ALL_PROCESS, P.NOTIFY_SUCCESS): (P.WAIT_RESTART_ALL_PROCESS, "_h_wait_restart_all"),
    (P.WAIT_RESTART_ALL_PROCESS, P.RESTART_FINISH): (P.FAULT_CLEAR, "_h_fault_clear"),
    (P.FAULT_CLEAR, P.CLEAR_SUCCESS): (P.FAULT_RETRY, "_h_fault_retry"),
    (P.FAULT_RETRY, P.FINISH): (P.INIT, "_h_finish"),
    (P.NOTIFY_KILL_JOB, P.FINISH): (P.INIT, "_h_finish"),
}
