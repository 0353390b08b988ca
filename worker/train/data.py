"""The dataset registry: synthetic sets made from a seed, and byte-level text from a local file."""

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from trainjobs.paths import resolve_data_path
from trainjobs.spec import DataConfig, JobSpec


@dataclass(frozen=True)
class DataInfo:
    task: str  # regression | classification | lm
    input_dim: int = 0
    output_dim: int = 0
    tokens_per_sample: int = 0


class TokenWindows(Dataset):
    """Overlapping-free windows of seq_len+1 tokens: input is [:-1], target is [1:]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def markov_tokens(n: int, vocab: int, branching: int, seed: int) -> torch.Tensor:
    """A token stream from a fixed chain where each token has `branching` likely successors."""
    rng = random.Random(seed)
    successors = [[rng.randrange(vocab) for _ in range(branching)] for _ in range(vocab)]
    out, token = [0] * n, 0
    for i in range(1, n):  # plain Python: 10x faster than indexing tensors one at a time
        token = rng.randrange(vocab) if rng.random() < 0.05 else successors[token][rng.randrange(branching)]
        out[i] = token
    return torch.tensor(out, dtype=torch.long)


def build_dataset(spec: JobSpec, data_dir: Path) -> tuple[Dataset, DataInfo]:
    cfg: DataConfig = spec.data
    if cfg.type == "synthetic_regression":
        g = torch.Generator().manual_seed(cfg.seed)
        x = torch.randn(cfg.num_samples, cfg.input_dim, generator=g)
        w = torch.randn(cfg.input_dim, cfg.output_dim, generator=g) / cfg.input_dim**0.5
        y = x @ w + cfg.noise * torch.randn(cfg.num_samples, cfg.output_dim, generator=g)
        return TensorDataset(x, y), DataInfo("regression", cfg.input_dim, cfg.output_dim)
    if cfg.type == "synthetic_classification":
        g = torch.Generator().manual_seed(cfg.seed)
        x = torch.randn(cfg.num_samples, cfg.input_dim, generator=g)
        w = torch.randn(cfg.input_dim, cfg.num_classes, generator=g)
        return TensorDataset(x, (x @ w).argmax(dim=1)), DataInfo("classification", cfg.input_dim, cfg.num_classes)
    seq_len = spec.model.seq_len
    if cfg.type == "synthetic_lm":
        tokens = markov_tokens(cfg.num_samples * seq_len + 1, spec.model.vocab_size, cfg.branching, cfg.seed)
    else:
        raw = resolve_data_path(cfg.path, data_dir).read_bytes()
        if len(raw) < seq_len + 1:
            raise ValueError(f"data.path has {len(raw)} bytes; seq_len {seq_len} needs at least {seq_len + 1}")
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    return TokenWindows(tokens, seq_len), DataInfo("lm", tokens_per_sample=seq_len)


def split_eval(dataset: Dataset, fraction: float | None) -> tuple[Dataset, Dataset | None]:
    """Hold out the last `fraction` of the samples (a fixed split, the same on every rank and attempt)."""
    if fraction is None:
        return dataset, None
    n_eval = max(1, int(len(dataset) * fraction))
    n_train = len(dataset) - n_eval
    return Subset(dataset, range(n_train)), Subset(dataset, range(n_train, len(dataset)))


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch (to resume a checkpoint exactly)."""

    skip = 0  # samples of this rank's slice to skip, for the current epoch only

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


class BatchStream:
    """Batches without end, epoch after epoch (set_epoch each time), counting where it stands."""

    def __init__(self, dataset: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int,
                 epoch: int = 0, batches_in_epoch: int = 0, pin_memory: bool = False):
        # drop_last keeps every rank's batch the same size, so the mean of rank means is the global mean.
        self.sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                        drop_last=True)
        self.batch_size = batch_size
        # pin_memory (CUDA): batches in page-locked memory, so the step's non_blocking copy overlaps compute.
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=True,
                                 pin_memory=pin_memory)
        self.batches_per_epoch = self.sampler.num_samples // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"dataset of {len(dataset)} samples gives no full batch of {batch_size} "
                             f"per rank over {world_size} ranks")
        self.epoch, self.batches_in_epoch = epoch, batches_in_epoch
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self.sampler.skip = self.batches_in_epoch * self.batch_size
                self._it = iter(self.loader)
            batch = next(self._it, None)
            if batch is not None:
                self.batches_in_epoch += 1
                return batch
            self.epoch, self.batches_in_epoch, self._it = self.epoch + 1, 0, None
