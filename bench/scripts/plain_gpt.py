"""A plain PyTorch GPT loop, as a user writes one (no trainjobs code): bench/runtime_speed.py's reference.

The same model as the built-in `gpt` (untied embeddings, learned positions, pre-LayerNorm blocks, SDPA), DDP
on gloo, AdamW, random windows of a random token stream, the loss read back every --log-every steps. Rank 0
prints one line the bench reads:
    plain_gpt: median step S s over K windows of L steps, first step F s
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
for name, default in (("steps", 60), ("log-every", 10), ("batch", 16), ("n-layer", 2), ("n-head", 4),
                      ("d-model", 128), ("seq-len", 128), ("vocab", 256)):
    parser.add_argument(f"--{name}", type=int, default=default)
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(args.vocab, args.d_model)
        self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(Block(args.d_model, args.n_head) for _ in range(args.n_layer))
        self.ln = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(GPT())
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
tokens = torch.randint(0, args.vocab, (args.batch * args.seq_len * 64 + 1,))
started = time.perf_counter()
windows, first, last = [], None, time.perf_counter()
for step in range(1, args.steps + 1):
    starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch,))
    x = torch.stack([tokens[s: s + args.seq_len] for s in starts])
    y = torch.stack([tokens[s + 1: s + 1 + args.seq_len] for s in starts])
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).view(-1, args.vocab), y.view(-1))
    loss.backward()
    optimizer.step()
    if first is None:
        first = time.perf_counter() - started
    if step % args.log_every == 0:
        loss_value = loss.item()
        now = time.perf_counter()
        windows.append((now - last) / args.log_every)
        last = now
kept = windows[1:] or windows  # the first window holds the warm-up
if dist.get_rank() == 0:
    print(f"plain_gpt: median step {statistics.median(kept):.6f} s over {len(kept)} windows of {args.log_every} "
          f"steps, first step {first:.3f} s, loss {loss_value:.3f}", flush=True)
dist.barrier()  # NOTE: without it gloo may abort one rank in teardown
dist.destroy_process_group()
