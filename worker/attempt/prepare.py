"""Stage 2, prepare: the attempt's code (its package, script, requirements, init_from), its folders, and the
command line and environment torchrun is started with (its share's GPUs, cores and threads in it)."""

import os
from dataclasses import dataclass, field
from pathlib import Path

from service.packages.service import package_file
from service.settings import Settings
from service.storage import StoreUnavailable
from trainjobs import paths
from trainjobs.spec import JobSpec, read_requirements, requirement_problem
from trainjobs.states import ErrorType
from worker import environments, image_box, image_pull, images, launch, packages, sandbox, store_init, store_sync
from worker.attempt.place import Placed
from worker.lease import Lease

# What refuses a job before anything of it starts: it fails, the worker goes on.
REFUSALS = (launch.EntrypointRefused, packages.PackageUnavailable, packages.UnsafeArchive,
            environments.RequirementsFailed, images.ImageUnavailable, images.ImageUnusable)


@dataclass(frozen=True)
class Code:
    """What the attempt runs: where its script lies, the job's own folder (its package: its cwd), what it needs."""

    scripts_dir: Path
    code_dir: Path | None = None
    entry_script: Path | None = None
    requirements: list[str] = field(default_factory=list)
    init_from: Path | None = None
    init_job: str | None = None  # whose weights init_from are: the spec's init_from.job
    image: images.Image | None = None  # spec.image, pulled and checked: held until the attempt's box closes


def find_code(spec: JobSpec, settings: Settings, run_dir: Path, *, lease: Lease | None = None) -> Code:
    """The attempt's code, unpacked and checked; raises one of REFUSALS when the job cannot run here. `lease`:
    kept while init_from's weights are fetched from the store."""
    code_dir = unpack_package(spec, settings, run_dir)
    scripts_dir = code_dir or settings.resolved_scripts_dir
    entry_script = launch.check_entrypoint(spec, allowed=settings.allow_entrypoints, scripts_dir=scripts_dir)
    return Code(scripts_dir, code_dir, entry_script, requirements(spec, settings, code_dir),
                init_weights(spec, settings, lease=lease), spec.init_from.job if spec.init_from else None,
                pull_image(spec, settings, job_id=run_dir.parent.name, lease=lease))


def pull_image(spec: JobSpec, settings: Settings, *, job_id: str, lease: Lease | None = None) -> images.Image | None:
    """spec.image from this worker's cache (pulled on a miss), checked for python3 and torch; None without one."""
    if spec.image is None:
        return None
    support = sandbox.for_worker(settings)
    if not support.on:
        raise images.ImageUnavailable(f"this worker cannot run images: it makes no sandbox ({support.why_not})")
    image = images.ImageCache(settings).get(spec.image, image_pull.ForJob.of(settings, lease))  # its owner's login
    try:
        sandbox.check_image(support, settings, image, job_id=job_id, builtin=spec.entrypoint is None)
    except BaseException:
        image.release()
        raise
    return image


def refusal(exc: Exception) -> dict:
    """The job's error for one of REFUSALS."""
    if isinstance(exc, launch.EntrypointRefused):
        return {"type": exc.kind, "message": exc.message, "rank": None}
    if isinstance(exc, packages.PackageUnavailable):
        return {"type": ErrorType.PACKAGE_UNAVAILABLE, "message": str(exc), "rank": None}
    if isinstance(exc, packages.UnsafeArchive):
        return {"type": ErrorType.UNSAFE_PACKAGE, "message": f"the worker refused the job's package: {exc}",
                "rank": None}
    if isinstance(exc, images.ImageUnavailable):
        return {"type": ErrorType.IMAGE_UNAVAILABLE, "message": str(exc), "rank": None}
    if isinstance(exc, images.ImageUnusable):
        return {"type": ErrorType.IMAGE_UNUSABLE, "message": str(exc), "rank": None}
    return {"type": ErrorType.REQUIREMENTS_FAILED, "message": str(exc), "rank": None}


def unpack_package(spec: JobSpec, settings: Settings, run_dir: Path) -> Path | None:
    """The attempt's own copy of the job's package (from this machine's cache), or None without one.

    Only on a worker that runs users' code at all: elsewhere check_entrypoint refuses the job first."""
    entrypoint = spec.entrypoint
    if entrypoint is None or entrypoint.package is None or not settings.allow_entrypoints:
        return None
    cache = packages.PackageCache(settings.data_dir / "package-cache", max_bytes=settings.package_cache_bytes,
                                  max_files=settings.max_package_files,
                                  max_unpacked_bytes=settings.max_package_unpacked_bytes)
    code_dir = run_dir / "code"
    archive = package_file(settings.resolved_storage_dir, entrypoint.package)
    store_sync.fetch_package(settings, entrypoint.package, archive)  # issue 31: from the store, where one is set
    packages.materialize(cache, digest=entrypoint.package, dest=code_dir, archive=archive)
    return code_dir


