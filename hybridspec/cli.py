"""`hybridspec demo`: the one command that starts both ends (so it lives outside edge_client,
which an app installs alone with `pip install 'hybridspec[edge]'`)."""
from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG (default: warnings only)")
    sub = parser.add_subparsers(dest="command", required=True)
    from hybridspec import demo
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from edge_client.options import OptionError
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except OptionError as e:  # a bad value, refused before anything starts
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
