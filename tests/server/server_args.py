"""What the server tests share besides fixtures: the tiny model's served name, the arguments that
start it small and fast, and helpers that start servers with their logs in temporary folders
(several at once, side by side, where a module needs more than one).
A module of its own (not conftest) so that test files import it by a name no other folder's
conftest shadows when several test folders run in one pytest command."""
from __future__ import annotations

from server_process import ServerProcess, launch_all

MODEL = "tiny"
# Small and fast to start: one thread, a KV cache that 200 short requests fit in.
TINY_SERVER_ARGS = ["--served-model-name", MODEL, "--num-threads", "1", "--max-model-len", "512",
                    "--num-gpu-blocks", "2048", "--max-num-seqs", "256"]


def start_server(tmp_path_factory, name: str, args: list[str]) -> ServerProcess:
    log = tmp_path_factory.mktemp(name) / "server.log"
    return ServerProcess(args, log).start()


def launch_server(tmp_path_factory, name: str, args: list[str]) -> ServerProcess:
    """A server starting in the background: call wait_ready() before using it, stop() after
    (in a ``finally`` that covers the work done while it starts)."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    return ServerProcess(args, log).launch()


def start_servers(tmp_path_factory, specs: dict[str, list[str]]) -> dict[str, ServerProcess]:
    """One server per name, launched together and all serving on return (or all stopped)."""
    servers = {name: ServerProcess(args, tmp_path_factory.mktemp(name) / "server.log")
               for name, args in specs.items()}
    launch_all(list(servers.values()))
    return servers
