"""Which rank printed a line (trainjobs/rank_output.py): each rank of a multi-rank job marks its lines
`[rank<R>]: `; `logs --rank R`, GET .../logs?rank=R and `run --follow` (rank 0 by default) keep one rank's."""

import io
import json
import re

from tests.helpers import live_stack, stack_cli
from trainjobs.rank_output import RankLines, rank_lines
from worker.root_cause import root_cause


def test_each_line_starts_with_the_rank_after_partial_writes_and_a_carriage_return():
    fd = io.StringIO()
    out = RankLines(fd, "[rank1]: ")
    out.write("step ")
    out.write("1")
    assert fd.getvalue() == ""  # a line goes out whole, in one write: another rank's cannot land inside it
    out.write(" done\nstep 2\n")
    out.write("\r 10%|#")
    out.flush()  # a progress bar flushes each redraw: it is shown at once
    out.write("\r 20%|##")
    out.write("\n")
    out.write("windows\r\n")
    assert fd.getvalue() == ("[rank1]: step 1 done\n[rank1]: step 2\n\r[rank1]:  10%|#\r[rank1]:  20%|##\n"
                             "[rank1]: windows\r\n")
    huge = io.StringIO()
    RankLines(huge, "[rank0]: ").write("z" * 5000)  # a line that never ends is not held in memory
    assert huge.getvalue() == "[rank0]: " + "z" * 5000


def test_a_print_without_newline_then_one_on_the_other_stream_keeps_both_lines_marked():
    fd = io.StringIO()  # stdout and stderr go to one pipe, as under torchrun
    out, err = RankLines(fd, "[rank0]: "), RankLines(fd, "[rank0]: ")
    print("loading", end="", file=out)
    print("a warning", file=err)
    print(" done", file=out)
    assert fd.getvalue() == "[rank0]: a warning\n[rank0]: loading done\n"
    assert rank_lines(fd.getvalue().encode(), 0, final=True) == (b"a warning\nloading done\n", len(fd.getvalue()))


def test_everything_but_writing_is_the_wrapped_streams():
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    wrapped = RankLines(stream, "[rank3]: ")
    assert (wrapped.encoding, wrapped.errors, wrapped.buffer) == ("utf-8", "strict", stream.buffer)
    assert wrapped.isatty() is False and wrapped.writable()
    wrapped.writelines(["a\n", "b"])
    wrapped.close()  # flushes what was held
    assert stream.closed
    try:
        wrapped.write(b"bytes")
    except TypeError as error:
        assert "must be str, not bytes" in str(error)
    else:
        raise AssertionError("a bytes write went through")


def test_reading_one_rank_keeps_unmarked_lines_and_waits_for_a_lines_end_until_the_job_ended():
    log = (b"[rank0]: zero\n[rank1]: one\ntorchrun: a node message\n[rank1]:[W1206 reducer.cpp:1] Warning: x\n"
           b"[rank1]: half")
    text, used = rank_lines(log, 1, final=False)
    assert text == b"one\ntorchrun: a node message\n[W1206 reducer.cpp:1] Warning: x\n"
    assert used == len(log) - len(b"[rank1]: half")  # the next read starts at the line's start, marked
    assert rank_lines(log[used:] + b" more\n", 1, final=False)[0] == b"half more\n"
    assert rank_lines(log, 0, final=True) == (b"zero\ntorchrun: a node message\n", len(log))
    ran_into = b"[rank0]: bye[rank1]: hi\nC-level[rank0]: later\n"  # lines flushed unended, then another's
    assert rank_lines(ran_into, 0, final=True)[0] == b"bye\nC-level\nlater\n"
    assert rank_lines(ran_into, 1, final=True)[0] == b"hi\nC-level\n"


# Each rank prints its own lines, one of them to stderr; rank 0 ends without a newline.
SCRIPT = """import os, sys
rank = int(os.environ["RANK"])
print(f"hello from rank {rank}")
print(f"rank {rank} to stderr", file=sys.stderr)
print(f"bye from rank {rank}", end="" if rank == 0 else "\\n")
"""


