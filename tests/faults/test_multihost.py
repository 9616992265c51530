"""Two hosts for real: a standalone cluster whose workers live in two network namespaces.

Each namespace is a host of its own (its own loopback, its own address on a bridge), while the
host name still resolves to 127.0.0.1, as on many clusters: gloo then advertises 127.0.0.1 and
ranks on the other host cannot connect, unless the ranks' interface is set. The distributor sets
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` from the address Spark reaches each executor at;
nothing here sets them.

Needs root and ``ip`` (iproute2); one cluster is shared by the three checks.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.ports import free_port
from harness.procs import processes_with_marker, wait_until_gone
from sparktorch_ops.wire.env import RUN_ID_ENV
from tests.support.cluster import cluster_env, spark_home, stop_process_groups
from tests.support.driver import ROOT
from tests.support.records import collecting_logger

pytestmark = pytest.mark.cluster

# Every process this module starts carries the pid of the pytest process that started it, so
# that a later run can tell the leftovers of a crashed one (owner gone) from a live one's.
OWNER_ENV = "SPARKTORCH_OPS_TEST_NETNS_OWNER"
PREFIX = "stomh"  # names: bridge stomh<pid>, namespaces stomh-<pid>-<i>, veths stomh<pid>v<i>
IFNAME = "mh0"  # each host's interface, inside its namespace
SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _kill_owned_processes(doomed: Callable[[int], bool]) -> None:
    """SIGKILL every process this module started (ever) whose owner's pid ``doomed`` accepts."""
    for proc in psutil.process_iter():
        try:
            owner = proc.environ().get(OWNER_ENV)
            if owner is not None and doomed(int(owner)):
                proc.kill()
        except (psutil.Error, ValueError):
            continue


def _clean_leftovers() -> None:
    """Remove what a crashed earlier run left: its processes, namespaces and links."""
    _kill_owned_processes(lambda owner: not psutil.pid_exists(owner))
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+", name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _delete_namespace(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(rf"\d+: ({PREFIX}(\d+)\w*)[@:]", line)
        if match and not psutil.pid_exists(int(match.group(2))):
            _ip("link", "delete", match.group(1), check=False)


