"""Data parallelism across hosts: the topology (who runs which ranks, on which ports), the
engines' process group (torch.distributed, gloo) and its periodic sync, the head's routing,
remote engines and headless hosts. See docs/data_parallel.md."""
