"""DESIGN rule 2: the control plane never imports torch or worker/."""

import subprocess
import sys


def test_importing_the_control_plane_loads_neither_torch_nor_worker():
    code = (
        "import sys, service.app, service.cli, service.stack, service.queue, service.migrate\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'numpy'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_worker_agent_does_not_import_torch():
    """The RQ job function runs in a fresh work-horse per job: torch there would add seconds per claim."""
    code = "import sys, worker.agent, worker.main\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
