"""``python -m fiberserve.server`` == ``fiberserve serve``."""

import sys

from fiberserve.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
