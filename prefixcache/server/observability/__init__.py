"""What the server tells its operators: metrics (Prometheus), per-tenant activity and
prompt_cache_key statistics, the request log, the snapshot reads behind ``/metrics``, and the
routes that show them (health, version, metrics, integrity; the dashboard and its data).
"""
