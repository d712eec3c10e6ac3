"""Keys out of the Ray specs: what the replicas and the ingress need to authenticate callers,
passed as a file path instead of values.

A ``ReplicaSpec`` / ``IngressSpec`` is pickled into Ray's object store and GCS (deployment
configs), readable by anything that can talk to Ray and shown by its state API. So the API
key, the admin key and the metrics key given as flags are written by the driver to a private
file (mode 0600 in a 0700 directory of its own, removed when the cluster stops) and the specs
carry only that path; ``--api-keys-file`` is a path already. Each replica and the ingress read
the file when they start and on a reload. Replicas on other machines need the file at the same
path there (docs/cluster.md), like ``--api-keys-file``; a replica that cannot read it fails to
start with the path in the error, never with a key.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# The tenant options (TenantDirectory.from_options) and server options that are secrets.
SECRET_OPTIONS = ("api_key", "admin_key", "metrics_key")


class SecretsFile:
    """A private JSON file of the secret options given as flags (absent ones left out)."""

    def __init__(self, values: dict[str, str | None]) -> None:
        unknown = set(values) - set(SECRET_OPTIONS)
        if unknown:
            raise ValueError(f"not secret options: {sorted(unknown)}")
        self.dir = Path(tempfile.mkdtemp(prefix="prefixcache-cluster-"))  # mode 0700
        self.path = self.dir / "secrets.json"
        present = {k: v for k, v in values.items() if v}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(present, f)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def read_secrets(path: str | None) -> dict[str, str]:
    """The secret options in ``path`` ({} for None). Errors name the path, never a value."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the cluster's secrets file {path}: {type(e).__name__}") from None
    if not isinstance(data, dict) or not set(data) <= set(SECRET_OPTIONS):
        raise ValueError(f"the cluster's secrets file {path} is not one this version wrote")
    return {k: v for k, v in data.items() if isinstance(v, str) and v}


def tenant_options(options: dict, secrets_path: str | None) -> dict:
    """``TenantDirectory.from_options`` kwargs: the spec's (no secrets) plus the file's keys."""
    secrets = read_secrets(secrets_path)
    return {**options, **{k: secrets.get(k) for k in ("api_key", "admin_key")}}
