"""Runs inside a build's sandbox (worker/build_sandbox.py), as the build's uid: `python -I build_relay.py SOCKET --
ARGV...`. The sandbox has loopback alone; this relays 127.0.0.1:<port> to the worker's filtering proxy, whose Unix
socket is bound in at SOCKET, and runs ARGV (pip) with HTTP(S)_PROXY pointing at it. Standard library only.

NOTE: nothing here is trusted. A build backend can kill this relay or talk to SOCKET itself: the proxy outside
decides what is reached, whatever comes through.
"""

import os
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _relay(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
    _pipe(client, upstream)


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_relay, args=(client, path), daemon=True).start()


def main() -> int:
    path, sep, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert sep == "--" and argv, "usage: build_relay.py SOCKET -- ARGV..."
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = {**os.environ, "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy, "https_proxy": proxy}
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    return subprocess.call(argv, env=env)


if __name__ == "__main__":
    sys.exit(main())