def _delete_namespace(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "delete", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.77.x.0/24 that no interface here uses (several runs may share the machine)."""
    used = [
        ipaddress.ip_interface(entry.address + "/32").network
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family == socket.AF_INET
    ]
    for third in [os.getpid() % 200 + 20, *range(20, 250)]:
        net = ipaddress.IPv4Network(f"10.77.{third}.0/24")
        if not any(u.subnet_of(net) for u in used):
            return net
    raise RuntimeError("no free 10.77.x.0/24 subnet")


@dataclass
class Hosts:
    """The bridge (the driver's and master's host) and one namespace per worker host."""

    bridge: str
    bridge_address: str
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def net_inode(self, namespace: str) -> str:
        """The namespace's identity as ``/proc/<pid>/ns/net`` names it."""
        return f"net:[{os.stat(f'/run/netns/{namespace}').st_ino}]"


@contextlib.contextmanager
def network_hosts(count: int) -> Iterator[Hosts]:
    """A bridge with an address in the root namespace and ``count`` namespaces on it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux only")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces and a bridge (ip netns / ip link)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to create network namespaces")
    _clean_leftovers()
    pid = os.getpid()
    net = _free_subnet()
    hosts = Hosts(bridge=f"{PREFIX}{pid}", bridge_address=str(net[1]))
    try:
        probe = _ip("link", "add", hosts.bridge, "type", "bridge", check=False)
        if probe.returncode != 0:
            pytest.skip(f"cannot create a bridge here: {probe.stderr.strip()}")
        _ip("addr", "add", f"{hosts.bridge_address}/24", "dev", hosts.bridge)
        _ip("link", "set", hosts.bridge, "up")
        for index in range(count):
            namespace, address = f"{PREFIX}-{pid}-{index}", str(net[2 + index])
            outer, inner = f"{PREFIX}{pid}v{index}", f"{PREFIX}{pid}p{index}"
            made = _ip("netns", "add", namespace, check=False)
            if made.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
            hosts.namespaces.append(namespace)
            hosts.addresses.append(address)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", namespace)
            _ip("link", "set", outer, "master", hosts.bridge, "up")
            inside = ("netns", "exec", namespace, "ip")
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "link", "set", inner, "name", IFNAME)
            _ip(*inside, "addr", "add", f"{address}/24", "dev", IFNAME)
            _ip(*inside, "link", "set", IFNAME, "up")
        yield hosts
    finally:
        for namespace in hosts.namespaces:
            _delete_namespace(namespace)  # takes its veth pair along
        _ip("link", "delete", hosts.bridge, check=False)


def _daemon_env(local_ip: str) -> dict[str, str]:
    env = cluster_env()
    env.update(SPARK_LOCAL_IP=local_ip, **{OWNER_ENV: str(os.getpid())})
    for name in SOCKET_VARS:
        env.pop(name, None)
    return env


def _wait_for_workers(web_ui: str, workers: int, timeout: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with opener.open(f"{web_ui}/json/", timeout=2) as response:
                state = json.load(response)
            if sum(w.get("state") == "ALIVE" for w in state.get("workers", [])) >= workers:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{workers} Spark workers did not register within {timeout} s")


@dataclass
class TwoHostCluster:
    """A master on the bridge address, one 1-core worker in each namespace."""

    hosts: Hosts
    master_url: str
    workdir: Path


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHostCluster]:
    """The cluster for this module, torn down (processes, namespaces, bridge) even on failure."""
    workdir = tmp_path_factory.mktemp("two-hosts")
    (workdir / "logs").mkdir()
    spark_class = os.path.join(spark_home(), "bin", "spark-class")
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, prefix: list[str], args: list[str], local_ip: str) -> None:
        log = open(workdir / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - the daemon's
        processes.append(
            subprocess.Popen(
                [*prefix, spark_class, *args],
                env=_daemon_env(local_ip),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    with network_hosts(2) as hosts:
        try:
            port, ui_port = free_port(), free_port()
            master_url = f"spark://{hosts.bridge_address}:{port}"
            spawn(
                "master",
                [],
                [
                    "org.apache.spark.deploy.master.Master",
                    *("--host", hosts.bridge_address, "--port", str(port)),
                    *("--webui-port", str(ui_port)),
                ],
                hosts.bridge_address,
            )
            for index, (namespace, address) in enumerate(
                zip(hosts.namespaces, hosts.addresses, strict=True)
            ):
                spawn(
                    f"worker{index}",
                    ["ip", "netns", "exec", namespace],
                    [
                        "org.apache.spark.deploy.worker.Worker",
                        master_url,
                        *("--host", address, "--cores", "1", "--memory", "2g"),
                        *("--webui-port", str(free_port())),
                        *("--work-dir", str(workdir / f"work{index}")),
                    ],
                    address,
                )
            _wait_for_workers(f"http://{hosts.bridge_address}:{ui_port}", 2, timeout=120)
            yield TwoHostCluster(hosts, master_url, workdir)
        finally:
            stop_process_groups(processes)
            _kill_owned_processes(lambda owner: owner == os.getpid())


PROGRAM = """
import json, os, socket, sys, threading, time
from pathlib import Path

sys.path.insert(0, {root!r})
from pyspark.sql import SparkSession
from sparktorch_ops import TorchDistributor, TrainingFailedError
from tests.faults.training import long_training

spark = (SparkSession.builder.master({master!r})
         .config("spark.driver.host", {driver!r}).config("spark.driver.bindAddress", {driver!r})
         .config("spark.executor.memory", "1g").config("spark.ui.enabled", "false")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

def own_address():
    # This host's interface and address, read from the machine (not from sparktorch_ops).
    import psutil
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                return name, entry.address
    return None, None

def distributor():
    return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark,
                            start_timeout=120, timeout=150)

def all_reduce():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    name, address = own_address()
    me = dict(rank=rank, sum=total.item(), interface=name, address=address,
              host=socket.gethostname(), resolved=socket.gethostbyname(socket.gethostname()),
              gloo=os.environ.get("GLOO_SOCKET_IFNAME"), nccl=os.environ.get("NCCL_SOCKET_IFNAME"))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    dist.destroy_process_group()
    return dict(rank=rank, ranks=everyone)

def rank1_fails(marker):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        Path(marker).write_text(own_address()[1])
        raise RuntimeError("rank 1 failed on purpose")
    time.sleep(300)

# (a) and (b)
out = {{}}
started = time.monotonic()
try:
    out["value"] = distributor().run(all_reduce)
except Exception as exc:
    out["error"] = f"{{type(exc).__name__}}: {{exc}}"[-3000:]
out["all_reduce_s"] = time.monotonic() - started

started = time.monotonic()
marker = Path({tmp!r}) / "rank1_address"
try:
    distributor().run(rank1_fails, str(marker))
    out["failure"] = None
except TrainingFailedError as exc:
    first = exc.first_failure
    out["failure"] = dict(message=str(exc), rank=first.rank, host=first.host,
                          address=marker.read_text() if marker.exists() else None)
except Exception as exc:
    out["failure"] = dict(other=f"{{type(exc).__name__}}: {{exc}}"[-3000:])
out["failure_s"] = time.monotonic() - started
print({result!r} + json.dumps(out), flush=True)

# (c) a long run, until the test kills this process
ready = Path({tmp!r}) / "ready"
ready.mkdir()
threading.Thread(target=lambda: distributor().run(long_training, str(ready)), daemon=True).start()
while not all((ready / f"rank{{r}}.pid").exists() for r in (0, 1)):
    time.sleep(0.1)
print({ready!r}, flush=True)
time.sleep(600)
"""
RESULT = "RESULT_JSON:"
RANKS_READY = "RANKS_READY"


@dataclass
class DriverProgram:
    """One driver process for the three checks (a SparkContext per process, started once)."""

    proc: subprocess.Popen[bytes]
    log: Path
    workdir: Path
    result: dict[str, Any] | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The rest of the first output line starting with ``prefix``, once there."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.output().splitlines():
                if line.startswith(prefix):
                    return line[len(prefix) :]
            code = self.proc.poll()
            assert code is None, f"driver exited {code}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, (
                f"no {prefix} in {timeout} s:\n{self.output()[-4000:]}"
            )
            time.sleep(0.2)

    def checks(self) -> dict[str, Any]:
        """What the program emitted after (a) and (b)."""
        if self.result is None:
            self.result = json.loads(self.wait_for(RESULT, timeout=400))
        return self.result


@pytest.fixture(scope="module")
def driver(two_hosts: TwoHostCluster) -> Iterator[DriverProgram]:
    """The driver program on the bridge address; no GLOO/NCCL variable set anywhere."""
    for name in SOCKET_VARS:
        assert name not in os.environ, f"{name} is set in the test's environment"
    hosts, workdir = two_hosts.hosts, two_hosts.workdir
    script = workdir / "driver_program.py"
    script.write_text(
        PROGRAM.format(
            root=str(ROOT),
            master=two_hosts.master_url,
            driver=hosts.bridge_address,
            tmp=str(workdir),
            result=RESULT,
            ready=RANKS_READY,
        )
    )
    env = _daemon_env(hosts.bridge_address)
    log_path = workdir / "logs" / "driver.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield DriverProgram(proc, log_path, workdir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # with its JVM
        proc.wait(10)


def test_all_reduce_across_two_hosts_returns_rank0s_value(
    two_hosts: TwoHostCluster, driver: DriverProgram
) -> None:
    result = driver.checks()
    assert "value" in result, result.get("error")
    value = result["value"]
    assert value["rank"] == 0
    ranks = value["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["sum"] == 3.0 for r in ranks), ranks
    # One rank on each host.
    assert sorted(r["address"] for r in ranks) == sorted(two_hosts.hosts.addresses), ranks
    # What the distributor set: the interface holding the address Spark knows the host by.
    assert all((r["gloo"], r["nccl"]) == (IFNAME, f"={IFNAME}") for r in ranks), ranks
    # The case this guards against: here the host name resolves to loopback on every host.
    print(f"all-reduce run {result['all_reduce_s']:.1f} s; ranks: {ranks}")


def test_a_failing_rank_names_its_host(two_hosts: TwoHostCluster, driver: DriverProgram) -> None:
    result = driver.checks()
    failure = result["failure"]
    assert failure and "message" in failure, failure
    assert failure["rank"] == 1, failure["message"]
    assert failure["address"] in two_hosts.hosts.addresses, failure
    assert failure["host"] == failure["address"], failure
    assert f"host {failure['address']}" in failure["message"], failure["message"]
    assert "rank 1 failed on purpose" in failure["message"]
    print(f"failing run {result['failure_s']:.1f} s")


def _net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_killed_driver_leaves_nothing_on_either_host(
    two_hosts: TwoHostCluster, driver: DriverProgram
) -> None:
    hosts = two_hosts.hosts
    driver.wait_for(RANKS_READY, timeout=400)
    ready = driver.workdir / "ready"
    pids = [int((ready / f"rank{r}.pid").read_text()) for r in (0, 1)]
    run_id = psutil.Process(pids[0]).environ()[RUN_ID_ENV]
    # One rank on each host, and the run's agents there too.
    expected = {hosts.net_inode(namespace) for namespace in hosts.namespaces}
    assert {_net_namespace(pid) for pid in pids} == expected
    marked = processes_with_marker(run_id)
    assert {_net_namespace(p.pid) for p in marked} == expected
    assert any("sparktorch_ops.node.agent" in " ".join(p.cmdline()) for p in marked)

    time.sleep(1.0)  # the ranks are in their loop of barriers and sleeps
    started = time.monotonic()
    os.kill(driver.proc.pid, signal.SIGKILL)
    driver.proc.wait(10)
    left = wait_until_gone(run_id, timeout=30)
    seconds = time.monotonic() - started
    assert left == [], [(p.pid, _net_namespace(p.pid), p.cmdline()[:4]) for p in left]
    print(f"{len(marked)} processes of the run gone {seconds:.1f} s after the SIGKILL")


def connect_all_reduce() -> dict[str, Any]:
    """Rank code over Connect: the all-reduced sum and the address this rank's host has."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    addresses = [
        entry.address
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family == socket.AF_INET and not entry.address.startswith("127.")
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"sum": total.item(), "addresses": addresses})
    dist.destroy_process_group()
    return {"ranks": everyone}


