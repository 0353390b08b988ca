"""The API keeps an idle keep-alive connection longer than clients keep theirs (service/cli/stack.py's KEEP_ALIVE_S),
so a client's next request never meets the server closing the same connection."""

import socket
import time

from tests.helpers import module_stack

stack = module_stack("keepalive", workers=0)
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_connection_idle_past_a_clients_5s_is_still_served(stack):
    host, port = stack.api_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)  # longer than httpx keeps an idle connection, and than uvicorn's own default keep-alive
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200")  # the same connection: not closed by the server
