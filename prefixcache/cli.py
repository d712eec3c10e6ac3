"""`prefixcache serve | cluster | generate | bench | analyze | events`.

Each subsystem registers its own subcommand through a ``register(subparsers)`` function in its
package's ``cli`` module, so this file stays a thin dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module with register(subparsers)); a module that is missing is simply not offered.
_SUBCOMMANDS = (
    "prefixcache.generate_cli",
    "prefixcache.server.cli",
    "prefixcache.cluster.cli",
    "prefixcache.events.cli",
    "prefixcache.bench.cli",
    "prefixcache.analyze.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