def test_logs_mark_each_ranks_lines_and_rank_and_follow_pick_one(postgres_url, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "ranks.py").write_text(SCRIPT)
    with live_stack(postgres_url, tmp_path / "data", name="rankout", allow_entrypoints=True) as stack:
        trainjobs = stack_cli(stack, cwd=project, config=tmp_path / "config.toml")

        beyond = trainjobs("run", "--nproc-per-node", "2", "--follow", "--rank", "2", "--", "ranks.py")
        assert beyond.returncode == 2 and "--rank 2: the job has world size 2" in beyond.stdout, beyond.stdout
        followed = trainjobs("run", "--nproc-per-node", "2", "--follow", "--", "ranks.py")
        assert followed.returncode == 0, followed.stdout + followed.stderr
        job_id = re.search(r"submitted ([0-9a-f]{20})", followed.stdout)[1]
        every, one, other = trainjobs("logs", job_id), trainjobs("logs", job_id, "--rank", "1"), \
            trainjobs("logs", job_id, "--rank", "7")
        single = trainjobs("run", "--follow", "--", "ranks.py")
        with stack.client() as api:
            bad = api.get(f"/v1/jobs/{job_id}/logs", params={"rank": "abc"})
            single_log = api.get(f"/v1/jobs/{re.search(r'submitted ([0-9a-f]{20})', single.stdout)[1]}/logs").text
    # run --follow: rank 0's lines (its last one unended until the job was) and none of rank 1's
    assert "hello from rank 0" in followed.stdout and "bye from rank 0" in followed.stdout, followed.stdout
    assert "rank 0 to stderr" in followed.stdout and "rank 1" not in followed.stdout, followed.stdout
    assert "[rank0]" not in followed.stdout
    for rank in (0, 1):  # (rank 0's unended last line may run into one of rank 1's: not a line of its own)
        assert f"[rank{rank}]: hello from rank {rank}\n" in every.stdout, every.stdout
        assert f"[rank{rank}]: rank {rank} to stderr\n" in every.stdout, every.stdout
    assert "[rank1]: bye from rank 1\n" in every.stdout and "[rank0]: bye from rank 0" in every.stdout, every.stdout
    assert "hello from rank 1\n" in one.stdout and "rank 1 to stderr\n" in one.stdout, one.stdout
    assert "rank 0" not in one.stdout and "[rank" not in one.stdout, one.stdout
    assert other.returncode == 2 and f"--rank 7: job {job_id} has world size 2" in other.stdout, other.stdout
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "rank"], bad.text
    assert single.returncode == 0 and "hello from rank 0" in single_log and "[rank" not in single_log, single_log


def test_a_failed_ranks_error_excerpt_is_its_own_lines_and_torchruns(tmp_path):
    failed = tmp_path / "torchelastic" / "none_x" / "attempt_0" / "1"
    failed.mkdir(parents=True)
    (failed / "error.json").write_text(json.dumps({"message": {
        "message": "KeyError: 'lr'", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1765000000"}}}))
    tail = ("[rank0]: step 10 loss 0.5\n[rank1]: Traceback (most recent call last):\n[rank1]: KeyError: 'lr'\n"
            "[rank0]: step 11 loss 0.4\nE1206 torch.distributed.elastic: failed (exitcode: 1) local_rank: 1\n")
    error = root_cause(tmp_path, 1, excerpt=tail, entrypoint=True)
    assert error["rank"] == 1 and error["type"] == "KeyError"
    assert error["excerpt"] == ("Traceback (most recent call last):\nKeyError: 'lr'\n"
                                "E1206 torch.distributed.elastic: failed (exitcode: 1) local_rank: 1\n")
    gang = root_cause(tmp_path, 1, excerpt=tail, entrypoint=True, nproc=2)  # a gang's node: global rank unknown
    assert gang["excerpt"] == tail
