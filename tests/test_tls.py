"""TLS and mutual TLS to ClusterD (issue 7 §5), against the simulator serving TLS.

Certificates are made at test time with the ``openssl`` command line (EC P-256, valid two days):
a CA, a server certificate for 127.0.0.1/localhost, one for another name only, a client
certificate, and a second CA that signed none of them. Every wait is on an event, a log record or
the simulator's state: nothing sleeps to synchronise.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import Events, Trainer, free_port, streams_ready

from nicswitch_agent import AgentConfig, ConfigError, SwitchAgent, SwitchOrder
from nicswitch_agent.clusterd.channel import ChannelSettings, TlsSettings, open_channel
from nicswitch_agent.config import tls_from_env
from nicswitch_agent.observability import events as ev
from nicswitch_agent.ops import doctor
from nicswitch_agent.ops.om import OmClient, OutcomeKind
from nicswitch_agent.ops.om_cli import ExitCode, add_switch_arguments, add_watch_arguments, run_switch, run_watch
from nicswitch_agent.sim import ServerTls, SimJob, SimSettings, Simulator
from nicswitch_agent.sim.cli import add_arguments as add_sim_arguments
from nicswitch_agent.sim.cli import server_tls

pytestmark = pytest.mark.timeout(60)

OPENSSL = shutil.which("openssl")
JOB = "job-tls"
NODES = {"node-0": ["0", "1"], "node-1": ["0", "1"]}
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, shuffle_nodes=False)

# The words users see (see transport.explain_connect_failure).
PLAINTEXT_SERVER = "Is the server plaintext?"
TLS_SERVER = "Is the server TLS?"
NEEDS_CLIENT_CERT = "Does it require a client certificate (mutual TLS)?"
WRONG_CA = "Wrong CA?"


# -- certificates ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str  # SAN 127.0.0.1, localhost
    server_key: str
    named_cert: str  # SAN clusterd.example only
    named_key: str
    client_cert: str
    client_key: str
    other_ca: str  # signed none of the above

    def server(self, *, mutual: bool = False) -> ServerTls:
        return ServerTls(self.server_cert, self.server_key, self.ca if mutual else None)

    def client(self, **overrides: Any) -> dict[str, Any]:
        """Agent settings: trust our CA, present the client certificate."""
        return {"tls_ca_file": self.ca, "tls_cert_file": self.client_cert, "tls_key_file": self.client_key,
                **overrides}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if OPENSSL is None:
        pytest.skip("the openssl command line is not installed")
    where = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")

    def openssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=where, check=True, capture_output=True, timeout=30)

    def ca(name: str) -> None:
        openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
                "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign")

    def leaf(name: str, serial: int, extensions: str) -> None:
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (where / f"{name}.ext").write_text(extensions)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial",
                str(serial), "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")

    ca("ca")
    ca("other-ca")
    leaf("server", 1, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    leaf("named", 2, "subjectAltName=DNS:clusterd.example\nextendedKeyUsage=serverAuth\n")
    leaf("client", 3, "extendedKeyUsage=clientAuth\n")
    p = {name: str(where / name) for name in ("ca.pem", "other-ca.pem", "server.pem", "server.key", "named.pem",
                                               "named.key", "client.pem", "client.key")}
    return Pki(ca=p["ca.pem"], server_cert=p["server.pem"], server_key=p["server.key"], named_cert=p["named.pem"],
               named_key=p["named.key"], client_cert=p["client.pem"], client_key=p["client.key"],
               other_ca=p["other-ca.pem"])


# -- harness -----------------------------------------------------------------------------------------


class LogWaiter(logging.Handler):
    """Sets ``found`` when a record of ``logger`` contains ``needle``."""

    def __init__(self, logger: str, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.found = threading.Event()
        self.messages: list[str] = []
        self.levels: list[int] = []
        self._logger = logging.getLogger(logger)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.needle in message:
            self.messages.append(message)
            self.levels.append(record.levelno)
            self.found.set()

    def __enter__(self) -> LogWaiter:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)


@pytest.fixture
def harness() -> Iterator[Any]:
    sims: list[Simulator] = []
    agents: list[SwitchAgent] = []
    closers: list[Callable[[], None]] = []

    class H:
        def sim(self, tls: ServerTls | None, *, standin: bool = True, port: int = 0) -> Simulator:
            sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=FAST, standin=standin, tls=tls,
                            port=port)
            sims.append(sim)
            sim.start()
            return sim

        def agent(self, sim: Simulator, *, pause: str = "external", **settings: Any) -> tuple[SwitchAgent, Events]:
            seen = Events()
            settings.setdefault("switch_hook", lambda order: True)
            agent = SwitchAgent(server=sim.address, job_id=JOB, pause=pause, on_event=seen,
                                reconnect_initial_s=0.02, reconnect_max_s=0.2, **settings)
            agents.append(agent)
            agent.start()
            return agent, seen

        def adopt(self, agent: SwitchAgent) -> None:
            agents.append(agent)

        def trainer(self, agent: SwitchAgent, step_s: float = 0.002) -> Trainer:
            trainer = Trainer(agent, step_s=step_s).start()
            closers.append(trainer.stop)
            return trainer

    yield H()
    for close in closers:
        close()
    for agent in agents:
        agent.stop()
    for sim in sims:
        sim.stop()


def notify_open(sim: Simulator) -> bool:
    return bool(sim.job_view(JOB).open_streams.get("SubscribeNotifySwitch", 0) >= 1)


NIC_OPS = {"node-0": (["0"], [True])}  # rank 0: one process is a job of one rank


# -- a real switch over TLS --------------------------------------------------------------------------


def test_agent_switches_over_tls_and_the_om_command_too(
    harness: Any, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = harness.sim(pki.server())
    orders: list[SwitchOrder] = []
    agent, _ = harness.agent(sim, tls_ca_file=pki.ca, switch_hook=lambda order: orders.append(order) or True)
    assert agent.config.tls_enabled and agent.config.tls is False  # a CA file alone turns TLS on
    assert sim.wait_idle(JOB, 10) and sim.wait_until(notify_open, 10)
    parser = argparse.ArgumentParser()
    add_switch_arguments(parser)
    args = parser.parse_args(["--server", sim.address, "--job", JOB, "--node", "node-0", "--dev", "0",
                              "--op", "standby", "--tls-ca", pki.ca, "--timeout", "20", "--json"])
    assert run_switch(args, env={}) == ExitCode.OK
    report = json.loads(capsys.readouterr().out)
    assert report["message"] == "switch nic finish" and report["tls"] is True
    assert [(o.ranks, o.ops) for o in orders] == [((0,), (True,))]
    view = sim.job_view(JOB)
    assert view.replies == [True]
    assert view.violations == []
    assert agent.status()["last_error"] == ""


def test_mutual_tls_in_pause_mode_agent(harness: Any, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    sim = harness.sim(pki.server(mutual=True), standin=False)
    agent, _ = harness.agent(sim, pause="agent", **pki.client())
    # Steps of 100 ms, as a small training job's: the switch waits for a step boundary, and one of a
    # few ms could end before switch_and_wait's subscribe reached ClusterD, which keeps no result
    # (CI saw NOT_SWITCHING under load; docs/quickstart.md's demo steps are 100 ms for the same reason).
    harness.trainer(agent, step_s=0.1)
    assert sim.wait_until(lambda s: streams_ready(s, JOB), 10)
    with OmClient(sim.address, tls=TlsSettings(**_tls_args(pki.client()))) as operator:
        outcome = operator.switch_and_wait(JOB, NIC_OPS, timeout_s=20)
    assert outcome.kind is OutcomeKind.FINISHED, outcome
    view = sim.job_view(JOB)
    assert view.replies == [True] and view.violations == []
    assert view.registered
    # The key's path may be logged; its content never is.
    key_body = [line for line in Path(pki.client_key).read_text().splitlines() if not line.startswith("-----")]
    assert key_body and not any(line in caplog.text for line in key_body)
    assert not any(line in json.dumps(agent.status()) for line in key_body)


def _tls_args(settings: dict[str, Any]) -> dict[str, Any]:
    return {"ca_file": settings.get("tls_ca_file"), "cert_file": settings.get("tls_cert_file"),
            "key_file": settings.get("tls_key_file"), "server_name": settings.get("tls_server_name")}


# -- failures, each in plain words ------------------------------------------------------------------


def test_mutual_tls_without_a_client_certificate_is_named(harness: Any, pki: Pki) -> None:
    sim = harness.sim(pki.server(mutual=True))
    agent, seen = harness.agent(sim, tls_ca_file=pki.ca)
    why = seen.first(ev.STREAM_LOST).detail["why"]
    assert NEEDS_CLIENT_CERT in why and "None is configured (tls_cert_file, tls_key_file)" in why, why
    assert agent.status()["last_error"] == why
    assert agent.status()["state"] == "running"  # it keeps waiting for a connection; training is untouched
    assert sim.job_view(JOB).stream_opens.get("SubscribeNotifySwitch", 0) == 0


def test_a_wrong_ca_is_named(harness: Any, pki: Pki) -> None:
    sim = harness.sim(pki.server())
    _, seen = harness.agent(sim, tls_ca_file=pki.other_ca)
    why = seen.first(ev.STREAM_LOST).detail["why"]
    assert WRONG_CA in why and f"not signed by the CA in {pki.other_ca}" in why, why
    assert "CERTIFICATE_VERIFY_FAILED" in why  # gRPC's own words are kept, after ours


def test_tls_agent_against_a_plaintext_server(harness: Any, pki: Pki) -> None:
    sim = harness.sim(None)
    with LogWaiter("nicswitch_agent.subscriber", "cannot connect to ClusterD, waiting for it: ") as waiter:
        agent, seen = harness.agent(sim, tls_ca_file=pki.ca)
        why = seen.first(ev.STREAM_LOST).detail["why"]
        assert waiter.found.wait(10)
    assert why.startswith(f"TLS handshake with {sim.address} failed: it answered in plaintext. {PLAINTEXT_SERVER}")
    assert f"[tls=on, CA {pki.ca}, no client certificate; gRPC: " in why
    assert waiter.messages == [f"cannot connect to ClusterD, waiting for it: {why}"]  # once, not per retry
    assert agent.status()["last_error"] == why


def test_plaintext_agent_against_a_tls_server(harness: Any, pki: Pki) -> None:
    sim = harness.sim(pki.server())
    with LogWaiter("nicswitch_agent.subscriber", "cannot connect to ClusterD, waiting for it: ") as waiter:
        agent, seen = harness.agent(sim)
        why = seen.first(ev.STREAM_LOST).detail["why"]
        assert waiter.found.wait(10)
    assert why.startswith(f"{sim.address} closed the connection before gRPC could start. {TLS_SERVER}"), why
    assert "[tls=off; gRPC: " in why
    assert agent.status()["last_error"] == why


def test_an_agent_started_before_its_tls_server_connects_once_it_is_up(harness: Any, pki: Pki) -> None:
    port = free_port()  # nobody listens on it, yet
    seen = Events()
    waiting = LogWaiter("nicswitch_agent.subscriber", "cannot connect to ClusterD, waiting for it: ")
    with waiting:
        agent = SwitchAgent(server=f"127.0.0.1:{port}", job_id=JOB, pause="external", on_event=seen,
                            switch_hook=lambda order: True, tls_ca_file=pki.ca, reconnect_initial_s=0.02,
                            reconnect_max_s=0.2)
        harness.adopt(agent)
        agent.start()
        assert waiting.found.wait(10)
    assert "Connection refused" in waiting.messages[0]  # not a TLS problem: gRPC's words are kept
    assert waiting.levels[0] == logging.WARNING  # ClusterD not up yet: nothing to fix
    sim = harness.sim(pki.server(), port=port)
    assert sim.wait_idle(JOB, 10) and sim.wait_until(notify_open, 10)
    with OmClient(sim.address, tls=TlsSettings(ca_file=pki.ca)) as operator:
        assert operator.switch_and_wait(JOB, NIC_OPS, timeout_s=20).kind is OutcomeKind.FINISHED
    assert sim.job_view(JOB).replies == [True] and sim.job_view(JOB).violations == []
    assert seen.first(ev.STREAM_RESTORED)


def test_pause_mode_agent_names_the_mismatch_at_once(harness: Any, pki: Pki) -> None:
    """The first Init does not wait for a connection, so the mismatch is named at once (a waiting
    Init would end as a bare deadline), and stays named after the waits that follow run out."""
    sim = harness.sim(pki.server(), standin=False)
    with LogWaiter("nicswitch_agent.process_manage", TLS_SERVER) as waiter:
        agent, _ = harness.agent(sim, pause="agent", rpc_timeout_s=0.3)
        harness.trainer(agent)
        assert waiter.found.wait(10), "no process-manage error naming the mismatch"
    assert "cannot connect to ClusterD, waiting for it" in waiter.messages[0]
    assert waiter.levels[0] == logging.ERROR  # a misconfiguration it can name (a refused port: WARNING)
    assert TLS_SERVER in agent.status()["process_manage"]["last_error"]
    assert TLS_SERVER in agent.status()["last_error"]
    assert not sim.job_view(JOB).registered


# -- server name ---------------------------------------------------------------------------------------


def test_server_name_override_and_doctor_over_tls(harness: Any, pki: Pki) -> None:
    sim = harness.sim(ServerTls(pki.named_cert, pki.named_key), standin=False)
    env = {"NICSWITCH_SERVER": sim.address, "MINDX_TASK_ID": JOB, "NICSWITCH_TLS_CA_FILE": pki.ca}
    wrong = doctor.check_clusterd(doctor.gather_inputs(env=env))
    assert wrong.ok is False
    assert "its certificate does not hold the name '127.0.0.1' (set tls_server_name" in wrong.detail, wrong.detail
    named = doctor.gather_inputs(env={**env, "NICSWITCH_TLS_SERVER_NAME": "clusterd.example"})
    check = doctor.check_clusterd(named)
    assert check.ok is True and "answered HealthCheck over TLS" in check.detail, check.detail
    tls_check = doctor.check_tls(named)
    assert tls_check.ok is True and "server name clusterd.example" in tls_check.detail
    # The --tls-* flags win over NICSWITCH_TLS*.
    flagged = doctor.gather_inputs(env=env, tls_options={"tls_server_name": "clusterd.example"})
    assert doctor.check_clusterd(flagged).ok is True


def test_doctor_names_both_mismatches(harness: Any, pki: Pki) -> None:
    plain = harness.sim(None, standin=False)
    secure = harness.sim(pki.server(), standin=False)
    base = {"MINDX_TASK_ID": JOB}
    to_plain = doctor.check_clusterd(doctor.gather_inputs(
        env={**base, "NICSWITCH_SERVER": plain.address, "NICSWITCH_TLS_CA_FILE": pki.ca}))
    assert to_plain.ok is False and PLAINTEXT_SERVER in to_plain.detail
    assert to_plain.detail.startswith(f"cannot reach ClusterD at {plain.address}: TLS handshake")
    to_secure = doctor.check_clusterd(doctor.gather_inputs(env={**base, "NICSWITCH_SERVER": secure.address}))
    assert to_secure.ok is False and TLS_SERVER in to_secure.detail
    assert doctor.check_tls(doctor.gather_inputs(env=base)).detail.startswith("off: plaintext")
    # TLS on toward the local sidecar, which takes plaintext (found by an outside check: "ok TLS on")
    proxied = doctor.check_tls(doctor.gather_inputs(env={**base, "LOCAL_PROXY_ENABLE": "on",
                                                         "NICSWITCH_TLS_CA_FILE": pki.ca}))
    assert proxied.ok is None and proxied.detail.endswith("which takes plaintext and does the TLS itself: turn TLS "
                                                          "off"), proxied.detail


def test_om_switch_names_the_mismatch(harness: Any, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    sim = harness.sim(pki.server(), standin=False)
    parser = argparse.ArgumentParser()
    add_switch_arguments(parser)
    args = parser.parse_args(["--server", sim.address, "--job", JOB, "--node", "node-1", "--dev", "0",
                              "--op", "standby"])
    assert run_switch(args, env={}) == ExitCode.RPC_ERROR
    err = capsys.readouterr().err
    assert f"cannot reach ClusterD at {sim.address}: UNAVAILABLE: {sim.address} closed the connection" in err
    assert TLS_SERVER in err
    bad = parser.parse_args(["--server", sim.address, "--job", JOB, "--node", "node-1", "--dev", "0",
                             "--op", "standby", "--tls-cert", pki.client_cert])
    assert run_switch(bad, env={}) == ExitCode.USAGE
    assert "tls_cert_file" in capsys.readouterr().err
    watcher = argparse.ArgumentParser()
    add_watch_arguments(watcher)
    assert run_watch(watcher.parse_args(["--server", sim.address, "--job", JOB]), env={}) == ExitCode.RPC_ERROR
    assert TLS_SERVER in capsys.readouterr().err
    assert sim.job_view(JOB).om_messages == []


# -- settings ----------------------------------------------------------------------------------------


def test_tls_settings_are_off_by_default_and_on_with_any_tls_setting(pki: Pki) -> None:
    base = {"server": "127.0.0.1:8899", "job_id": JOB}
    assert AgentConfig(**base).tls_settings() is None
    assert AgentConfig(**base, tls=True).tls_settings() == TlsSettings()
    assert AgentConfig(**base, tls_server_name="clusterd.example").tls_settings() == TlsSettings(
        server_name="clusterd.example")
    cfg = AgentConfig.from_env({"NICSWITCH_TLS_CA_FILE": pki.ca, "NICSWITCH_TLS_CERT_FILE": pki.client_cert,
                                "NICSWITCH_TLS_KEY_FILE": pki.client_key}, **base)
    assert cfg.tls_settings() == TlsSettings(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    assert AgentConfig.from_env({"NICSWITCH_TLS": "on"}, **base).tls is True
    assert tls_from_env({"NICSWITCH_TLS": "0"}) is None
    assert tls_from_env({"NICSWITCH_TLS_CA_FILE": pki.other_ca}, tls_ca_file=pki.ca) == TlsSettings(ca_file=pki.ca)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tls_ca_file": "{missing}"}, "tls_ca_file='{missing}' cannot be read: No such file or directory"),
        ({"tls_cert_file": "{client_cert}"},
         "tls_cert_file='{client_cert}' is set without tls_key_file: a client certificate and its key go together"),
        ({"tls_key_file": "{client_key}"}, "tls_key_file='{client_key}' is set without tls_cert_file"),
        ({"tls_ca_file": "{client_key}"}, "tls_ca_file='{client_key}' holds no usable PEM certificate"),
        ({"tls_cert_file": "{client_cert}", "tls_key_file": "{server_key}"},
         "tls_cert_file='{client_cert}' and tls_key_file='{server_key}' cannot be used together"),
        ({"tls_server_name": "clusterd example"}, "tls_server_name='clusterd example' must be a host name"),
        ({"tls_ca_file": ""}, "tls_ca_file='' must be the path of a PEM file"),
        ({"tls": "yes"}, "tls='yes' must be a bool"),
    ],
)
def test_tls_settings_are_checked_when_the_config_is_built(
    pki: Pki, tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    names = {"missing": str(tmp_path / "nope.pem"), "client_cert": pki.client_cert, "client_key": pki.client_key,
             "server_key": pki.server_key}
    filled = {k: v.format(**names) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ConfigError) as raised:
        AgentConfig(server="127.0.0.1:8899", job_id=JOB, **filled)
    assert message.format(**names) in str(raised.value)
    key_text = Path(pki.client_key).read_text()
    assert key_text.splitlines()[1] not in str(raised.value)


def test_env_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NICSWITCH_TLS='maybe' is not valid for tls"):
        AgentConfig.from_env({"NICSWITCH_TLS": "maybe"}, server="127.0.0.1:8899", job_id=JOB)
    missing = str(tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match=r"tls_ca_file=.* cannot be read"):
        tls_from_env({"NICSWITCH_TLS_CA_FILE": missing})


def test_a_file_that_is_not_pem_is_refused_when_the_channel_opens(tmp_path: Path) -> None:
    der = tmp_path / "ca.der"
    der.write_bytes(b"\x30\x82\x01\x0a")
    with pytest.raises(ConfigError, match="holds no PEM block"):
        open_channel(ChannelSettings(target="127.0.0.1:1", tls=TlsSettings(ca_file=str(der))))


def test_sim_command_line_tls_flags(pki: Pki) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    assert server_tls(parser.parse_args([])) is None
    mutual = server_tls(parser.parse_args(["--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                                           "--tls-client-ca", pki.ca]))
    assert mutual == ServerTls(pki.server_cert, pki.server_key, pki.ca)
    assert mutual.describe() == "mutual TLS (client certificates required)"
    for argv in (["--tls-cert", pki.server_cert], ["--tls-client-ca", pki.ca]):
        with pytest.raises(ValueError):
            server_tls(parser.parse_args(argv))


def test_sim_names_the_tls_flag_and_file_that_cannot_work(pki: Pki, tmp_path: Path) -> None:
    """Found by an outside check: every one of these was "cannot listen on 127.0.0.1:0: Failed to
    bind" (exit 1), after gRPC's own lines, naming neither flag nor file."""
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    missing = str(tmp_path / "nosuch.key")
    cases = [
        (["--tls-cert", pki.server_cert, "--tls-key", pki.client_key],
         f"--tls-cert {pki.server_cert!r} and --tls-key {pki.client_key!r} cannot be used together "
         "(KEY_VALUES_MISMATCH)"),
        (["--tls-cert", pki.server_key, "--tls-key", pki.server_key],
         f"--tls-cert {pki.server_key!r} and --tls-key {pki.server_key!r} cannot be used together"),
        (["--tls-cert", pki.server_cert, "--tls-key", missing], f"--tls-key {missing!r} cannot be read: No such file"),
        (["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.server_key],
         f"--tls-client-ca {pki.server_key!r} holds no usable PEM certificate"),
    ]
    for argv, text in cases:
        with pytest.raises(ValueError) as caught:
            server_tls(parser.parse_args(argv))
        assert str(caught.value).startswith(text), (argv, str(caught.value))


def test_paths_with_underscores_come_through_the_env(pki: Pki, tmp_path: Path) -> None:
    ca = tmp_path / "cluster_ca.pem"
    shutil.copyfile(pki.ca, ca)
    assert tls_from_env({"NICSWITCH_TLS_CA_FILE": str(ca)}) == TlsSettings(ca_file=str(ca))


def test_an_encrypted_key_is_named_as_such_by_the_agent_and_the_simulator(pki: Pki, tmp_path: Path) -> None:
    """Found by an outside check: an encrypted key was refused with reason "SSLError". Both checks
    share config/pem.py; the passphrase is never prompted for (an empty one is tried)."""
    assert OPENSSL is not None
    encrypted = tmp_path / "client-encrypted.key"
    subprocess.run([OPENSSL, "pkey", "-in", pki.client_key, "-out", str(encrypted), "-aes256", "-passout",
                    "pass:secret"], check=True, capture_output=True, timeout=30)
    with pytest.raises(ConfigError) as raised:
        AgentConfig(server="127.0.0.1:8899", job_id=JOB, tls_cert_file=pki.client_cert, tls_key_file=str(encrypted))
    assert f"tls_key_file={str(encrypted)!r} cannot be used together (the key is encrypted)" in str(raised.value)
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    with pytest.raises(ValueError) as caught:
        server_tls(parser.parse_args(["--tls-cert", pki.client_cert, "--tls-key", str(encrypted)]))
    assert f"--tls-key {str(encrypted)!r} cannot be used together (the key is encrypted)" in str(caught.value)
