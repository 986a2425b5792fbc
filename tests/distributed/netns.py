"""Test hosts in Linux network namespaces: each a namespace joined to the root namespace by a
veth pair on a private /24, so that a process run in it (``ip netns exec``) reaches the head
only over that link. Created by the test (root needed), always deleted afterwards."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass


@dataclass
class NetnsHost:
    """Owns one namespace, its veth pair and its two addresses."""

    name: str
    veth_root: str
    host_ip: str  # inside the namespace
    head_ip: str  # the root namespace's end of the link

    def cmd(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.veth_root], capture_output=True)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"ltprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` is not allowed here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sweep_stale_hosts() -> None:
    """Delete the namespaces (and their veth pairs) of test runs that were killed before their
    teardown (``lt<pid>h<index>`` whose pid is gone): a SIGKILLed run cannot clean up itself."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        m = re.fullmatch(r"lt(\d+)h(\d+)", line.split()[0]) if line.strip() else None
        if m is None or int(m.group(1)) == os.getpid() % 100000:
            continue
        if any(pid % 100000 == int(m.group(1)) for pid in map(int, filter(str.isdigit, os.listdir("/proc")))):
            continue  # a live process may own it
        subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"ltv{m.group(1)}h{m.group(2)}a"], capture_output=True)


def make_host(index: int) -> NetnsHost:
    """Namespace ``lt<pid>h<index>`` on 10.<pid-derived>.<index>.0/24."""
    sweep_stale_hosts()
    tag = f"{os.getpid() % 100000}h{index}"
    subnet = f"10.{200 + os.getpid() % 50}.{index}"
    host = NetnsHost(f"lt{tag}", f"ltv{tag}a", f"{subnet}.2", f"{subnet}.1")
    peer = f"ltv{tag}b"
    steps = [
        ["ip", "netns", "add", host.name],
        ["ip", "link", "add", host.veth_root, "type", "veth", "peer", "name", peer],
        ["ip", "link", "set", peer, "netns", host.name],
        ["ip", "addr", "add", f"{host.head_ip}/24", "dev", host.veth_root],
        ["ip", "link", "set", host.veth_root, "up"],
        ["ip", "netns", "exec", host.name, "ip", "addr", "add", f"{host.host_ip}/24", "dev", peer],
        ["ip", "netns", "exec", host.name, "ip", "link", "set", peer, "up"],
        ["ip", "netns", "exec", host.name, "ip", "link", "set", "lo", "up"],
    ]
    for step in steps:
        r = subprocess.run(step, capture_output=True, text=True)
        if r.returncode != 0:
            host.delete()
            raise RuntimeError(f"{' '.join(step)} failed: {r.stderr.strip()}")
    return host
