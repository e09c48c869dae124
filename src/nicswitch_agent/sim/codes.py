"""ClusterD's codes, names and message strings, spelled exactly as the real server spells them.

Everything here is quoted from the reference (``docs/clusterd.md``) or from upstream
``component/clusterd/pkg/domain/common/{code.go,event.go,state.go}`` that those pages cite.
Typos are upstream's ("registed", "swtiching", "HeathCheck") and must stay.
"""

from __future__ import annotations

from typing import Final

# --- Status codes (docs/clusterd.md#status-codes-and-strings, upstream domain/common/code.go) -------------------------
OK: Final = 0
UN_REGISTRY: Final = 400
JOB_NOT_EXIST: Final = 402
PROCESS_RECOVER_ENABLE_OFF: Final = 403
PROCESS_NOT_READY: Final = 404
UN_RECOVERABLE_RETRY_ERROR: Final = 406
UN_INIT: Final = 408
OM_IS_RUNNING: Final = 411
OM_PARAM_INVALID: Final = 413
CLIENT_ERROR: Final = 499  # UnRecoverTrainError / ClientError
OUT_OF_MAX_SERVE_JOBS: Final = 500
OPERATE_POD_GROUP_ERROR: Final = 502
SIGNAL_QUEUE_BUSY: Final = 504
CONTROLLER_EVENT_CANCEL: Final = 506
WAIT_REPORT_TIMEOUT: Final = 507
SERVER_INNER_ERROR: Final = 599

# --- Unary replies (docs/clusterd.md#errors-before-registration, docs/clusterd.md#the-happy-path,
# docs/clusterd.md#failed-switch-and-fault-recovery) ----------------------------
INIT_SUCCESS: Final = "job(uid={job}) init success"
# Init for a job ClusterD cannot find a PodGroup for: upstream getJobBaseInfo's first check
# (fault_recover_service.go) answers 502 OperatePodGroupError with this text. Not observed on
# the wire (the harness always had the PodGroup); docs/clusterd.md#registration-init-and-register documents "502 on
# PodGroup errors".
INIT_NO_POD_GROUP: Final = "job(uid={job}) one of jobName, pgName, ns is empty"
# Init for a job whose PodGroup has process-recover-enable off (and no sub-healthy hot switch):
# getJobBaseInfo answers 403 ProcessRecoverEnableOff, formatting a nil error as "<nil>". Read from
# the source (fault_recover_service.go), not observed on the wire.
INIT_RECOVER_OFF: Final = "job(uid={job}) process-recover-enable and subhealthy hotswtich not open:<nil>"
REGISTER_SUCCESS: Final = "register success"
NOT_INITED: Final = "jobId={job} not inited"
HEALTH_CHECK: Final = "jobId={job}, receive HeathCheck"
NOT_REGISTED: Final = "jobId={job} not registed"
NOT_REGISTED_WAIT_AGENT: Final = "jobId={job} not registed, please wait agent register"
NOT_REGISTED_WORDS: Final = "not registed"  # in both texts above: how a client tells them
NOT_SWITCHING: Final = "jobId={job} is not swtiching nic"
REPLY_SUCCESS: Final = "reply success"
RECEIVED: Final = "jobId={job}, uuid={uuid}, receive {method}"
CHAN_CLOSED: Final = "jobId={job}, uuid={uuid}, chan closed"
DISTRIBUTED: Final = "switching operation was successfully distributed"
OM_RUNNING: Final = "jobId={job} nic is swtiching, or job recovering"

# SwitchNicTrack parameter checks, in upstream order (docs/clusterd.md#switchnictrack-validation, om_service.go
# checkNicsParam).
JOB_NOT_EXIST_MSG: Final = "job:{job} not exist"
JOB_NOT_REGISTERED_MSG: Final = "job:{job} is not registered"
JOB_NOT_RUNNING_MSG: Final = "job:{job} is not running"
NODE_NOT_EXIST_MSG: Final = "node:{node} not exist in job:{job}"
DEV_OP_LENGTH_MSG: Final = "dev and op length is not equal"
DEV_OP_EMPTY_MSG: Final = "dev or op is empty"
DEVICE_NOT_EXIST_MSG: Final = "device:{dev} not exist in node:{node}"
SUPER_POD_MSG: Final = "node:{node} should operate in superPodID"

SIGNAL_TIMEOUT_MSG: Final = "add signal time-out for jobId={job}, program may running in chaos"

