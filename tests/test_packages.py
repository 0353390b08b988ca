"""Working-directory packages: packing, the archive checks, the /v1/packages routes and a worker's cache."""

import io
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest

from service.packages.service import package_file
from tests.conftest import mlp_spec
from tests.test_auth import make_token
from trainjobs import packing
from trainjobs.packing import UnsafeArchive, check_archive, pack
from worker import packages as worker_packages

LIMITS = {"max_files": 100, "max_unpacked_bytes": 10 * 2**20}
GiB = 2**30


def project(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "model" / "__init__.py").write_text("WIDTH = 8\n")
    (root / "data.bin").write_bytes(os.urandom(2048))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "runs" / "old").mkdir(parents=True)
    (root / "runs" / "old" / "ckpt.pt").write_bytes(b"x" * 100)
    (root / "notes.log").write_text("noise\n")
    (root / "keep.log").write_text("kept\n")
    (root / ".trainjobsignore").write_text("# outputs\nruns/\n*.log\n!keep.log\n/data.bin\n")
    return root


def names(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return tar.getnames()


# --- packing -----------------------------------------------------------------------------------------------------

def test_packing_is_deterministic_and_honours_the_ignore_file(tmp_path):
    first = project(tmp_path / "a")
    with pack(first) as one:
        assert packing.DIGEST.match(one.digest) and one.size == one.path.stat().st_size
        assert names(one.path) == [".trainjobsignore", "keep.log", "model", "model/__init__.py", "train.py"]
        digest = one.digest
    assert not one.path.exists()  # a temporary file
    time.sleep(0.01)
    second = project(tmp_path / "b")  # the same files, written later by someone else
    os.utime(second / "train.py", (1, 1))
    with pack(second) as two:
        assert two.digest == digest
    (second / "train.py").write_text("print('changed')\n")
    with pack(second) as three:
        assert three.digest != digest


def test_an_unchanged_folder_is_known_by_its_fingerprint_without_packing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = project(tmp_path / "p")
    key = packing.fingerprint(folder)
    assert packing.known_digest(key) is None
    with pack(folder) as packed:
        packing.remember_digest(key, packed.digest)
    assert packing.known_digest(packing.fingerprint(folder)) == packed.digest
    (folder / "notes.log").write_text("ignored: changes nothing\n")
    assert packing.fingerprint(folder) == key
    (folder / "train.py").write_text("print('edited')\n")
    assert packing.fingerprint(folder) != key


def test_a_link_out_of_the_folder_is_refused_at_packing(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    (root / "etc").symlink_to("/etc")
    with pytest.raises(UnsafeArchive, match="etc is a link to /etc"), pack(root):
        pass


# --- the archive checks (the API's at upload, the worker's before unpacking) -------------------------------------

def archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def member(name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


class Zeros(io.RawIOBase):
    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> bytes:
    """A real 1 GiB file of zeros, gzipped (about 4.5 MB): built streaming, never 1 GiB in memory or on disk."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as tar:
        info = member("zeros.bin")
        info.size = GiB
        tar.addfile(info, io.BufferedReader(Zeros(GiB), buffer_size=1 << 20))
    return out.getvalue()


UNSAFE = {
    "dotdot": (archive((member("../x"), b"x")), "'../x' is an absolute path or leaves the folder"),
    "absolute": (archive((member("/etc/x"), b"x")), "'/etc/x' is an absolute path or leaves the folder"),
    "symlink_to_root": (archive((member("root", tarfile.SYMTYPE, "/"), None)), "'root' is a link to '/'"),
    "symlink_climbing": (archive((member("a/up", tarfile.SYMTYPE, "../../x"), None)), "'a/up' is a link"),
    "hardlink_out": (archive((member("h", tarfile.LNKTYPE, "../../etc/passwd"), None)), "'h' is a hard link"),
    "device": (archive((member("dev", tarfile.CHRTYPE), None)), "'dev' is a device"),
    "too_many": (archive(*[(member(f"f{i}"), b"") for i in range(101)]), "more than 100 files"),
    "not_a_tar": (b"just some bytes", "not a gzipped tar archive"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_an_unsafe_archive_is_refused_naming_the_member(case):
    body, says = UNSAFE[case]
    with pytest.raises(UnsafeArchive) as refused:
        check_archive(io.BytesIO(body), **LIMITS)
    assert says in str(refused.value)


def test_a_gigabyte_of_zeros_is_refused_at_its_header_without_unpacking(bomb, tmp_path):
    assert len(bomb) < 10 * 2**20
    started = time.monotonic()
    with pytest.raises(UnsafeArchive, match="unpacks to more than 10485760 bytes .*'zeros.bin' alone is 1073741824"):
        check_archive(io.BytesIO(bomb), **LIMITS)
    assert time.monotonic() - started < 1.0  # the header says it: no gigabyte is inflated
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(bomb)
    with pytest.raises(UnsafeArchive):
        packing.unpack(path, tmp_path / "out", **LIMITS)
    assert not (tmp_path / "out").exists()


def test_safe_links_inside_the_folder_pass_and_unpack(tmp_path):
    body = archive((member("a/f"), b"data"), (member("a/link", tarfile.SYMTYPE, "f"), None),
                   (member("hard", tarfile.LNKTYPE, "a/f"), None))
    assert check_archive(io.BytesIO(body), **LIMITS).files == 3
    path = tmp_path / "ok.tar.gz"
    path.write_bytes(body)
    packing.unpack(path, tmp_path / "out", **LIMITS)
    assert (tmp_path / "out" / "a" / "link").read_text() == "data" == (tmp_path / "out" / "hard").read_text()


# --- the API -----------------------------------------------------------------------------------------------------

def put(client, body: bytes, digest: str | None = None, headers: dict | None = None):
    digest = digest or packing_digest(body)
    return client.put(f"/v1/packages/{digest}", content=body, headers=headers or {})


def packing_digest(body: bytes) -> str:
    import hashlib

    return f"sha256:{hashlib.sha256(body).hexdigest()}"


def stored_files(settings) -> list[str]:
    folder = settings.resolved_storage_dir / "packages"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_upload_once_then_it_is_there_and_a_spec_may_name_it(client, settings, tmp_path):
    with pack(project(tmp_path / "p")) as packed:
        body = packed.path.read_bytes()
    digest = packing_digest(body)
    assert client.head(f"/v1/packages/{digest}").status_code == 404
    first = put(client, body)
    assert first.status_code == 201, first.text
    assert first.json()["digest"] == digest and first.json()["size"] == len(body) and first.json()["files"] == 5
    assert put(client, body).status_code == 200  # already there
    assert client.head(f"/v1/packages/{digest}").status_code == 200
    assert client.get(f"/v1/packages/{digest}").json()["files"] == 5
    assert client.get("/v1/packages").json()["count"] == 1
    assert package_file(settings.resolved_storage_dir, digest).read_bytes() == body
    spec = mlp_spec(model=None, data=None, entrypoint={"package": digest, "script": "train.py"})
    assert client.post("/v1/jobs", json=spec).status_code == 201
    assert client.delete(f"/v1/packages/{digest}").status_code == 204
    assert stored_files(settings) == [] and client.head(f"/v1/packages/{digest}").status_code == 404


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink_to_root", "hardlink_out", "device"])
def test_an_unsafe_upload_is_a_422_naming_the_member_and_nothing_is_stored(client, settings, case):
    body, says = UNSAFE[case]
    response = put(client, body)
    assert response.status_code == 422 and says in response.json()["detail"], response.text
    assert client.head(f"/v1/packages/{packing_digest(body)}").status_code == 404
    assert stored_files(settings) == []


def test_a_gigabyte_bomb_upload_is_a_422_and_nothing_is_stored(client, settings, bomb):
    response = put(client, bomb)
    assert response.status_code == 422 and "zeros.bin" in response.json()["detail"], response.text
    assert stored_files(settings) == []


def test_a_body_that_is_not_its_name_is_a_422_and_nothing_is_stored(client, settings, tmp_path):
    body = archive((member("train.py"), b"print(1)\n"))
    other = packing_digest(b"something else")
    response = put(client, body, digest=other)
    assert response.status_code == 422 and packing_digest(body).removeprefix("sha256:") in response.text
    assert client.head(f"/v1/packages/{other}").status_code == 404 and stored_files(settings) == []
    assert client.put("/v1/packages/sha256:XYZ", content=body).status_code == 422  # not a digest


def test_a_body_over_the_cap_is_a_413_declared_or_not(client, settings):
    big = archive((member("data.bin"), os.urandom(200_000)))
    settings.max_package_bytes = 100_000
    try:
        declared = put(client, big)
        assert declared.status_code == 413 and "TRAINJOBS_MAX_PACKAGE_BYTES" in declared.text

        def chunks():  # no Content-Length: streamed, refused once past the cap
            for i in range(0, len(big), 16384):
                yield big[i:i + 16384]

        streamed = client.put(f"/v1/packages/{packing_digest(big)}", content=chunks())
        assert streamed.status_code == 413, streamed.text
    finally:
        settings.max_package_bytes = 100 * 2**20
    assert stored_files(settings) == []


def test_the_owners_quota_is_a_413(client, settings):
    settings.quota_package_bytes = 150_000
    try:
        assert put(client, archive((member("a"), os.urandom(100_000)))).status_code == 201
        over = put(client, archive((member("b"), os.urandom(100_000))))
        assert over.status_code == 413 and "TRAINJOBS_QUOTA_PACKAGE_BYTES" in over.text
    finally:
        settings.quota_package_bytes = GiB
    assert client.get("/v1/packages").json()["count"] == 1


def test_another_owners_package_is_a_404_everywhere(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice', can_run_entrypoints=True)}"}
    bob = {"Authorization": f"Bearer {make_token(settings, 'bob', can_run_entrypoints=True)}"}
    body = archive((member("train.py"), b"print('alice')\n"))
    digest = packing_digest(body)
    assert put(client, body, headers=alice).status_code == 201
    assert client.head(f"/v1/packages/{digest}", headers=bob).status_code == 404
    assert client.get(f"/v1/packages/{digest}", headers=bob).status_code == 404
    assert client.get("/v1/packages", headers=bob).json()["count"] == 0
    spec = mlp_spec(model=None, data=None, entrypoint={"package": digest, "script": "train.py"})
    refused = client.post("/v1/jobs", json=spec, headers=bob)
    assert refused.status_code == 404 and refused.json()["field"] == "entrypoint.package"
    assert client.delete(f"/v1/packages/{digest}", headers=bob).status_code == 404
    assert client.post("/v1/jobs", json=spec, headers=alice).status_code == 201
    # bob uploading the same bytes gets his own (the file is kept once)
    assert put(client, body, headers=bob).status_code == 201
    assert client.delete(f"/v1/packages/{digest}", headers=alice).status_code == 204
    assert client.head(f"/v1/packages/{digest}", headers=bob).status_code == 200
    assert package_file(settings.resolved_storage_dir, digest).exists()


def test_uploading_needs_the_right_to_run_ones_own_code(client, settings):
    carol = {"Authorization": f"Bearer {make_token(settings, 'carol')}"}
    response = put(client, archive((member("train.py"), b"")), headers=carol)
    assert response.status_code == 403 and response.json()["field"] == "entrypoint"


# --- a worker's cache --------------------------------------------------------------------------------------------

def cache_of(tmp_path: Path, max_bytes: int = GiB) -> worker_packages.PackageCache:
    return worker_packages.PackageCache(tmp_path / "cache", max_bytes=max_bytes, **LIMITS)


def stored_package(tmp_path: Path, name: str, size: int = 1000) -> tuple[str, Path]:
    body = archive((member(f"{name}/train.py"), b"print(1)\n"), (member(f"{name}/blob"), os.urandom(size)))
    path = tmp_path / f"{name}.tar.gz"
    path.write_bytes(body)
    return packing_digest(body), path


def test_two_attempts_racing_for_one_package_see_one_whole_folder(tmp_path):
    digest, path = stored_package(tmp_path, "p", size=2_000_000)
    cache, got, errors = cache_of(tmp_path), [], []

    def use():
        try:
            got.append(cache.get(digest, path))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(got)) == 1
    assert (got[0] / "p" / "blob").stat().st_size == 2_000_000
    assert [p.name for p in cache.root.iterdir() if p.is_dir()] == [digest.removeprefix("sha256:")]  # no leftovers


def test_each_attempt_runs_in_its_own_copy(tmp_path):
    digest, path = stored_package(tmp_path, "p")
    cache = cache_of(tmp_path)
    worker_packages.materialize(cache, digest=digest, archive=path, dest=tmp_path / "run1")
    (tmp_path / "run1" / "p" / "train.py").write_text("changed by the run\n")
    worker_packages.materialize(cache, digest=digest, archive=path, dest=tmp_path / "run2")
    assert (tmp_path / "run2" / "p" / "train.py").read_text() == "print(1)\n"


def test_the_cache_evicts_the_least_recently_used_past_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_packages, "EVICT_GRACE_S", 0.0)
    cache = cache_of(tmp_path, max_bytes=2500)
    a, b, c = (stored_package(tmp_path, n) for n in "abc")
    cache.get(*a)
    cache.get(*b)
    os.utime(cache.root / f"{a[0].removeprefix('sha256:')}.used", (time.time() - 100,) * 2)  # a: long unused
    cache.get(*c)  # 3 x ~1000 bytes > 2500: a goes
    left = sorted(p.name for p in cache.root.iterdir() if p.is_dir())
    assert left == sorted(d.removeprefix("sha256:") for d, _ in (b, c))


def test_a_missing_package_file_is_a_clear_error(tmp_path):
    with pytest.raises(worker_packages.PackageUnavailable, match="not in the storage folder"):
        cache_of(tmp_path).get("sha256:" + "0" * 64, tmp_path / "gone.tar.gz")


def test_a_package_never_holds_a_stacks_data_dir_secrets_or_database(tmp_path):
    """`trainjobs up` run in the folder a user then packs (the new-user walkthrough found its admin token and live
    SQLite file inside the job): whatever their names, those folders and files stay out."""
    project = tmp_path / "proj"
    (project / "trainjobs-data" / "runs").mkdir(parents=True)
    (project / "trainjobs-data" / "trainjobs.db").write_text("db")
    (project / "trainjobs-data-secrets").mkdir()
    (project / "trainjobs-data-secrets" / "admin.token").write_text("tj_secret")
    (project / "mystack" / "runs").mkdir(parents=True)  # a data dir under another name: runs/ beside storage/
    (project / "mystack" / "storage").mkdir()
    (project / "keys").mkdir()
    (project / "keys" / "admin.token").write_text("tj_secret")
    (project / "trainjobs.db").write_text("db")
    (project / "train.py").write_text("print('hi')\n")
    (project / "data").mkdir()
    (project / "data" / "points.csv").write_text("1,2\n")
    assert [name for name, _ in packing.walk(project)] == ["data", "data/points.csv", "train.py"]
