"""The model: a decoder-only transformer over event tokens, fine-tuned with a DCNv2 fusion head.

Read top to bottom. Pretraining teaches `EventTransformer` to predict a customer's next event;
fine-tuning adds LoRA adapters to its linear layers (see train.py) and fuses its sequence
embedding with the tabular features through a cross network.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask):
        B, L, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, L, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = x + self.drop(self.attn(self.ln1(x), mask))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class EventTransformer(nn.Module):
    """Each event is one token (source, category, amount bucket) plus its recency and hour bucket.

    Sequences are left-padded so the last position is always the most recent event.
    """

    def __init__(self, vocab_size, n_time_buckets, max_len, d_model, n_layers, n_heads, dropout):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.time_emb = nn.Embedding(n_time_buckets, d_model)
        self.hour_emb = nn.Embedding(5, d_model)  # 4 six-hour buckets + padding
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens, times, hours):
        B, L = tokens.shape
        real = tokens != 0
        causal = torch.ones(L, L, dtype=torch.bool, device=tokens.device).tril()
        # Attend to real keys only; a padded query may see itself so no row is empty.
        mask = (causal & real[:, None, :]) | torch.eye(L, dtype=torch.bool, device=tokens.device)
        pos = torch.arange(L, device=tokens.device)
        x = self.tok_emb(tokens) + self.time_emb(times) + self.hour_emb(hours) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, mask[:, None])
        return self.ln_f(x)

    def next_event_loss(self, tokens, times, hours):
        h = self.forward(tokens, times, hours)
        logits = self.lm_head(h[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1), ignore_index=0)


class CrossNetwork(nn.Module):
    """DCNv2: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l — explicit feature crosses of bounded degree."""

    def __init__(self, dim, n_layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))

    def forward(self, x0):
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class Classifier(nn.Module):
    """Sequence embedding (last and mean hidden state) ⊕ tabular features → cross network → logit."""

    def __init__(self, backbone, d_model, n_tabular, cross_layers, dropout):
        super().__init__()
        self.backbone = backbone
        self.tab_proj = nn.Linear(n_tabular, d_model)
        dim = 3 * d_model
        self.cross = CrossNetwork(dim, cross_layers)
        self.head = nn.Sequential(nn.Linear(dim, d_model), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_model, 1))

    def forward(self, tokens, times, hours, tabular):
        h = self.backbone(tokens, times, hours)
        real = (tokens != 0).unsqueeze(-1).float()
        mean = (h * real).sum(1) / real.sum(1).clamp(min=1.0)
        x0 = torch.cat([h[:, -1], mean, self.tab_proj(tabular)], dim=1)
        return self.head(self.cross(x0)).squeeze(-1)
