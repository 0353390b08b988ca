"""An unmodified training loop that logs to TensorBoard (SummaryWriter on rank 0), DDP over torchrun's ranks.

    cd examples/scripts && trainjobs run --nproc-per-node 2 --follow -- tensorboard_loop.py --steps 60

Nothing here knows trainjobs: the job still shows `loss`, `lr` and `weights/min`, `weights/max` (add_scalars) at
their global_step, and a summary of their last values at exit (trainjobs/capture). The event files go to the
job's artifacts (TRAINJOBS_ARTIFACTS_DIR), so `tensorboard --logdir` works on a download of them.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    model = DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    true_weights = torch.linspace(-1, 1, 8).unsqueeze(1)
    writer = SummaryWriter(os.path.join(os.environ.get("TRAINJOBS_ARTIFACTS_DIR", "."), "tensorboard")) \
        if rank == 0 else None
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if writer is not None and step % args.log_every == 0:
            writer.add_scalar("loss", loss.item(), step)
            writer.add_scalar("lr", schedule.get_last_lr()[0], step)
            weights = next(model.parameters()).detach()
            writer.add_scalars("weights", {"min": weights.min().item(), "max": weights.max().item()}, step)
    if writer is not None:
        writer.close()
        print(f"tensorboard_loop: done, {args.steps} steps, loss {loss.item():.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
