"""A torchrun DDP script that reports to trainjobs: metrics, progress, a summary and its model as an artifact.

    torchrun --standalone --nproc-per-node 2 examples/scripts/reported_ddp.py --steps 60

trainjobs.report is a no-op outside the service, so this runs under a bare torchrun too.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainjobs import artifacts_dir, report, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--report-every", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    true_weights = torch.linspace(-1, 1, 8).unsqueeze(1)
    batches = torch.Generator().manual_seed(rank)  # each rank its own data

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs = torch.randn(32, 8, generator=batches)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs @ true_weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.report_every == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # a collective: every rank takes part, only rank 0 writes
            mean_loss = mean_loss.item() / world_size
            report(step=step, total_steps=args.steps, loss=mean_loss, lr=args.lr)
            if rank == 0:
                print(f"step {step}/{args.steps} loss {mean_loss:.6f}", flush=True)

    if rank == 0:
        summary(final_loss=mean_loss, steps=args.steps, world_size=world_size,
                wall_time_s=time.perf_counter() - started)
        if (out := artifacts_dir()) is not None:
            torch.save(model.module.state_dict(), out / "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
