"""Data parallelism below the engine: the topology (who runs which ranks, on which ports), the
engines' process group (torch.distributed, gloo) and its periodic sync, and the head's routing.
The pieces that hold or run an engine (the data-parallel client, the remote engine's client,
the headless host) live in ``engine/``. See docs/data_parallel.md."""
