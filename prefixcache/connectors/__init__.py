"""KV connectors (cache/connector.py's protocol): the persistent tiers, segment caching and KV
events plugged into the KV lifecycle; build.py picks them from the config."""