# --- SwitchNicResponse messages (docs/clusterd.md#the-operators-result-stream)
# -----------------------------------------------
OM_FINISH: Final = "switch nic finish"
OM_SWITCH_FAILED: Final = "switch nic failed, switch nic failed"
OM_REPORT_ERROR: Final = "switch nic failed, report error when switching nic"
OM_SWITCH_TIMEOUT: Final = "switch nic failed, report switch nic timeout"
OM_PAUSE_FAILED: Final = "om failed, pause train failed"
OM_PAUSE_TIMEOUT: Final = "pause train timeout"
OM_CONTINUE_FAILED: Final = "switch nic failed, continue train failed"
OM_CONTINUE_TIMEOUT: Final = "switch nic failed, continue train timeout"
OM_SEND_FAILED: Final = "send switch nic signal failed, please check manually"
OM_RESULT_TIMEOUT: Final = "report switch nic result timeout, please check manually"

# --- ProcessManageSignal vocabulary (docs/clusterd.md#process-manage-signals) --------------
STOP_TRAIN: Final = "stopTrain"
CHANGE_STRATEGY: Final = "changeStrategy"
KEEP_ALIVE: Final = "keep-alive"
GLOBAL_FAULT: Final = "globalFault"
KILL_MASTER: Final = "killMaster"

PAUSE_TRAIN_ACTION: Final = "pause_train"
STOP_TRAIN_ACTION: Final = "stop_train"
CHANGE_STRATEGY_ACTION: Final = "change_strategy"
ON_GLOBAL_RANK_ACTION: Final = "on_global_rank"
FAULT_NODES_EXIT_ACTION: Final = "fault_nodes_exit"

CONTINUE: Final = "continue"
RETRY: Final = "retry"
RECOVER: Final = "recover"
DUMP: Final = "dump"
EXIT: Final = "exit"
DUMP_EXIT: Final = "dump_exit"
# The strategy names a PodGroup's recover-strategy annotation may list, as far as a NIC switch goes.
STRATEGIES: Final = (RETRY, RECOVER, DUMP, EXIT)

# --- The PodGroup label ``framework`` (podgroup.GetModelFramework; constant.PtFramework/MsFramework)
PYTORCH: Final = "pytorch"
MINDSPORE: Final = "mindspore"
FRAMEWORKS: Final = (PYTORCH, MINDSPORE)

# --- States (upstream domain/common/state.go; names as the real server logs them) --------------
INIT: Final = "INIT"
NOTIFY_PAUSE_TRAIN: Final = "NotifyPauseTrainState"
WAIT_REPORT_PAUSE_COMPLETE: Final = "WaitReportPauseCompleteState"
NOTIFY_SWITCH_NIC: Final = "NotifySwitchNicState"
WAIT_SWITCH_NIC_FINISHED: Final = "WaitSwitchNicFinishedState"
NOTIFY_CONTINUE_TRAIN: Final = "NotifyContinueTrainState"
WAIT_CONTINUE_TRAIN: Final = "WaitContinueTrainState"
NOTIFY_STOP_TRAIN: Final = "NotifyStopTrainState"
WAIT_REPORT_STOP_COMPLETE: Final = "WaitReportStopCompleteState"
WAIT_FAULT_FLUSH_FINISHED: Final = "WaitFaultFlushFinishedState"
NOTIFY_GLOBAL_FAULT: Final = "NotifyGlobalFaultState"
WAIT_REPORT_RECOVER_STRATEGY: Final = "WaitReportRecoverStrategyState"
NOTIFY_DECIDED_STRATEGY: Final = "NotifyDecidedStrategyState"
WAIT_REPORT_STEP_RETRY_STATUS: Final = "WaitReportStepRetryStatusState"
WAIT_REPORT_PROCESS_RECOVER_STATUS: Final = "WaitReportProcessRecoverStatusState"
WAIT_REPORT_DUMP_STATUS: Final = "WaitReportDumpStatusState"
CHECK_RECOVER_RESULT: Final = "CheckRecoverResultState"
KILL_POD_FOR_UNRECOVERABLE_RETRY: Final = "KillPodForUnrecoverableRetryState"
LISTEN_SCHEDULE_RESULT: Final = "ListenScheduleResultState"
NOTIFY_RESTART_ALL_PROCESS: Final = "NotifyRestartAllProcessState"
WAIT_RESTART_ALL_PROCESS: Final = "WaitRestartAllProcessState"
FAULT_CLEAR: Final = "FaultClearState"
FAULT_RETRY: Final = "FaultRetryState"
NOTIFY_KILL_JOB: Final = "NotifyKillJobState"

