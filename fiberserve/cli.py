"""The ``fiberserve`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fiberserve")
    parser.add_argument("command", choices=["serve"])
    parser.parse_args(argv)
    print("fiberserve serve: not yet available", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
