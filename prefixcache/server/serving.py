"""From an API request to engine requests and back: prompts, sampling, choices, usage.

One API request becomes ``len(prompts) * n`` engine requests ("choices"), started together and
read through one merged stream. A :class:`Run` owns them: whoever starts a run must ``close()``
it, which aborts every choice still running (client gone, error, cancellation), so no request
ever outlives its HTTP connection and its blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import jinja2

from prefixcache.request import CacheExplanation, SamplingParams, StreamDelta
from prefixcache.server.auth import Tenant, TenantDirectory
from prefixcache.server.errors import APIError
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.protocol import ChatMessage, CompletionRequest, _Generation, parse_body

QUEUE_FULL_RETRY_AFTER_S = 1


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One engine request: choice ``index`` of the API response."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    stream: AsyncIterator[StreamDelta] | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    cache_info: CacheExplanation | None = None
    started: bool = False  # has seen its first delta

    def apply(self, d: StreamDelta) -> None:
        self.text.append(d.text_delta)
        self.token_ids.extend(d.new_token_ids)
        if d.new_logprobs:
            self.logprobs.extend(d.new_logprobs)
        self.num_prompt_tokens = d.num_prompt_tokens
        self.num_cached_tokens = d.num_cached_tokens
        self.num_output_tokens = d.num_output_tokens
        if d.cache_info is not None:
            self.cache_info = d.cache_info
        if d.finished:
            self.finished = True
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason


class Serving:
    """What the routes share: the engine, the tenants, the metrics, the request log."""

    def __init__(
        self,
        engine,
        served_model_names: list[str],
        tenants: TenantDirectory,
        metrics: ServerMetrics,
        request_log=None,
    ) -> None:
        self.engine = engine
        self.model_names = served_model_names
        self.tenants = tenants
        self.metrics = metrics
        self.request_log = request_log
        self.tokenizer = engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    # -- prompts ----------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """A text prompt's ids, BOS included when the model wants one (as the offline API)."""
        return self.tokenizer.encode(text, add_special_tokens=True)

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.encode_text(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [self.encode_text(x) for x in p]
        elif p:
            prompts = [list(x) for x in p]
        else:
            prompts = []
        if not prompts or any(len(ids) == 0 for ids in prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return prompts

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        dicts = [m.as_template_dict() for m in messages]
        try:
            ids = self.tokenizer.encode_chat(dicts, add_generation_prompt=add_generation_prompt)
        except (ValueError, KeyError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        if not ids:
            raise APIError(400, "messages render to an empty prompt", param="messages")
        return list(ids)

    # -- sampling -----------------------------------------------------------------------------

    def sampling_params(
        self,
        req: _Generation,
        prompt_len: int,
        max_tokens: int | None,
        default_max_tokens: int | None,
        logprobs: int | None,
        seed: int | None,
    ) -> SamplingParams:
        room = self.engine.max_model_len - prompt_len
        if max_tokens is None:
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.engine.max_model_len} tokens, "
                    f"but the prompt has {prompt_len} tokens.",
                    param="messages" if hasattr(req, "messages") else "prompt",
                    code="context_length_exceeded",
                )
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                seed=seed,
                stop=req.stop or (),
                stop_token_ids=req.stop_token_ids or (),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from e

    # -- running ------------------------------------------------------------------------------

    def start(
        self,
        prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        tenant: Tenant,
        namespace: str,
        priority: int = 0,
        explain: bool = False,
    ) -> Run:
        """Add every choice to the engine; on any refusal abort those already added."""
        run = Run(self, new_id(prefix), tenant, namespace, n)
        try:
            for p, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                for j in range(n):
                    index = p * n + j
                    choice = Choice(index, p, f"{run.id}-{index}", ids)
                    # Choices of one prompt with a seed get seed, seed+1, ...: equal seeds would
                    # make n copies of the same sample.
                    choice_sp = sp
                    if sp.seed is not None and j:
                        choice_sp = SamplingParams(**{**_fields(sp), "seed": sp.seed + j})
                    choice.stream = self.engine.add_request(
                        choice.request_id,
                        ids,
                        choice_sp,
                        namespace=namespace,
                        priority=priority,
                        explain=explain,
                    )
                    run.choices.append(choice)
        except BaseException as e:
            run.close()
            raise engine_error(e) from e
        return run


def engine_error(e: BaseException) -> BaseException:
    """Map what ``engine.add_request`` raises to an API error (other exceptions pass)."""
    from prefixcache.engine import EngineShutDownError, QueueFullError

    if isinstance(e, EngineShutDownError):
        return APIError(503, f"server is shutting down: {e}", code="shutting_down")
    if isinstance(e, QueueFullError):
        return APIError(
            429,
            f"server is busy: {e}",
            code="queue_full",
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
        )
    if isinstance(e, ValueError):
        msg = str(e)
        code = "context_length_exceeded" if "length" in msg else None
        return APIError(400, msg, param=_param_of(msg), code=code)
    return e


class Run:
    """The choices of one API request and their merged stream."""

    def __init__(
        self, serving: Serving, run_id: str, tenant: Tenant, namespace: str, n: int = 1
    ) -> None:
        self.serving = serving
        self.n = n
        self.id = run_id
        self.tenant = tenant
        self.namespace = namespace
        self.created = int(time.time())
        self.choices: list[Choice] = []
        self._tasks: list[asyncio.Task] = []

    async def deltas(self) -> AsyncIterator[tuple[Choice, StreamDelta]]:
        """Every delta of every choice, as they come; each choice's deltas stay in order."""
        if len(self.choices) == 1:
            c = self.choices[0]
            async for d in c.stream:
                self._on_delta(c, d)
                yield c, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for d in c.stream:
                    queue.put_nowait((c, d))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((c, e))
            finally:
                queue.put_nowait((c, None))

        self._tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        live = len(self.choices)
        while live:
            c, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                self._on_delta(c, item)
                yield c, item

    async def collect(self) -> None:
        async for _ in self.deltas():
            pass

    def _on_delta(self, c: Choice, d: StreamDelta) -> None:
        first = not c.started
        c.started = True
        c.apply(d)
        s = self.serving
        if first and s.request_log is not None and c.index == c.prompt_index * self.n:
            self._log(c, d)  # once per prompt, not once per choice
        if d.finished:
            s.metrics.observe_finished(d)

    def _log(self, c: Choice, d: StreamDelta) -> None:
        s = self.serving
        s.request_log.log(
            time=d.metrics.arrival_time,
            tenant=self.tenant.name,
            namespace=self.namespace,
            num_prompt_tokens=len(c.prompt_token_ids),
            block_hashes=s.engine.block_hashes(c.prompt_token_ids, self.namespace),
            num_cached_tokens=c.num_cached_tokens,
            text=None,
        )

    def close(self) -> None:
        """Abort every unfinished choice (idempotent); frees their blocks in the engine."""
        for t in self._tasks:
            t.cancel()
        for c in self.choices:
            if not c.finished:
                c.finished = True
                c.finish_reason = c.finish_reason or "abort"
                self.serving.engine.abort(c.request_id)

    # -- results ------------------------------------------------------------------------------

    def usage(self) -> dict:
        by_prompt: dict[int, list[Choice]] = {}
        for c in self.choices:
            by_prompt.setdefault(c.prompt_index, []).append(c)
        prompt_tokens = sum(
            cs[0].num_prompt_tokens or len(cs[0].prompt_token_ids) for cs in by_prompt.values()
        )
        # Tokens of a prompt no choice had to compute: the least any of its choices reused.
        cached = sum(min(c.num_cached_tokens for c in cs) for cs in by_prompt.values())
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def cache_info(self, c: Choice) -> dict | None:
        info = c.cache_info
        if info is None:
            return None
        reason = info.reason
        # "the blocks exist under another namespace" would tell a tenant that someone else sent
        # this prompt: only the admin hears it, others hear that nothing here had it.
        if reason == "other_namespace" and not self.tenant.admin:
            reason = "no_prior_request"
        return {
            "cached_tokens": info.cached_tokens,
            "first_uncached_position": info.first_uncached_position,
            "reason": reason,
            "diverged_at": info.diverged_at,
            "namespace": self.namespace,
        }


def _fields(sp: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(sp, f.name) for f in fields(sp)}


def _param_of(message: str) -> str | None:
    for name in ("max_tokens", "temperature", "top_p", "top_k", "logprobs", "stop", "seed"):
        if message.startswith(name) or f" {name} " in message:
            return name
    if "prompt" in message:
        return "prompt"
    return None


async def accept(request, schema):
    """The start of every generation and cache route: authenticate the caller, parse the body
    as ``schema``, check the model name, and derive the cache namespace (never from the client
    alone). Returns (serving, tenant, body, namespace)."""
    s: Serving = request.app.state.serving
    tenant = s.tenants.authenticate(request.headers.get("authorization"))
    req = await parse_body(request, schema)
    s.check_model(req.model)
    return s, tenant, req, s.tenants.namespace(tenant, req.cache_salt)
