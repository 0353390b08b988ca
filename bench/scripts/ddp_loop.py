"""A plain user's DDP loop (no trainjobs reporting): the entrypoint row of bench/throughput.py.

Runs for --seconds of training after a warm-up, then rank 0 prints one line the bench reads:
    ddp_loop: STEPS steps in SECONDS s, RATE steps/s
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=5.0)
parser.add_argument("--warmup", type=int, default=20)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                              nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 64), torch.randn(64, 1)


def step() -> None:
    optimizer.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


for _ in range(args.warmup):
    step()
# Every rank runs the same number of steps: rank 0 decides when the time is up, and tells the others.
steps, started, done = 0, time.perf_counter(), torch.zeros(1)
while True:
    for _ in range(10):
        step()
    steps += 10
    done[0] = float(dist.get_rank() == 0 and time.perf_counter() - started >= args.seconds)
    dist.broadcast(done, src=0)
    if done[0]:
        break
elapsed = time.perf_counter() - started
if int(os.environ.get("RANK", 0)) == 0:
    print(f"ddp_loop: {steps} steps in {elapsed:.3f} s, {steps / elapsed:.2f} steps/s", flush=True)
dist.barrier()  # NOTE: without it gloo may abort one rank in teardown ("terminate called without an active exception")
dist.destroy_process_group()
