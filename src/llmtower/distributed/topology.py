"""Where every data-parallel rank lives and which TCP ports the head listens on.

The head host (``llmtower serve`` without ``--headless``) runs the API server, the store of the
engines' process group and ranks ``0 .. L-1``; every other host runs ``llmtower serve
--headless --data-parallel-start-rank R`` with ranks ``R .. R+L'-1``. All of them are given the
head's ``--data-parallel-address`` and ``--data-parallel-rpc-port P``; the ports are derived
from P, so nothing else has to be configured:

    P                  the TCPStore of the engines' gloo process group (hosted by the head)
    P + 1 + 2*rank     rank's input socket  (head PUSH  --bind-->  engine PULL --connect-->)
    P + 2 + 2*rank     rank's output socket (head PULL  <--bind--  engine PUSH --connect--)

Engines connect, the head binds: engines may start before the head or after it (ZMQ retries
the connection), in any order. With the Ray backend (``backend="ray"``) the head runs no
engine itself: every rank is a Ray actor that connects back like a ``--headless`` host with
one rank, rank 0 included.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DPTopology:
    """Owns the data-parallel layout: world size, the ranks local to this host, the head's
    address and the port plan derived from ``rpc_port``."""

    size: int = 1
    size_local: int = 1
    start_rank: int = 0
    address: str = "127.0.0.1"
    rpc_port: int = 13345
    headless: bool = False
    backend: str = "mp"  # "ray": every rank is a Ray actor, the head runs none

    def __post_init__(self) -> None:
        if self.backend == "ray":
            self._check_ray()
            return
        if self.size < 1:
            raise ValueError(f"data_parallel_size={self.size} is invalid: use 1 or more")
        if not 1 <= self.size_local <= self.size:
            raise ValueError(f"data_parallel_size_local={self.size_local} is invalid: use "
                             f"1..data_parallel_size ({self.size})")
        if not 0 <= self.start_rank or self.start_rank + self.size_local > self.size:
            raise ValueError(
                f"data_parallel_start_rank={self.start_rank} with data_parallel_size_local="
                f"{self.size_local} names ranks beyond data_parallel_size={self.size}: the "
                f"ranks of a host are start_rank .. start_rank + size_local - 1")
        if not self.headless and self.start_rank != 0:
            raise ValueError("the head host (no --headless) runs ranks from 0: drop "
                             "--data-parallel-start-rank, or add --headless on this host")
        if self.headless and self.start_rank == 0:
            raise ValueError("a --headless host serves the ranks after the head's: give "
                             "--data-parallel-start-rank R with R >= the head's "
                             "--data-parallel-size-local")
        self._check_ports()

    def _check_ray(self) -> None:
        if self.size < 1:
            raise ValueError(f"data_parallel_size={self.size} is invalid: use 1 or more")
        if not self.headless and self.size_local != 0:
            raise ValueError("with the Ray backend the head runs no engine (size_local=0)")
        if self.headless and (self.size_local != 1 or not 0 <= self.start_rank < self.size):
            raise ValueError("with --data-parallel-backend ray the engines are Ray actors that "
                             "the head starts: run no --headless host by hand")
        self._check_ports()

    def _check_ports(self) -> None:
        last = self.rpc_port + 2 + 2 * (self.size - 1)
        if not 1024 <= self.rpc_port or last > 65535:
            raise ValueError(f"data_parallel_rpc_port={self.rpc_port} is invalid: ports "
                             f"{self.rpc_port}..{last} must lie within 1024..65535")

    @property
    def multi_host(self) -> bool:
        """Some ranks live on other hosts: they talk TCP and join the process group."""
        return self.size_local < self.size or self.headless or self.backend == "ray"

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.size_local)

    @property
    def remote_ranks(self) -> list[int]:
        local = set(self.local_ranks)
        return [r for r in range(self.size) if r not in local]

    @property
    def store_port(self) -> int:
        return self.rpc_port

    # The head binds these on --data-parallel-address itself, not on every interface.
    def input_address(self, rank: int) -> str:
        return f"tcp://{_bracket(self.address)}:{self.rpc_port + 1 + 2 * rank}"

    def output_address(self, rank: int) -> str:
        return f"tcp://{_bracket(self.address)}:{self.rpc_port + 2 + 2 * rank}"

    def own_ip(self) -> str:
        """This host's address as the head sees it: the source address of a route to it. The
        engines' gloo transport listens there, so that every other host can reach it."""
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((self.address, self.rpc_port))  # UDP: no packet is sent
            return s.getsockname()[0]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
