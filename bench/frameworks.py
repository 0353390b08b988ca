"""What zero-code capture (trainjobs/capture) costs a training loop: step time with capture on / off.

For Hugging Face's Trainer and for Lightning, a driver runs under worker/user_main.py as an entrypoint job's rank
does (one process, rank 0, a metrics file), once with TRAINJOBS_CAPTURE=1 and once with 0, in alternating order
(on/off, off/on, ...), and times the steps from a callback of the driver's own (the same with capture on and off):
the 10th percentile of windows of `log_every` steps (each holds one logging step) past the first 20, per step, so
another process's burst on this shared machine moves it little. It also prints capture's own work per step, timed
in one process (its callbacks and a log every `log_every` steps): the cost with no noise around it. The models are the
examples' tiny ones, so a step is short (milliseconds on a CPU) and any per-step cost shows: a worst case.
Prints each pair and the median ratio of throughput on/off (= step time off/on; ≥ 0.99: capture costs under 1%
of a step), with its spread, and the ratio of the best (least disturbed) run of each side.

    python bench/frameworks.py [--pairs 7] [--steps 300] [--log-every 5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
USER_MAIN = ROOT / "worker" / "user_main.py"
EXAMPLES = ROOT / "examples" / "scripts"

# Per step: the 10th percentile of windows of log_every steps past the first WARMUP (a window holds one logging
# step): the windows no other process of this shared machine slowed down, on both sides alike.
REPORT = """
ticks = ticks[WARMUP:]
windows = sorted((ticks[i + log_every] - ticks[i]) / log_every for i in range(0, len(ticks) - log_every, log_every))
print("BENCH " + json.dumps({"step_s": windows[len(windows) // 10],
                             "mean_s": (ticks[-1] - ticks[0]) / (len(ticks) - 1)}), flush=True)
"""

HF = """
import json, os, sys, time
sys.path.insert(0, {examples!r})
from hf_trainer import Counting, VOCAB, LENGTH
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
steps, log_every, WARMUP = {steps}, {log_every}, 20
ticks = []

class Tick(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        ticks.append(time.perf_counter())

model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir=os.path.join(os.environ["TMPDIR"], "out"), max_steps=steps,
                         per_device_train_batch_size=8, logging_steps=log_every, save_strategy="no",
                         report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Counting(4096, seed=0), callbacks=[Tick()])
trainer.train()
"""

LIGHTNING = """
import json, sys, time
sys.path.insert(0, {examples!r})
import lightning as L
from torch.utils.data import DataLoader
from lightning_module import Regression, data
steps, log_every, WARMUP = {steps}, {log_every}, 20
ticks = []

class Tick(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ticks.append(time.perf_counter())

L.seed_everything(0, verbose=False)
trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, log_every_n_steps=log_every,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    logger=L.pytorch.loggers.CSVLogger(__import__("os").environ["TMPDIR"]), callbacks=[Tick()])
loader = DataLoader(data(4096, 0), batch_size=16, shuffle=True)
trainer.fit(Regression(1e-2), loader)
"""


def run_once(driver: Path, *, capture: bool, workdir: Path) -> float:
    """One run's seconds per step, under user_main as a rank runs it."""
    tmp = Path(tempfile.mkdtemp(dir=workdir))
    # No RANK / LOCAL_RANK: HF's accelerate would then want a process group; rank 0 is the default for both.
    env = {**os.environ, "TRAINJOBS_CAPTURE": "1" if capture else "0", "OMP_NUM_THREADS": "1",
           "TRAINJOBS_METRICS_FILE": str(tmp / "metrics.jsonl"), "TMPDIR": str(tmp)}
    out = subprocess.run([sys.executable, str(USER_MAIN), "script", str(driver)], capture_output=True, text=True,
                         env=env, timeout=600, cwd=tmp)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"{driver.name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    if capture and not (tmp / "metrics.jsonl").exists():
        raise SystemExit(f"{driver.name}: capture on, but nothing was captured")
    return json.loads(line[len("BENCH "):])["step_s"]


def measure(name: str, driver: Path, pairs: int, workdir: Path) -> float:
    ratios, best = [], {True: float("inf"), False: float("inf")}
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        times = {capture: run_once(driver, capture=capture, workdir=workdir) for capture in order}
        ratios.append(times[False] / times[True])
        best = {capture: min(best[capture], times[capture]) for capture in best}
        print(f"{name} pair {i + 1} ({'on, off' if order[0] else 'off, on'}): on {times[True] * 1e3:.2f} ms/step, "
              f"off {times[False] * 1e3:.2f} ms/step, off/on {ratios[-1]:.3f}", flush=True)
    median = statistics.median(ratios)
    print(f"{name}: step-time ratio off/on, median of {pairs}: {median:.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}); best run off / best run on: {best[False] / best[True]:.3f}", flush=True)
    return median


HOOKS = """
import json, os, sys, time, types
import torch
from trainjobs.capture import install
sink = install()
import transformers.trainer, lightning.pytorch  # patched on import
from trainjobs.capture import hf, lightning as capture_lightning
log_every, n = {log_every}, 20_000
hf_callback = hf.make_callback(transformers.TrainerCallback, sink)()
hf_callback.on_train_begin(None, types.SimpleNamespace(max_steps=n, global_step=0), None)
state, control = types.SimpleNamespace(global_step=0, max_steps=n), types.SimpleNamespace()
start = time.perf_counter()
for step in range(1, n + 1):
    state.global_step = step
    hf_callback.on_step_end(None, state, control)
    if step % log_every == 0:
        hf_callback.on_log(None, state, control, logs={{"loss": 0.5, "grad_norm": 1.0, "learning_rate": 1e-3,
                                                       "epoch": step / 100}})
hf_us = (time.perf_counter() - start) / n * 1e6
run = capture_lightning.Run(sink, ())
trainer = types.SimpleNamespace(global_step=0, current_epoch=0, estimated_stepping_batches=n,
                                fit_loop=types.SimpleNamespace(epoch_loop=types.SimpleNamespace(_batches_that_stepped=0)))
run.start(trainer)
loss = torch.tensor(0.5)
start = time.perf_counter()
for step in range(1, n + 1):
    trainer.global_step = trainer.fit_loop.epoch_loop._batches_that_stepped = step
    run.stepped(trainer)
    if step % log_every == 0:
        capture_lightning.record(sink, trainer, {{"train_loss": loss}}, None)
pl_us = (time.perf_counter() - start) / n * 1e6
print("BENCH " + json.dumps({{"transformers_us": hf_us, "lightning_us": pl_us}}), flush=True)
"""


def hook_cost(log_every: int, workdir: Path) -> dict:
    """capture's own work per step (its callbacks, and a log every `log_every` steps), in one process: µs."""
    driver = workdir / "hooks_driver.py"
    driver.write_text(HOOKS.format(log_every=log_every))
    env = {**os.environ, "TRAINJOBS_METRICS_FILE": str(workdir / "hooks.jsonl"), "TRAINJOBS_CAPTURE": "1"}
    out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"hook cost failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("BENCH "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--only", choices=("transformers", "lightning"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as folder:
        workdir = Path(folder)
        results = {}
        for name, template in (("transformers", HF), ("lightning", LIGHTNING)):
            if args.only and args.only != name:
                continue
            driver = workdir / f"{name}_driver.py"
            driver.write_text(template.format(examples=str(EXAMPLES), steps=args.steps, log_every=args.log_every)
                              + REPORT)
            results[name] = measure(name, driver, args.pairs, workdir)
        hooks = hook_cost(args.log_every, workdir)
    print(f"capture's own work per step (a log every {args.log_every}): transformers "
          f"{hooks['transformers_us']:.2f} us, lightning {hooks['lightning_us']:.2f} us", flush=True)
    print(json.dumps({"steps": args.steps, "log_every": args.log_every, "ratio_off_on": results, "hook_us": hooks}))


if __name__ == "__main__":
    main()
