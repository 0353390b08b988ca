"""The first process in the sandbox of one node of a gang: it starts torchrun at a pid no other node of the
gang has, waits for it and exits as it did (stdlib only: it runs on the job's Python, before torchrun).

Why: c10d's rendezvous names a node by its address and pid (torch's _NodeDescGenerator). In a PID namespace of
its own every node's torchrun would be pid 2; two nodes of one gang that share an address (one machine, as in
the tests, or a big box) would then be one node to the rendezvous. Pids in a new namespace count up from 1, so
`node_rank` throwaway forks first give node r's torchrun pid 3 + r.

    python -I gang_init.py NODE_RANK torchrun-argv...
"""

import os
import signal
import sys


def main() -> int:
    burn, argv = int(sys.argv[1]), sys.argv[2:]
    for _ in range(burn):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    child = os.fork()
    if child == 0:
        os.execvp(argv[0], argv)  # PATH-searched: in an image, torchrun starts on its python3 by name
    # The supervisor signals torchrun itself (it finds every process of the attempt): this one only outlives it,
    # since the sandbox ends when its first process does. A handler, not SIG_IGN: torchrun was forked already.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