# --- Events (upstream domain/common/event.go) ---------------------------------------------------
START_SWITCH_NIC: Final = "startSwitchNic"
NOTIFY_SUCCESS: Final = "notifySuccess"
NOTIFY_FAIL: Final = "notifyFail"
NOTIFY_RETRY_SUCCESS: Final = "notifyRetryStrategySuccess"
NOTIFY_RECOVER_SUCCESS: Final = "notifyRecoverStrategySuccess"
NOTIFY_DUMP_SUCCESS: Final = "notifyDumpStrategySuccess"
NOTIFY_EXIT_SUCCESS: Final = "notifyExitStrategySuccess"
NOTIFY_CONTINUE_SUCCESS: Final = "notifyContinueSuccessEvent"
RECEIVE_REPORT: Final = "receiveReport"
RECEIVE_TIMEOUT: Final = "receiveTimeout"
PROCESS_NOT_READY_EVENT: Final = "processNotReadyEvent"
FLUSH_FINISHED: Final = "flushFinished"
SCHEDULE_SUCCESS: Final = "scheduleSuccess"
CLEAR_SUCCESS: Final = "clearSuccess"
RECOVER_SUCCESS: Final = "recoverSuccess"
RECOVER_FAIL: Final = "recoverFail"
UN_RECOVERABLE_RETRY_ERROR_EVENT: Final = "unRecoverableRetryError"
FINISH_KILL_POD: Final = "finishKillPod"
CHECK_FINISH: Final = "checkFinish"
RESTART_FINISH: Final = "restartFinish"
FINISH: Final = "finish"
SWITCH_NIC_RECV_PAUSE: Final = "switchNicRecvPause"
SWITCH_NIC_RECV_CONTINUE: Final = "switchNicRecvContinue"
PROCESS_PAUSE_FAIL: Final = "processPauseFail"
CONTINUE_TRAIN_FAIL: Final = "continueTrainFail"
WAIT_SWITCH_NIC_RECV_FAULT: Final = "waitSwitchNicRecvFault"
SWITCH_NIC_FAIL: Final = "switchNicFail"

# changeStrategy name -> event the process-manage stream adds once the signal is sent
# (upstream controller.go notifyStrategySuccessEventMap / handleSendResult).
STRATEGY_SUCCESS_EVENT: Final[dict[str, str]] = {
    RETRY: NOTIFY_RETRY_SUCCESS,
    RECOVER: NOTIFY_RECOVER_SUCCESS,
    DUMP: NOTIFY_DUMP_SUCCESS,
    EXIT: NOTIFY_EXIT_SUCCESS,
    CONTINUE: NOTIFY_CONTINUE_SUCCESS,
}

# --- Method names as used by introspection --------------------------------------------------------
SUBSCRIBE_PROCESS_MANAGE_SIGNAL: Final = "SubscribeProcessManageSignal"
SUBSCRIBE_NOTIFY_SWITCH: Final = "SubscribeNotifySwitch"
SUBSCRIBE_SWITCH_NIC_SIGNAL: Final = "SubscribeSwitchNicSignal"
STREAM_METHODS: Final = (
    SUBSCRIBE_PROCESS_MANAGE_SIGNAL,
    SUBSCRIBE_NOTIFY_SWITCH,
    SUBSCRIBE_SWITCH_NIC_SIGNAL,
)
REPORT_STOP_COMPLETE: Final = "ReportStopComplete"
REPORT_RECOVER_STRATEGY: Final = "ReportRecoverStrategy"
REPORT_RECOVER_STATUS: Final = "ReportRecoverStatus"

# --- Sizes and limits (docs/clusterd.md#transport-address-and-server-options, upstream main.go initGrpcServer,
# controller.go) ----------
MAX_RECEIVE_BYTES: Final = 4 * 1024 * 1024
MAX_SEND_BYTES: Final = 8 * 1024 * 1024
MAX_CONCURRENT_STREAMS: Final = 64
KEEPALIVE_MIN_TIME_MS: Final = 3000
# grpc-go's maxPingStrikes: GOAWAY on the 3rd strike (see sim/server.py _server_options).
KEEPALIVE_MAX_PING_STRIKES: Final = 2
EVENT_QUEUE_LENGTH: Final = 10  # eventChanLength
OM_QUEUE_LENGTH: Final = 10  # switchNicResponse capacity
KILL_MASTER_ENQUEUE_TIMEOUT_S: Final = 60.0  # handleKillJob: time.After(time.Minute)
