"""What the server tests share besides fixtures: the tiny model's served name, the arguments that
start it small and fast, and a helper that starts a server with its log in a temporary folder.
A module of its own (not conftest) so that test files import it by a name no other folder's
conftest shadows when several test folders run in one pytest command."""
from __future__ import annotations

from server_process import ServerProcess

MODEL = "tiny"
# Small and fast to start: one thread, a KV cache that 200 short requests fit in.
TINY_SERVER_ARGS = ["--served-model-name", MODEL, "--num-threads", "1", "--max-model-len", "512",
                    "--num-gpu-blocks", "2048", "--max-num-seqs", "256"]


def start_server(tmp_path_factory, name: str, args: list[str]) -> ServerProcess:
    log = tmp_path_factory.mktemp(name) / "server.log"
    return ServerProcess(args, log).start()
