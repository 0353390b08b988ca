"""Nothing a job writes can hurt its worker: the pump and the log hold bounded memory, and a log over its cap
keeps its head and its tail (the traceback a failed run prints last)."""

import re
import subprocess
import sys
import time
import tracemalloc

from service.db import make_engine, make_sessionmaker
from service.jobs import service as jobs
from service.logs import service as logs
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from worker.shipping import PUMP_MAX_PENDING, LogShipper, OutputPump

TRACEBACK = b"Traceback (most recent call last):\nValueError: boom\n"
DROPPED = re.compile(rb"^\n\[trainjobs\] (\d+) bytes of output dropped while the log could not keep up\n")
CUT = re.compile(rb"\[trainjobs\] \.\.\. (\d+) bytes of output cut here \(log cap TRAINJOBS_LOG_MAX_BYTES=(\d+)\) "
                 rb"\.\.\.\n")


def _pump_output_of(code: str, **pump_args) -> tuple[OutputPump, subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    return OutputPump(proc.stdout.fileno(), **pump_args), proc


def _taken_after_exit(pump: OutputPump, proc: subprocess.Popen) -> bytes:
    """Nobody takes while the child writes: all it wrote is read (the pipe closed) before the one take."""
    assert proc.wait(60) == 0
    assert pump.wait_closed(30, 0.05, lambda: None)
    proc.stdout.close()
    return pump.take()


def test_a_pump_nobody_takes_from_holds_its_bound_and_keeps_the_newest_output():
    pump, proc = _pump_output_of("import sys; sys.stdout.buffer.write(b'x' * 50_000_000); "
                                 f"sys.stdout.buffer.write({TRACEBACK!r})")
    data = _taken_after_exit(pump, proc)
    marker = DROPPED.match(data)
    kept = data[marker.end():]
    assert len(kept) <= PUMP_MAX_PENDING and kept.endswith(TRACEBACK)
    assert int(marker[1]) + len(kept) == 50_000_000 + len(TRACEBACK)  # every byte is kept or counted
    assert pump.take() == b""  # the count goes with the take that reports it


def test_a_pump_drops_whole_characters_so_what_it_keeps_still_decodes():
    pump, proc = _pump_output_of("import sys; sys.stdout.buffer.write('☃'.encode() * 1_000_000)",
                                 max_pending=100_001)
    data = _taken_after_exit(pump, proc)
    marker = DROPPED.match(data)
    kept = data[marker.end():].decode()  # strict: no half a snowman at the front
    assert set(kept) == {"☃"} and int(marker[1]) + len(kept.encode()) == 3_000_000


def test_a_pump_under_its_bound_passes_everything_through_unmarked():
    pump, proc = _pump_output_of("print('hello')")
    assert _taken_after_exit(pump, proc) == b"hello\n"


def _new_job(db) -> str:
    job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
    db.commit()
    return job_id


def _ship(db, shipper: LogShipper, data: bytes, *, final: bool = False) -> None:
    """Stage `data` and store every part it makes, as `ship` stores a batch's (service/runners/ship_calls.py)."""
    shipper.stage(data, final=final)
    while (part := shipper.part()) is not None:
        logs.append(db, job_id=shipper.job_id, attempt=shipper.attempt, node_rank=shipper.node_rank, **part)
        db.commit()
        shipper.committed()


def test_a_log_over_its_cap_keeps_its_head_a_marker_with_the_cut_count_and_the_traceback(settings):
    lines = 50_000  # 100-byte lines: 5 MB, over the log's 1 MB cap
    # The pump has room for all of it: this is the log's cap, not the pump's bound (a ship slowed by a loaded
    # machine let 2 MB pile up, and the pump then dropped some, rightly, with its own marker).
    pump, proc = _pump_output_of(f"import sys\nfor i in range({lines}): print(f'{{i:099d}}')\n"
                                 f"sys.stdout.flush(); sys.stdout.buffer.write({TRACEBACK!r})", max_pending=8 * 2**20)
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        shipper = LogShipper(job_id=(job_id := _new_job(db)), attempt=1, max_bytes=1_000_000)
        while proc.poll() is None:
            _ship(db, shipper, pump.take())
            time.sleep(0.01)
        data = _taken_after_exit(pump, proc)
        output = b"".join(f"{i:099d}\n".encode() for i in range(lines)) + TRACEBACK
        _ship(db, shipper, data)
        assert logs.read(db, job_id=job_id)[0] == output[:500_000]  # live: the head, half the cap
        _ship(db, shipper, b"", final=True)  # the run ended: the tail is stored
        log, end = logs.read(db, job_id=job_id)
    engine.dispose()
    marker = CUT.search(log)
    head, tail = log[:marker.start()], log[marker.end():]
    assert head == output[:500_000] and int(marker[2]) == 1_000_000
    assert tail.endswith(TRACEBACK) and output.endswith(tail) and len(tail) <= 500_000
    assert re.match(rb"\d{99}\n", tail)  # it starts on a whole line
    assert len(head) + int(marker[1]) + len(tail) == len(output) == 5_000_000 + len(TRACEBACK)
    assert end == len(log) <= 1_000_000 + len(marker[0])


def test_a_log_whose_database_stalls_holds_no_more_than_its_cap_in_memory(settings):
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        shipper = LogShipper(job_id=(job_id := _new_job(db)), attempt=1, max_bytes=2**20)
        chunk = b"y" * 2**20
        tracemalloc.start()
        try:
            for _ in range(50):  # nothing commits meanwhile: 50 MiB staged
                shipper.stage(chunk)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 12 * 2**20  # the cap and a few chunks' copies while one is staged, not the 50 MiB
        _ship(db, shipper, b"the end\n", final=True)
        log = logs.read(db, job_id=job_id)[0]
    engine.dispose()
    marker = CUT.search(log)
    assert log[:marker.start()] == b"y" * 2**19 + b"\n"  # the marker goes on a line of its own
    assert log.endswith(b"the end\n") and int(marker[1]) + len(log) - marker.end() == 50 * 2**20 + 8 - 2**19