def requirements(spec: JobSpec, settings: Settings, code_dir: Path | None) -> list[str]:
    """The job's requirement lines: the spec's list, or read from the file it names in the package."""
    entrypoint = spec.entrypoint
    if entrypoint is None or not entrypoint.requirements:
        return []
    if not settings.allow_pip:
        raise launch.EntrypointRefused(ErrorType.ENTRYPOINT_DISABLED, "this worker does not install a job's "
                                       "requirements; start it with TRAINJOBS_ALLOW_PIP=1 to allow them")
    if isinstance(entrypoint.requirements, list):
        return entrypoint.requirements
    name = entrypoint.requirements
    path = (code_dir / name).resolve() if code_dir is not None else None
    if path is None or not path.is_relative_to(code_dir.resolve()) or not path.is_file():
        raise environments.RequirementsFailed(f"entrypoint.requirements names {name!r}, which is not a file "
                                              "in the job's package")
    lines = read_requirements(path.read_text(errors="replace"))
    for number, line in enumerate(lines, 1):
        if problem := requirement_problem(line):
            raise environments.RequirementsFailed(f"{name}: requirement {number} {line!r}: {problem}")
    return lines


def init_weights(spec: JobSpec, settings: Settings, *, lease: Lease | None = None) -> Path | None:
    """spec.init_from's weights as they are now (the latest checkpoint at this launch), in this machine's storage
    dir: fetched from the store where one is set and the dir lacks them; None without init_from."""
    if spec.init_from is None:
        return None
    try:
        source = store_init.fetch_init_source(settings, spec.init_from.job, spec.init_from.checkpoint, lease=lease)
    except StoreUnavailable as exc:  # an outage, not the job's fault: retried as any other
        raise launch.EntrypointRefused(ErrorType.STORE_UNAVAILABLE, f"init_from: {exc.message}: the weights of job "
                                       f"{spec.init_from.job} could not be fetched within "
                                       f"store_wait_s={settings.store_wait_s:g}s") from None
    if source is None:
        raise launch.EntrypointRefused(ErrorType.INIT_FROM_UNAVAILABLE, f"init_from: job {spec.init_from.job} has "
                                       f"no {spec.init_from.checkpoint} weights any more (deleted, or collected by "
                                       "retention)")
    try:  # checked here, so a planted link fails the job before anything starts; lent (checked again) at launch
        os.close(sandbox.lend_init_source(sandbox.for_worker(settings), settings, spec.init_from.job, source))
    except OSError as exc:  # Refused: a link, a FIFO, a file not the job's
        raise launch.EntrypointRefused(ErrorType.INIT_FROM_UNAVAILABLE, f"init_from: job {spec.init_from.job}'s "
                                       f"{exc}; the worker lends only the job's own regular files") from None
    return source


def make_dirs(*, job_dir: Path, run_dir: Path, attempt: int) -> None:
    """The job's checkpoints and artifacts (a user's script may write straight into them), the run's tmp, and the
    job's OWNER: a stale attempt's ranks then write no checkpoint."""
    for folder in (paths.CHECKPOINTS, paths.ARTIFACTS):
        (job_dir / folder).mkdir(parents=True, exist_ok=True)
    (job_dir / "OWNER").write_text(str(attempt))
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)


def render(spec: JobSpec, settings: Settings, *, job_id: str, attempt: int, run_dir: Path, job_dir: Path,
           python: str, code: Code, placed: Placed, gang: launch.Gang | None,
           environ: dict[str, str] | None = None) -> launch.Launch:
    """torchrun's command line and environment: the worker's variables a job gets (`environ`: this process's by
    default) and its image's Env, its own GPUs visible, OMP_NUM_THREADS from its cores' share."""
    if code.image is not None:
        python = "python3"  # the image's, found on its PATH inside the sandbox
    return launch.render(
        spec, job_id=job_id, attempt=attempt, run_dir=run_dir, python=python, data_dir=settings.data_dir,
        job_dir=job_dir, shutdown_grace_s=settings.cancel_grace_s,
        base_env=placed.env(image_box.with_image_env(sandbox.job_env(settings, environ), code.image)),
        cpu_count=len(placed.cores) or os.cpu_count() or 1,
        scripts_dir=code.scripts_dir, entry_script=code.entry_script, gang=gang, init_from=code.init_from,
    )
