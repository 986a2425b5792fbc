"""Both engine clients provide the one interface AsyncLLM and the server use (EngineClient);
the offline LLM drives its engine through the synchronous one (SyncEngineClient)."""
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


def test_the_server_asks_the_engine_client_only_through_the_interface():
    from pathlib import Path

    import llmtower.server
    for path in Path(llmtower.server.__file__).parent.rglob("*.py"):
        source = path.read_text()
        for past_the_interface in ("DPEngineCoreClient", "getattr(llm.client", "client._"):
            assert past_the_interface not in source, (path.name, past_the_interface)


def test_the_offline_llm_drives_its_engine_through_the_sync_client(fake_llm):
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.client_interface import SyncEngineClient
    from llmtower.engine.inproc_client import InprocEngineClient

    assert isinstance(fake_llm.client, InprocEngineClient)
    assert isinstance(fake_llm.client, SyncEngineClient)
    assert fake_llm.engine_core is fake_llm.client.engine_core
    (out,) = fake_llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True),
                               use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    assert not fake_llm.client.has_unfinished_requests()


def test_the_sync_client_answers_only_the_engines_utilities_with_their_type(fake_llm):
    assert fake_llm.client.call_utility("unpin", result_type=int) == 0
    with pytest.raises(ValueError, match="unknown utility method 'step'"):
        fake_llm.client.call_utility("step", result_type=object)
    with pytest.raises(ValueError, match="unknown utility method 'dp_status'"):
        fake_llm.client.call_utility("dp_status", result_type=object)
    with pytest.raises(TypeError, match="answered a int, not a str"):
        fake_llm.client.call_utility("unpin", result_type=str)


def test_one_engine_has_no_data_parallel_view_and_only_engine_zero():
    import asyncio

    client = EngineCoreClient(EngineArgs())
    assert client.health() is None
    assert asyncio.run(client.data_parallel_view()) is None
    with pytest.raises(ValueError, match="engine_id=1 does not exist"):
        asyncio.run(client.call_utility_on(1, "unpin", result_type=int))
