"""service/jobfiles.py: the one way the host opens a job's files. Whatever a job plants (a link at any part, a
FIFO, a socket, a hard link, a file of another uid), the host gets a refusal that names it, at once, on kernels
with openat2 and on those without it."""

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from service import jobfiles
from service.settings import Settings
from worker import sandbox


@pytest.fixture(params=["openat2", "per-name"])
def kernel(request, monkeypatch):
    """Both ways of opening: openat2 where the kernel has it, else one name at a time with O_NOFOLLOW."""
    if request.param == "per-name":
        monkeypatch.setattr(jobfiles, "_has_openat2", False)
    elif jobfiles._openat2(os.open("/", os.O_RDONLY), "etc", os.O_RDONLY) is None:
        pytest.skip("this kernel has no openat2")
    return request.param


@pytest.fixture
def folder(tmp_path):
    """A job's folder with what a hostile job would leave in it."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "real.txt").write_text("the job's own")
    (tmp_path / "outside.txt").write_text("not the job's")
    (tmp_path / "a" / "link").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "a" / "dirlink").symlink_to("/etc")
    os.mkfifo(tmp_path / "a" / "fifo")
    os.link(tmp_path / "outside.txt", tmp_path / "a" / "hard")
    return tmp_path


def refusal(folder: Path, rel: str) -> str:
    with pytest.raises(jobfiles.Refused) as caught:
        jobfiles.read_bytes(folder, rel, limit=100)
    return str(caught.value)


def test_a_regular_file_is_read_and_every_planted_thing_is_refused_by_name(kernel, folder):
    assert jobfiles.read_bytes(folder, "a/b/real.txt", limit=100) == (b"the job's own", 13)
    assert jobfiles.read_bytes(folder, "a/b/real.txt", limit=3, offset=4) == (b"job", 13)
    assert refusal(folder, "a/link") == "a/link is a link"
    assert refusal(folder, "a/dirlink/passwd") == "a/dirlink/passwd is a link"
    assert refusal(folder, "a/hard") == "a/hard has another name (a hard link)"
    assert refusal(folder, "../outside.txt").endswith("is not a name inside the job's folder")
    assert refusal(folder, "/etc/passwd").endswith("is not a name inside the job's folder")
    with pytest.raises(FileNotFoundError):
        jobfiles.read_bytes(folder, "a/missing", limit=1)


def test_a_fifo_is_refused_at_once_without_waiting_for_a_writer(kernel, folder):
    started = time.monotonic()
    assert refusal(folder, "a/fifo") == "a/fifo is a FIFO"
    assert time.monotonic() - started < 1


def test_a_socket_and_a_device_are_refused(kernel, folder):
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(folder / "a" / "sock"))
        assert refusal(folder, "a/sock") == "a/sock is a socket"
    if os.geteuid() == 0:
        os.mknod(folder / "a" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        assert refusal(folder, "a/null") == "a/null is a device"


def test_a_file_of_another_uid_is_refused_where_owners_are_given(kernel, folder):
    path = folder / "a" / "b" / "real.txt"
    assert jobfiles.read_bytes(folder, "a/b/real.txt", limit=4, owners={os.geteuid()})[0] == b"the "
    with pytest.raises(jobfiles.Refused, match="belongs to uid"):
        jobfiles.read_bytes(folder, "a/b/real.txt", limit=4, owners={path.stat().st_uid + 1})


def test_find_walks_no_link(kernel, folder):
    (folder / "a" / "b" / "error.json").write_text("{}")
    (folder / "elsewhere").mkdir()
    (folder / "elsewhere" / "error.json").write_text("{}")
    (folder / "a" / "b" / "away").symlink_to(folder / "elsewhere")
    assert [str(p) for p in jobfiles.find(folder, "a", "error.json")] == ["a/b/error.json"]
    assert jobfiles.find(folder, "a/dirlink", "passwd") == []


def test_init_from_lends_the_checked_descriptor_and_refuses_a_link_named_by_its_place(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    support = sandbox.Support("/usr/bin/bwrap", own_uid=False, cgroup=None, network="private")
    job = "a" * 20
    folder = settings.resolved_storage_dir / "jobs" / job
    (folder / "artifacts").mkdir(parents=True)
    (folder / "checkpoints").mkdir()
    (folder / "artifacts" / "model.pt").write_bytes(b"weights")
    fd = sandbox.lend_init_source(support, settings, job, folder / "artifacts" / "model.pt")
    try:
        assert os.read(fd, 7) == b"weights"
    finally:
        os.close(fd)
    (folder / "checkpoints" / "step_00000001").symlink_to(tmp_path)
    with pytest.raises(jobfiles.Refused, match="checkpoints/step_00000001 is a link"):
        sandbox.lend_init_source(support, settings, job, folder / "checkpoints" / "step_00000001")
    (folder / "artifacts" / "model.pt").unlink()
    os.mkfifo(folder / "artifacts" / "model.pt")
    with pytest.raises(jobfiles.Refused, match="artifacts/model.pt is a FIFO"):
        sandbox.lend_init_source(support, settings, job, folder / "artifacts" / "model.pt")
