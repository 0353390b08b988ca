"""A plain torchrun DDP script that knows nothing of trainjobs: gloo, a tiny model, its loss printed.

    torchrun --standalone --nproc-per-node 2 examples/scripts/plain_ddp.py --steps 60

Under trainjobs (entrypoint mode) it runs unchanged; its output is the job's log.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    true_weights = torch.linspace(-1, 1, 8).unsqueeze(1)
    batches = torch.Generator().manual_seed(rank)  # each rank its own data

    for step in range(1, args.steps + 1):
        inputs = torch.randn(32, 8, generator=batches)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs @ true_weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"step {step}/{args.steps} loss {mean_loss.item() / world_size:.6f}", flush=True)

    if rank == 0:
        print("plain_ddp: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
