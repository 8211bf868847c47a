"""The server's listening socket: a port already taken is one ConfigError line, and the socket made
for the attempt is closed, not left to the garbage collector (a server retried in-process leaks none)."""

from __future__ import annotations

import gc
import socket
import warnings

import pytest

from vkflash.errors import ConfigError
from vkflash.server.app import bind


def test_taken_port_is_a_config_error_and_closes_the_socket():
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ConfigError, match=f"cannot listen on HOST=127.0.0.1 PORT={port}: "):
                bind("127.0.0.1", port)
            gc.collect()
    finally:
        taken.close()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], [str(w.message) for w in seen]
