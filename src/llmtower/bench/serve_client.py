"""One streamed request of `llmtower bench serve`, against any OpenAI-compatible server:
only standard fields are read (choices[].text / delta.content, usage), never llmtower's own."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from llmtower.bench.serve_dataset import BenchRequest


@dataclass
class RequestResult:
    """What the client measured for one request (seconds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0  # from the server's usage; 0 if it sent none
    num_chunks: int = 0  # chunks that carried text
    generated_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0


def build_payload(endpoint: str, model: str, req: BenchRequest, ignore_eos: bool,
                  temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len,
                            "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # an extension: vLLM, SGLang and llmtower accept it
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       req: BenchRequest, endpoint: str,
                       headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming request and time it: TTFT at the first chunk with text, then the
    gap before each later chunk with text (ITL), and the end of the stream."""
    result = RequestResult(prompt_len=req.prompt_len)
    start = result.start_time = time.perf_counter()
    last = start
    text_parts: list[str] = []
    usage_tokens = None
    num_chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = await resp.text()
                result.error = f"HTTP {resp.status}: {body[:300]}"
                return result
            async for line in _sse_lines(resp):
                if line == "[DONE]":
                    break
                data = json.loads(line)
                if "error" in data:
                    result.error = f"error in stream: {data['error']}"
                    return result
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                    if usage_tokens is not None and data["usage"].get("prompt_tokens"):
                        result.prompt_len = result.prompt_len or data["usage"]["prompt_tokens"]
                for choice in data.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if endpoint == "chat" \
                        else choice.get("text")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if not text_parts:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    text_parts.append(piece)
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(text_parts)
        result.output_tokens = usage_tokens or 0
        result.num_chunks = num_chunks
        result.success = bool(text_parts) or result.output_tokens > 0
        if not result.success:
            result.error = "the stream ended without any text"
    except (aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _sse_lines(resp: aiohttp.ClientResponse):
    """The data payloads of a server-sent event stream, one per event."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            line = raw.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()
