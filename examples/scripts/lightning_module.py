"""An unmodified PyTorch Lightning module and Trainer: a small regression, DDP over the ranks torchrun starts.

    cd examples/scripts && trainjobs run --nproc-per-node 2 --follow -- lightning_module.py --steps 60

Nothing here knows trainjobs: the job still shows `train_loss`, `val_loss` and `epoch` at the steps Lightning's
logger gets them, its progress and ETA (estimated_stepping_batches) and a summary (trainjobs/capture). The one
trainjobs-aware line is the ModelCheckpoint's dirpath: in TRAINJOBS_CHECKPOINT_DIR, a retried or handed-back
attempt resumes from last.ckpt (and on the worker's SIGTERM, last.ckpt is saved as it stops).
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.01 * torch.randn(n, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this node
    checkpoints = ModelCheckpoint(dirpath=os.environ.get("TRAINJOBS_CHECKPOINT_DIR", "lightning-checkpoints"),
                                  save_last=True, every_n_train_steps=20)  # the one line for resuming
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=devices,
                        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // devices,
                        strategy="ddp" if devices > 1 else "auto", log_every_n_steps=args.log_every,
                        val_check_interval=20, check_val_every_n_epoch=None, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoints],
                        default_root_dir=os.environ.get("TRAINJOBS_ARTIFACTS_DIR", "."))
    trainer.fit(Regression(args.lr), DataLoader(data(4096, 0), batch_size=16, shuffle=True),
                DataLoader(data(256, 1), batch_size=64))
    if trainer.is_global_zero:
        print(f"lightning_module: done, {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
