"""Both engine clients provide the one interface AsyncLLM uses (EngineClient)."""
from __future__ import annotations

import inspect

import pytest

from llmtower.engine.args import EngineArgs
from llmtower.engine.client_interface import EngineClient
from llmtower.engine.core_client import EngineCoreClient
from llmtower.engine.dp_client import DPEngineCoreClient

MEMBERS = [n for n in dir(EngineClient) if not n.startswith("_")]


@pytest.mark.parametrize("cls,args", [(EngineCoreClient, EngineArgs()),
                                      (DPEngineCoreClient, EngineArgs(data_parallel_size=2))])
def test_each_client_has_the_interface_with_the_same_signatures(cls, args):
    client = cls(args)
    assert isinstance(client, EngineClient)
    for name in MEMBERS:
        want = getattr(EngineClient, name)
        if callable(want):
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(inspect.signature(want).parameters), (cls.__name__, name)


def test_async_llm_reaches_no_private_client_member():
    import llmtower.engine.async_llm as mod
    source = inspect.getsource(mod)
    assert "client._" not in source
