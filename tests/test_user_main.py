"""worker/user_main.py: a user's script or module runs as `python PATH` / `python -m NAME` would, and ends as it would
(status, output, atexit, threads, files), without the interpreter teardown where torch 2.13's gloo aborts."""

import subprocess
import sys
import textwrap
from pathlib import Path

from worker.launch import USER_MAIN


def run_user(tmp_path: Path, kind: str, target: str, *args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """As torchrun starts it on a rank: `python .../user_main.py ...`, in the run's folder."""
    return subprocess.run([sys.executable, str(USER_MAIN), kind, target, *args], cwd=tmp_path,
                          env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60)


def write(path: Path, code: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def test_a_script_runs_as_main_with_its_args_and_its_folder_importable(tmp_path):
    write(tmp_path / "code" / "helper.py", "VALUE = 'from the neighbour'\n")
    script = write(tmp_path / "code" / "train.py", """
        import sys
        from helper import VALUE
        print(__name__, sys.argv, VALUE, __file__)
    """)
    done = run_user(tmp_path, "script", str(script), "--steps", "5")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"__main__ {[str(script), '--steps', '5']} from the neighbour {script}"


def test_a_module_runs_as_python_dash_m_would(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "")
    module = write(tmp_path / "pkg" / "train.py", "import sys\nprint(__name__, sys.argv)\nsys.exit(0)\n")
    done = run_user(tmp_path, "module", "pkg.train", "--lr", "1")  # found in the working directory, as -m would
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"__main__ {[str(module), '--lr', '1']}"


def test_the_exit_status_is_what_python_would_give(tmp_path):
    assert run_user(tmp_path, "script", str(write(tmp_path / "a.py", "import sys; sys.exit(3)\n"))).returncode == 3
    said = run_user(tmp_path, "script", str(write(tmp_path / "b.py", "raise SystemExit('bad config')\n")))
    assert said.returncode == 1 and said.stderr.strip() == "bad config"
    assert run_user(tmp_path, "script", str(write(tmp_path / "c.py", "print('ok')\n"))).returncode == 0


def test_an_uncaught_exception_prints_the_users_traceback_only_and_exits_1(tmp_path):
    script = write(tmp_path / "boom.py", """
        def step():
            raise ValueError("loss is nan")
        step()
    """)
    done = run_user(tmp_path, "script", str(script))
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):\n  File \"" + str(script))
    assert done.stderr.strip().endswith("ValueError: loss is nan")
    assert "user_main" not in done.stderr and "runpy" not in done.stderr


def test_a_missing_module_says_so_as_python_dash_m_does(tmp_path):
    done = run_user(tmp_path, "module", "no_such_pkg.train")
    assert done.returncode == 1
    assert "'no_such_pkg.train' (ModuleNotFoundError: No module named 'no_such_pkg')" in done.stderr


def test_threads_atexit_handlers_and_unclosed_files_finish_before_the_exit(tmp_path):
    script = write(tmp_path / "ends.py", """
        import atexit, sys, threading, time
        log = open("log.txt", "w")  # never closed: the teardown would have flushed it
        log.write("written, not flushed\\n")
        def late():
            time.sleep(0.3)
            open("thread.txt", "w").write("joined")
        threading.Thread(target=late).start()  # not a daemon: Python waits for it
        atexit.register(lambda: print("atexit ran", flush=True))
        print("main done", end="")  # no newline, no flush
        sys.exit(5)
    """)
    done = run_user(tmp_path, "script", str(script))
    assert done.returncode == 5
    assert done.stdout == "main doneatexit ran\n"
    assert (tmp_path / "log.txt").read_text() == "written, not flushed\n"
    assert (tmp_path / "thread.txt").read_text() == "joined"


def test_a_users_own_worker_module_is_theirs_and_does_not_hide_the_launcher(tmp_path):
    write(tmp_path / "code" / "worker.py", 'NAME = "the user\'s worker"\n')
    script = write(tmp_path / "code" / "train.py", "import worker\nprint(worker.NAME)\n")
    done = run_user(tmp_path, "script", str(script), pythonpath=str(tmp_path / "code"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the user's worker\n"


def test_without_a_kind_and_target_it_says_how_to_call_it(tmp_path):
    done = run_user(tmp_path, "notebook.ipynb", "")
    assert done.returncode == 2 and "usage: python worker/user_main.py" in done.stderr
