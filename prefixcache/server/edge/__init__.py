"""The HTTP edge: what every request meets before any API sees it, whichever API it is for.

errors (every failure as an answer, the request id), limits (the size and time limits,
``ServerLimits``), body (reading and parsing a body within them), origin (the Host, Origin and
Content-Type checks against browsers), refusals (early 429s for a tenant refused often; the
peer guard for addresses failing authentication), http (uvicorn's protocol with the connection
cap, header and send timeouts).
"""
