"""`python -m vkflash.server`: run the server from the environment's knobs (tests start it so).

Options that are not knobs: --queue-depth (requests that may wait for the slot) and
--token-delay-ms (a pause after every token, so tests can watch a generation in flight).
"""

from __future__ import annotations

import argparse
import sys

from vkflash import settings
from vkflash.errors import VkflashError
from vkflash.server.app import serve
from vkflash.server.state import ServerOptions


def main(argv: list[str] | None = None) -> int:
    """Parse the options, load the knobs, serve; a user error prints one line and returns 1."""
    ap = argparse.ArgumentParser(prog="python -m vkflash.server", description=__doc__)
    ap.add_argument("--queue-depth", type=int, default=None, help="requests that may wait (default: the QUEUE knob)")
    ap.add_argument("--token-delay-ms", type=float, default=0.0, help="pause after each token (tests)")
    a = ap.parse_args(argv)
    if (a.queue_depth or 0) < 0 or a.token_delay_ms < 0:
        ap.error("--queue-depth and --token-delay-ms must be ≥ 0")
    try:
        s = settings.load()
        depth = s["QUEUE"] if a.queue_depth is None else a.queue_depth
        serve(s, ServerOptions(depth, a.token_delay_ms / 1e3))
    except VkflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
