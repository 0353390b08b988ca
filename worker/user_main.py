"""What torchrun runs on every rank of an entrypoint job: the user's script or module, as Python would, then a
clean exit that skips the interpreter's teardown.

    python .../worker/user_main.py script PATH [ARGS...]
    python .../worker/user_main.py module NAME [ARGS...]

Run by its path, never `-m worker.user_main`: a user's own `worker` module would hide ours. So it imports
nothing but the standard library (its folder is sys.path[0] until it hands the path to the user's code),
trainjobs.rank_output (standard library too), which starts each line a rank of a multi-rank job prints with
`[rank<R>]: `, and trainjobs.capture (standard library too), which picks up an unmodified HF Trainer's,
Lightning's, TensorBoard's and MLflow's scalars; TRAINJOBS_CAPTURE=0 in the ranks' environment leaves it out.

The script runs as `__main__` with `python PATH` semantics (sys.argv, sys.path[0] = its folder, __file__), the
module with `python -m NAME` semantics (runpy.run_module). After it returns (or raises, or calls sys.exit),
Python shuts down as usual up to its atexit handlers: non-daemon threads are joined, the script's own atexit
handlers run; then the last handler (registered before the script runs, so it runs after all of theirs)
flushes every open file and leaves with os._exit(code).

NOTE: why skip the teardown: on torch 2.13 a gloo process group's worker thread can still hold the last
collective's work (and its tensors) when the main thread finalizes the interpreter; dropping it needs the GIL,
a thread that asks for the GIL during finalization is ended by pthread_exit, and its unwind through a noexcept
destructor calls std::terminate: "terminate called without an active exception", SIGABRT, exit -6 after the
script printed its last line, with or without destroy_process_group. Measured here, 2 CPU cores under load:
7 of 30 bare torchrun runs of a 2-rank DDP script. The built-in runtime leaves the same way
(worker.train.distributed.cleanup_and_exit). What a user loses: objects' __del__ at module teardown
(open files are flushed here; atexit handlers run).
"""

import atexit
import gc
import io
import json
import os
import runpy
import sys
import time
import traceback
from types import TracebackType

USAGE = "usage: python worker/user_main.py (script PATH | module NAME) [ARGS...]"


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("script", "module"):
        print(USAGE, file=sys.stderr)
        os._exit(2)
    kind, target, args = argv[0], argv[1], argv[2:]
    install_rank_output()  # first: whatever the script (or capture) prints says which rank printed it
    code = 0
    atexit.register(lambda: leave(code))  # first registered, so it runs last
    install_capture()  # its atexit handler (the summary) runs after the script's, before leave()
    try:
        if kind == "script":
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python PATH` has it
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *args]  # run_module puts the module's file in argv[0]
            sys.path[0] = os.getcwd()  # as `python -m NAME` has it
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException as error:  # noqa: BLE001 - what Python would print for an uncaught exception
        tb = users_frames(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        record(error, tb)
        code = 1
    sys.exit(code)


def install_rank_output() -> None:
    """`[rank<R>]: ` before each line the rank prints (trainjobs/rank_output.py), so `logs --rank R` can pick them."""
    try:
        from trainjobs.rank_output import install

        install()
    except Exception as error:  # noqa: BLE001 - the script runs all the same, its lines unmarked
        print(f"[trainjobs] rank prefixes: not installed ({type(error).__name__}: {error})", file=sys.stderr,
              flush=True)


def install_capture() -> None:
    """trainjobs' zero-code capture (trainjobs/capture): never a reason for the script not to run."""
    if os.environ.get("TRAINJOBS_CAPTURE", "1").strip().lower() in ("0", "false", "no", "off"):
        return  # not even imported
    try:
        from trainjobs.capture import install

        install()
    except Exception as error:  # noqa: BLE001 - the script runs all the same, without capture
        print(f"[trainjobs] capture: not installed ({type(error).__name__}: {error}); the script runs without it",
              file=sys.stderr, flush=True)


def exit_code(code: object) -> int:
    """sys.exit's argument as Python turns it into a status: None is 0, an int itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def record(error: BaseException, tb: TracebackType | None) -> None:
    """The exception in torchrun's error file for this rank, as torch's @record writes it for the built-in runtime:
    the worker reads it (worker/root_cause.py) into the job's error, type, message and the user's frames, rather
    than only an exit code under torchrun's ChildFailedError."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "".join(traceback.format_exception(type(error), error, tb))
    body = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(body, f)
    except OSError:  # the exit code and the log still say it
        pass


def users_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the user's first frame: without this module's and runpy's."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def leave(code: int) -> None:
    for obj in gc.get_objects():  # what the teardown would flush as it freed them
        # NOTE: type(), not isinstance: isinstance reads an object's __class__, and some objects warn when touched
        # (torch.distributed.reduce_op: a FutureWarning in every script's log that the script never caused).
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001,S112 - a file that cannot be flushed would not have been at teardown either
                continue
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
