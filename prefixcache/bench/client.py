"""One streamed request to an OpenAI-compatible server, timed on the client as vLLM times it.

TTFT is the time from sending the request to the first chunk that carries generated text (a
chat server's opening chunk that only names the role is not a token), ITL the gaps between later
text chunks, latency (E2EL) the time to the end of the stream. Token counts come from the server's
``usage`` when it sends one (``stream_options.include_usage``), and ``cached_tokens`` from
``usage.prompt_tokens_details.cached_tokens``; without them the caller counts the text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

BACKENDS = ("openai", "openai-chat")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestFuncInput:
    api_url: str
    model: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    prompt_len: int
    output_len: int
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    request_id: str | None = None


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int | None = None  # from usage; None when the server sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # from usage.prompt_tokens_details
    error: str = ""
    start_time: float = 0.0  # time.perf_counter() when sent


def build_payload(backend: str, inp: RequestFuncInput) -> dict:
    payload: dict = {"model": inp.model, "stream": True,
                     "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        payload["messages"] = inp.messages or [{"role": "user", "content": inp.prompt}]
        # Both names: newer servers read max_completion_tokens, older ones only max_tokens.
        payload["max_completion_tokens"] = inp.output_len
        payload["max_tokens"] = inp.output_len
    else:
        payload["prompt"] = inp.prompt
        payload["max_tokens"] = inp.output_len
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.extra_body)
    return payload


async def request_openai(
    client: httpx.AsyncClient, backend: str, inp: RequestFuncInput
) -> RequestFuncOutput:
    """Send one streamed request; never raises for a server or network error (see ``error``)."""
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    # No x-request-id header: llama-cpp-python's server answers 400 to one that is not a UUID.
    headers = inp.headers
    payload = build_payload(backend, inp)
    st = time.perf_counter()
    out.start_time = st
    last = st
    text_parts: list[str] = []
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {body[:500]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    out.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return out
                for choice in chunk.get("choices") or []:
                    piece = _choice_text(choice)
                    if piece:
                        if not text_parts:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        text_parts.append(piece)
                usage = chunk.get("usage")
                if usage:
                    _read_usage(out, usage)
        out.latency = time.perf_counter() - st
        out.generated_text = "".join(text_parts)
        if not text_parts:
            out.ttft = out.latency  # nothing generated: the first token never came
        out.success = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _read_usage(out: RequestFuncOutput, usage: dict) -> None:
    if isinstance(usage.get("completion_tokens"), int):
        out.output_tokens = usage["completion_tokens"]
    if isinstance(usage.get("prompt_tokens"), int):
        out.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cached_tokens"))
    if isinstance(cached, int):
        out.cached_tokens = cached


async def list_models(client: httpx.AsyncClient, base_url: str, headers: dict) -> list[str]:
    """Model ids from ``GET /v1/models``; raises httpx errors (the caller reports them)."""
    resp = await client.get(f"{base_url}/v1/models", headers=headers)
    resp.raise_for_status()
    return [m["id"] for m in resp.json().get("data", []) if "id" in m]


def resolve_endpoint(args) -> tuple[str, str]:
    """(base_url, api_url) from --base-url or --host/--port, and --endpoint."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    return base, base + endpoint


async def probe(base_url: str, headers: dict) -> list[str]:
    """The server's models; raises httpx errors when it cannot be reached."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
        return await list_models(client, base_url, headers)
