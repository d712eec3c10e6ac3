"""``prefixcache cluster``: engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

Pieces, one per module:

- ``replica.py``: a Ray Serve deployment holding one AsyncEngine and the very app of
  ``prefixcache serve``; requests reach that app in-process through ``asgi_bridge.py``, so every
  route, error, limit and tenant rule is the single server's.
- ``route_keys.py``: the ingress computes each request's block-key chain exactly as the engine
  does (tokenizer, chat template, tenant namespace, model fingerprint).
- ``router.py``: a Ray Serve ``RequestRouter`` (prefix affinity on those keys, round robin,
  power of two choices) that picks the replica.
- ``ingress.py``: the HTTP front (a Serve deployment with FastAPI): forwards, retries a request
  whose replica died before anything was sent, fans cache-control and stats routes out to every
  replica and merges the answers (``aggregate.py``).
- ``cli.py``: the subcommand (starts or joins Ray, deploys, waits, serves until interrupted).

Imports: ``prefixcache.server`` (the app, auth, limits), ``prefixcache.cache.hashing``,
``prefixcache.tokenizer.tokenizer``, ``prefixcache.engine.async_engine``; nothing imports this package.
"""

POLICIES = ("prefix", "round_robin", "pow2")  # router.py; here so the CLI need not import ray
