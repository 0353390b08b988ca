"""What a job's own image costs (issue 44): the pull and unpack, cold and warm, and the training step inside it.

1. Pull + unpack: tests/image_build.py's images (the small `python` image, and the `torch` image with the worker's
   real torch) pushed to Debian's docker-registry on loopback, then worker/images.py's ImageCache.get: cold (an
   empty cache: the manifest read, skopeo copy, umoci unpack) and warm (the image in the cache: the tag's manifest
   read again, no layer), alternating cold and warm rounds, each cold round in a fresh cache.
2. Step time: the built-in runtime on bench/throughput.py's spec (2 gloo ranks, MLP 256x3, 400 steps), sandboxed
   both ways, on the `torch` image's Python and torch vs the worker's own, alternating which goes first; the
   median step_time_s each run logged (its first record left out: warm-up), and the ratio image / worker.
3. Compute alone: a 256x256 matmul on one thread, sandboxed, in the image vs on the worker's Python, alternating:
   best and median of each (the step's arithmetic without gloo or the data loader).

    python bench/images.py [--pull-rounds 3] [--pairs 3] [--matmul-pairs 8]   (0: leave that part out)
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import SPEC as THROUGHPUT_SPEC  # noqa: E402
from service.settings import Settings  # noqa: E402
from tests import image_build  # noqa: E402
from trainjobs import runenv  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402
from worker import image_box, images, launch, sandbox  # noqa: E402

JOB_ID = "0123456789abcdef0123"
MATMUL = ("import time, torch; torch.set_num_threads(1); a, b = torch.randn(256, 256), torch.randn(256, 256)\n"
          "for _ in range(200): a @ b\n"
          "t = time.perf_counter()\nfor _ in range(3000): a @ b\nprint(1000 * (time.perf_counter() - t) / 3000)")
SPEC = {**THROUGHPUT_SPEC, "name": "bench-images"}


def pull_round(where: str, reference: str, data_dir: Path) -> tuple[float, float | None]:
    """(seconds to hold the image from this cache, the pull's own seconds: None where it was cached)."""
    cache = images.ImageCache(Settings(data_dir=data_dir, image_insecure_registries=where))
    t0 = time.perf_counter()
    image = cache.get(reference)
    took = time.perf_counter() - t0
    image.release()
    return took, image.pulled_s


def train_round(root: Path, n: int, support: sandbox.Support, cache: images.ImageCache | None,
                reference: str) -> float:
    """The median step time (s) of one run of SPEC, sandboxed, in the image `cache` holds (no cache: on the
    worker's Python). The image is held for the run, as an attempt holds it (its box releases it)."""
    image = cache.get(reference) if cache is not None else None
    settings = Settings(data_dir=root / "data")
    run_dir = root / "data" / "runs" / JOB_ID / f"attempt-{n}"
    job_dir = root / "data" / "storage" / "jobs" / JOB_ID
    for folder in (run_dir / "tmp", job_dir / "checkpoints", job_dir / "artifacts"):
        folder.mkdir(parents=True, exist_ok=True)
    spec = JobSpec.model_validate(SPEC)
    (run_dir / runenv.SPEC_FILE).write_text(spec.model_dump_json())
    python = "python3" if image is not None else sys.executable
    attempt = sandbox.Attempt(job_id=JOB_ID, run_dir=run_dir, job_dir=job_dir, python=python,
                              data_dir=settings.data_dir, scripts_dir=root / "data" / "scripts", image=image)
    plan = launch.render(spec, job_id=JOB_ID, attempt=n, run_dir=run_dir, python=python,
                         data_dir=settings.data_dir, job_dir=job_dir, shutdown_grace_s=5,
                         base_env=image_box.with_image_env(sandbox.job_env(settings), image), cpu_count=2)
    box = sandbox.Box(support, settings, attempt, memory_bytes=sandbox.default_memory_bytes())
    try:
        argv, env = box.wrap(plan.argv, plan.env)
        done = subprocess.run(argv, env=env, cwd=run_dir, capture_output=True, text=True, preexec_fn=box.preexec,
                              umask=box.umask, pass_fds=box.pass_fds)
    finally:
        box.close()
    where = "in the image" if image is not None else "on the worker's Python"
    if done.returncode != 0:
        raise RuntimeError(f"the run {where} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / runenv.METRICS_FILE).read_text().splitlines()]
    times = [r["metrics"]["step_time_s"] for r in records if r["type"] == "metrics" and "step_time_s" in r["metrics"]]
    return statistics.median(times[1:])


def matmul_round(root: Path, n: int, support: sandbox.Support, cache: images.ImageCache | None,
                 reference: str) -> float:
    """Milliseconds per 256x256 matmul on one thread, sandboxed, in the image (no cache: the worker's Python):
    the step's compute alone, no gloo, no data loader."""
    image = cache.get(reference) if cache is not None else None
    settings = Settings(data_dir=root / "data")
    run_dir, job_dir = root / "matmul" / f"run-{n}", root / "matmul" / "job"
    for folder in (run_dir / "tmp", job_dir / "checkpoints", job_dir / "artifacts"):
        folder.mkdir(parents=True, exist_ok=True)
    python = "python3" if image is not None else sys.executable
    box = sandbox.Box(support, settings, sandbox.Attempt(
        job_id=JOB_ID, run_dir=run_dir, job_dir=job_dir, python=python, data_dir=settings.data_dir,
        scripts_dir=root / "data" / "scripts", image=image), memory_bytes=None)
    try:
        argv, env = box.wrap([python, "-c", MATMUL], image_box.with_image_env(sandbox.job_env(settings), image))
        done = subprocess.run(argv, env=env, capture_output=True, text=True, preexec_fn=box.preexec,
                              pass_fds=box.pass_fds)
    finally:
        box.close()
    if done.returncode != 0:
        raise RuntimeError(f"the matmul round exited {done.returncode}: {done.stderr[-2000:]}")
    return float(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pull-rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--matmul-pairs", type=int, default=8)
    args = parser.parse_args()
    support = sandbox.detect(Settings())
    if not support.on:
        raise SystemExit(f"no sandbox here: {support.why_not}")
    if image_build.MISSING:
        raise SystemExit(f"needs {', '.join(image_build.MISSING)}")
    python_layout, _ = image_build.build()
    torch_layout = image_build.build_torch()
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-images-") as tmp:
        root = Path(tmp)
        (root / "registry").mkdir()
        served = {"bench/py:1": f"{python_layout}:image", "bench/torch:1": f"{torch_layout}:image"}
        with image_build.serving_registry(root / "registry", served) as (where, _):
            for name in served if args.pull_rounds else ():
                reference = f"{where}/{name}"
                cold, pulled, warm = [], [], []
                for i in range(args.pull_rounds):
                    fresh = root / f"pull-{name.replace('/', '-').replace(':', '-')}-{i}"
                    took, pull_s = pull_round(where, reference, fresh)
                    cold.append(took)
                    pulled.append(pull_s)
                    warm.append(pull_round(where, reference, fresh)[0])
                    subprocess.run(["rm", "-rf", str(fresh)], check=True)
                size = sum(p.stat().st_size for p in (Path(served[name].rsplit(":", 1)[0]) / "blobs").rglob("*")
                           if p.is_file())
                print(f"{name} ({size / 1e6:.0f} MB of blobs): cold median {statistics.median(cold):.2f} s "
                      f"({', '.join(f'{c:.2f}' for c in cold)}), warm median {statistics.median(warm):.3f} s "
                      f"({', '.join(f'{w:.3f}' for w in warm)}); cold / warm "
                      f"{statistics.median(cold) / statistics.median(warm):.0f}x")

            cache = images.ImageCache(Settings(data_dir=root / "cache", image_insecure_registries=where))
            reference = f"{where}/bench/torch:1"
            cache.get(reference).release()  # pulled before the pairs: they time the steps alone
            ratios = []
            for i in range(args.pairs):
                order = (True, False) if i % 2 == 0 else (False, True)
                step = {boxed: train_round(root, 10 + 2 * i + boxed, support, cache if boxed else None, reference)
                        for boxed in order}
                ratios.append(step[True] / step[False])
                print(f"pair {i + 1} ({'image first' if order[0] else 'worker first'}): worker's Python "
                      f"{1000 * step[False]:.2f} ms/step, image {1000 * step[True]:.2f} ms/step, "
                      f"ratio {ratios[-1]:.3f}")
            if ratios:
                print(f"step time image / worker's Python: median {statistics.median(ratios):.3f}, geometric mean "
                      f"{statistics.geometric_mean(ratios):.3f} over {args.pairs} pairs")
            took: dict[bool, list[float]] = {True: [], False: []}
            for i in range(args.matmul_pairs):
                for boxed in ((True, False) if i % 2 == 0 else (False, True)):
                    took[boxed].append(matmul_round(root, 2 * i + boxed, support, cache if boxed else None,
                                                    reference))
            if args.matmul_pairs:
                print(f"matmul 256x256, 1 thread, {args.matmul_pairs} alternating pairs: image best "
                      f"{min(took[True]):.3f} ms, median {statistics.median(took[True]):.3f}; worker's Python best "
                      f"{min(took[False]):.3f}, median {statistics.median(took[False]):.3f}; image / worker: best "
                      f"{min(took[True]) / min(took[False]):.3f}, median "
                      f"{statistics.median(took[True]) / statistics.median(took[False]):.3f}")

if __name__ == "__main__":
    main()
