"""``prefixcache events keygen PATH``: a CURVE keypair for ``--kv-events-curve-secret-file``.

Writes the server's secret key to PATH (mode 0600; an existing file is never overwritten) and
its public key to PATH.pub, for the subscribers (access.py says what the key grants).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("events", help="KV events tools (docs/cluster.md, 'KV events')")
    sub = p.add_subparsers(dest="events_command", required=True)
    k = sub.add_parser("keygen", help="write a CURVE server keypair: PATH (secret), PATH.pub")
    k.add_argument("path", metavar="PATH")
    k.set_defaults(func=run_keygen)


def run_keygen(args: argparse.Namespace) -> int:
    from prefixcache.events.access import write_keypair

    try:
        public = write_keypair(args.path)
    except OSError as e:
        print(f"prefixcache events keygen: {e}", file=sys.stderr)
        return 2
    print(f"secret key: {args.path} (pass it to --kv-events-curve-secret-file)")
    print(f"public key: {args.path}.pub = {public.decode()} (give it to the subscribers)")
    return 0
