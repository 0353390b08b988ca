"""A folder's files into the store, for the worker: every regular file, no link followed nor stored.

NOTE: the ranks write the folders the worker uploads (checkpoints, artifacts), so a file in them may be a link
planted to make the worker (root) upload something else: every file is opened from its folder's descriptor as
service/jobfiles.py opens a job's files.
"""

import os
import stat
from collections.abc import Callable
from pathlib import Path

from service import jobfiles
from service.storage.store import Store

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def upload_tree(store: Store, parent: Path, name: str, key_of: Callable[[str], str], *,
                whole: bool = False, each: Callable[[], None] = lambda: None) -> dict[str, int]:
    """Every regular file under parent/name (links neither followed nor stored) as key_of(its path under it);
    returns each path and its size. FileNotFoundError if the folder is gone or, `whole`, a file of it went
    meanwhile (a checkpoint pruned under the upload must get no manifest). `each()` before every file."""
    top = os.open(parent, _DIR)
    try:
        fd = os.open(name, _DIR, dir_fd=top)
    finally:
        os.close(top)
    files = {}
    try:
        for folder, _, names, folder_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for file_name in sorted(names):
                try:
                    file_fd = jobfiles.open_beneath(folder_fd, file_name)
                except FileNotFoundError:
                    if whole:
                        raise
                    continue
                except OSError:  # Refused: a link, a FIFO, a socket, a hard link
                    continue
                with os.fdopen(file_fd, "rb") as file:
                    info = os.fstat(file_fd)
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    rel = Path(folder, file_name).as_posix().removeprefix("./")
                    each()
                    store.put_file(key_of(rel), file)
                    files[rel] = info.st_size
    finally:
        os.close(fd)
    return files
