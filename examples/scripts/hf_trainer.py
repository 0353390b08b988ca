"""An unmodified Hugging Face `Trainer` fine-tune: a tiny GPT-2 built from a config (no download), synthetic data.

    cd examples/scripts && trainjobs run --nproc-per-node 2 --follow -- hf_trainer.py --steps 40

Nothing here knows trainjobs: the job still shows `loss`, `grad_norm`, `learning_rate`, `eval_loss` at their
steps, its progress and ETA (max_steps) and a summary (trainjobs/capture). The one trainjobs-aware line is
`output_dir`: in TRAINJOBS_CHECKPOINT_DIR, a retried or handed-back attempt resumes from the newest checkpoint-N.
Runs as it is anywhere else too (`python hf_trainer.py`, `torchrun --nproc-per-node 2 hf_trainer.py`).
"""

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, LENGTH = 64, 32


class Counting(torch.utils.data.Dataset):
    """Sequences that count up from a random start (mod VOCAB): a pattern a tiny model learns in a few steps."""

    def __init__(self, size: int, seed: int):
        self.starts = torch.randint(0, VOCAB, (size,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = (self.starts[i] + torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--report-to", default="none")
    args = parser.parse_args()

    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=os.environ.get("TRAINJOBS_CHECKPOINT_DIR", "hf-trainer-out"),  # the one line for resuming
        max_steps=args.steps, learning_rate=args.lr, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        logging_steps=args.log_every, eval_strategy="steps", eval_steps=args.steps // 2,
        save_steps=args.save_every, save_total_limit=2, report_to=args.report_to, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Counting(2048, seed=0),
                      eval_dataset=Counting(64, seed=1))
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"hf_trainer: done, {result.global_step} steps, train loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
