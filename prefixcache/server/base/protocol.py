"""Reading a request body as a model, for every API: the base class of the bodies and
``parse_body``.

The body is read by edge/body.py (size, time, strict JSON, valid text) and validated here as
the route's model: a wrong shape is a 422 naming the field (edge/errors.py), answered in the
dialect of the route's API.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from prefixcache.server.edge.body import check_containers, parse_json, read_body
from prefixcache.server.edge.errors import validation_error
from prefixcache.server.edge.limits import ServerLimits


class _Body(BaseModel):
    # allow_inf_nan: a float field never holds NaN or an infinity (1e400 parses as inf).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


_B = TypeVar("_B", bound=_Body)


# Bodies larger than this, or holding more objects and arrays than OFF_LOOP_CONTAINERS, are
# parsed and validated in a worker thread: a few MiB of JSON, or a few thousand containers,
# take tens of milliseconds, and the Python parts of that work then let the event loop (every
# other request's stream) in between. The containers are bounded first (edge/body.py).
OFF_LOOP_BYTES = 256 << 10
OFF_LOOP_CONTAINERS = 256


async def parse_body(request: Request, model: type[_B], limits: ServerLimits) -> _B:
    """The body as ``model``: size/time/JSON/text failures are 4xx (edge/body.py), a wrong
    shape 422."""
    raw = await read_body(request, limits)
    containers = check_containers(raw, limits)  # 400 over the limit, before any parsing
    if len(raw) > OFF_LOOP_BYTES or containers > OFF_LOOP_CONTAINERS:
        return await asyncio.to_thread(_parse, raw, model, limits)
    return _parse(raw, model, limits)


def _parse(raw: bytes, model: type[_B], limits: ServerLimits) -> _B:
    data = parse_json(raw, limits, counted=True)  # parse_body counted its containers
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
