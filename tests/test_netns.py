"""A 2-node job across two network namespaces, each with its own address: a real network hop between "hosts".

Each worker runs in a namespace of its own (`ip netns exec`), joined to the other by veth pairs on a bridge;
it reaches PostgreSQL and Redis through forwarders on the bridge's address, and advertises its namespace's
address, where node 0 hosts the c10d rendezvous. Skipped, with the reason, where namespaces are not allowed.
"""

import os
import socket
import subprocess
import sys
import threading
from urllib.parse import urlparse

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url

from service.jobs.models import JobEvent
from tests.conftest import POSTGRES_URL, REDIS_URL, mlp_spec
from tests.helpers import live_stack, wait_for, wait_terminal

TAG = f"tj{os.getpid() % 100000}"
BRIDGE, SUBNET = f"{TAG}br", "10.213.77"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def namespaces_allowed() -> str | None:
    """None where this process may make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        ip("netns", "add", f"{TAG}probe")
        ip("netns", "del", f"{TAG}probe")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` is not allowed here: {getattr(exc, 'stderr', b'') or exc}"
    return None


class Forward:
    """A TCP forwarder from the bridge's address to a service that listens on loopback only."""

    def __init__(self, listen_host: str, target: tuple[str, int]):
        self.server = socket.create_server((listen_host, 0))
        self.port, self.target = self.server.getsockname()[1], target
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def network():
    reason = namespaces_allowed()
    if reason:
        pytest.skip(reason)
    ip("link", "add", BRIDGE, "type", "bridge")
    try:
        ip("addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        nodes = []
        for i in (1, 2):
            ns, host_end, ns_end = f"{TAG}n{i}", f"{TAG}h{i}", f"{TAG}v{i}"
            ip("netns", "add", ns)
            ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            ip("link", "set", ns_end, "netns", ns)
            ip("link", "set", host_end, "master", BRIDGE)
            ip("link", "set", host_end, "up")
            ip("netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{i}/24", "dev", ns_end)
            ip("netns", "exec", ns, "ip", "link", "set", ns_end, "up")
            ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            nodes.append((ns, ns_end, f"{SUBNET}.{i}"))
        yield nodes
    finally:
        for i in (1, 2):
            subprocess.run(["ip", "netns", "del", f"{TAG}n{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def test_a_two_node_job_runs_across_two_network_namespaces(network, postgres_url, tmp_path):
    pg, rd = make_url(POSTGRES_URL), urlparse(REDIS_URL)
    auth = f"{rd.username or ''}:{rd.password}@" if rd.password else ""  # the tests' Redis asks for one
    forwards = [Forward(f"{SUBNET}.254", (pg.host, pg.port or 5432)),
                Forward(f"{SUBNET}.254", (rd.hostname, rd.port or 6379))]
    try:
        with live_stack(postgres_url, tmp_path, name="netns", workers=0, lease_s=4, heartbeat_s=0.5,
                        sweep_s=0.5) as stack, stack.client(timeout=10) as api:
            for ns, ifname, _address in network:  # each worker finds its address: the route to Redis
                env = {**stack.env(), "GLOO_SOCKET_IFNAME": ifname,  # gloo's own connections stay on that link
                       "TRAINJOBS_DATABASE_URL": pg.set(host=f"{SUBNET}.254", port=forwards[0].port)
                       .render_as_string(hide_password=False),
                       "TRAINJOBS_REDIS_URL": f"redis://{auth}{SUBNET}.254:{forwards[1].port}{rd.path}"}
                argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "worker.main", "--slots", "1"]
                stack.procs.append((f"worker-{ns}", subprocess.Popen(argv, env=env)))
            listed = wait_for(lambda: len(items := api.get("/v1/workers").json()["items"]) == 2 and items, 30,
                              what="both namespaced workers")
            assert sorted(w["address"] for w in listed) == [f"{SUBNET}.1", f"{SUBNET}.2"]

            spec = mlp_spec(name="netns", resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"})
            job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"], timeout=120)
            assert job["status"] == "succeeded", job["error"]
            nodes = api.get(f"/v1/jobs/{job['id']}/attempts").json()["data"]
            assert sorted(a["node_rank"] for a in nodes) == [0, 1] and len({a["worker"] for a in nodes}) == 2
            log = api.get(f"/v1/jobs/{job['id']}/logs", params={"node_rank": 1}).text
            assert log  # node 1's own output, shipped from its namespace
            engine = create_engine(postgres_url)
            with engine.connect() as conn:
                formed = conn.scalar(select(JobEvent.detail).where(JobEvent.job_id == job["id"],
                                                                   JobEvent.kind == "running"))
            engine.dispose()
            node0 = next(a["worker"] for a in nodes if a["node_rank"] == 0)
            address = next(w["address"] for w in listed if w["id"] == node0)
            assert f"rendezvous at {address}:" in formed  # node 0's namespace address, reached over the bridge
    finally:
        for forward in forwards:
            forward.close()
