"""The model registry: each builder takes the spec's model config and what the data says."""

import torch
import torch.nn.functional as F
from torch import nn

from trainjobs.spec import GPTConfig, MLPConfig
from worker.train.data import DataInfo

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig, input_dim: int, output_dim: int):
        super().__init__()
        dims = [input_dim, *cfg.hidden]
        # One Sequential per hidden layer: the unit a sharding policy wraps.
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), ACTIVATIONS[cfg.activation]()) for a, b in zip(dims, dims[1:], strict=False)
        )
        self.head = nn.Linear(dims[-1], output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small causal transformer (untied embeddings, learned positions)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.layers:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: MLPConfig | GPTConfig, info: DataInfo) -> nn.Module:
    if cfg.type == "mlp":
        return MLP(cfg, info.input_dim, info.output_dim)
    return GPT(cfg)


def loss_fn(task: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if task == "regression":
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