def test_over_connect_a_host_that_cannot_reach_the_client_makes_the_tasks_agree_in_the_stage(
    two_hosts: TwoHostCluster, tmp_path: Path
) -> None:
    # Runs after the driver program is gone (its application held every core). One host
    # reaches the client's channel, the other does not (a blackhole route): the task there
    # relays its ranks' frames and agrees with the other task in the stage; the reaching task
    # tells the client it arrived and waits, until the client, never hearing from the other,
    # tells it to agree in the stage too. Each host in turn is the one cut off, so that task 0
    # (which hosts the store and knows its port) is the reaching one in one of the runs.
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from sparktorch_ops import TorchDistributor
    from tests.support.connect_server import running_connect_server

    hosts = two_hosts.hosts
    advertised = str(ipaddress.ip_address(hosts.bridge_address) + 200)
    _ip("addr", "add", f"{advertised}/32", "dev", hosts.bridge)
    conf = {
        "spark.driver.host": hosts.bridge_address,
        "spark.driver.bindAddress": hosts.bridge_address,
        "spark.executor.memory": "1g",
        "spark.ui.enabled": "false",
    }
    relayed: dict[str, list[str]] = {}
    try:
        with running_connect_server(tmp_path, two_hosts.master_url, conf) as server:
            session = ConnectSession.builder.remote(server.url).getOrCreate()
            try:
                for namespace in reversed(hosts.namespaces):
                    route = ("netns", "exec", namespace, "ip", "route")
                    _ip(*route, "add", "blackhole", f"{advertised}/32")
                    logger, collect = collecting_logger("tests.multihost.connect")
                    try:
                        result = TorchDistributor(
                            num_processes=2,
                            local_mode=False,
                            use_gpu=False,
                            spark=session,
                            channel_host=advertised,
                            start_timeout=120,
                            timeout=150,
                            logger=logger,
                        ).launch(connect_all_reduce)
                    finally:
                        _ip(*route, "del", "blackhole", f"{advertised}/32", check=False)
                    ranks = result.value["ranks"]
                    assert [r["sum"] for r in ranks] == [3.0, 3.0]
                    on_hosts = sorted(
                        a for r in ranks for a in r["addresses"] if a in hosts.addresses
                    )
                    assert on_hosts == sorted(hosts.addresses)  # one rank on each host
                    relayed[namespace] = [m for m in collect.messages() if "could not reach" in m]
            finally:
                session.stop()
    finally:
        _ip("addr", "del", f"{advertised}/32", "dev", hosts.bridge, check=False)
    for warnings in relayed.values():  # one task relayed in each run
        assert len(warnings) == 1, relayed
        assert re.search(r"barrier task\(s\) [01] could not reach", warnings[0]), warnings
    tasks = {ns: re.findall(r"task\(s\) (\d)", w[0]) for ns, w in relayed.items()}
    print(f"the task that relayed, by host cut off: {tasks}")
