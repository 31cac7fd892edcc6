"""Pretraining and fine-tuning. The pipeline runs these as stages (see research.toml):

    python train.py pretrain --data DIR --seed S --out DIR
    python train.py finetune --data DIR --task T --seed S --pretrained DIR --out DIR

`finetune` writes {out}/predictions.csv (id,score) for the test customers; the harness scores it.
Hyperparameters live in config.toml next to this file. A stage given a GPU (`[run] gpus` in
research.toml) trains on it with bf16 autocast; without one, on the CPU in float32.
"""

import argparse
import contextlib
import json
import math
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from model import Classifier, EventTransformer

HERE = Path(__file__).resolve().parent
N_TIME_BUCKETS = 8  # log2 buckets of days before the reference date


def load_config():
    with open(HERE / "config.toml", "rb") as fh:
        return tomllib.load(fh)


def device_and_autocast():
    """The GPU with bf16 autocast when this stage was given one, else the CPU in plain float32."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.device("cpu"), contextlib.nullcontext()


# ---------------------------------------------------------------------------- data

def load_sequences(data_dir, sources, max_events):
    """Left-padded token, recency and hour arrays [customers, L], BOS before the events.

    Each source keeps its `max_events` most recent events, so adding a source lengthens the
    sequence (L = max_events * len(sources) + 1) instead of crowding out the others.
    """
    meta = json.loads((data_dir / "meta.json").read_text())
    ev = np.load(data_dir / "events.npz")
    n_customers = len(ev["offsets"]) - 1
    n_amount = meta["amount_buckets"]
    offset, vocab_size = [], 2  # 0 = padding, 1 = BOS
    for source in meta["sources"]:
        offset.append(vocab_size)
        vocab_size += meta["categories"][source] * n_amount

    keep = np.flatnonzero(np.isin(ev["source"], [meta["sources"].index(s) for s in sources]))
    cust, source = ev["customer"][keep], ev["source"][keep]
    # newest `max_events` per (customer, source): rank events from the end within each group
    by_group = np.lexsort((keep, source, cust))
    group = cust[by_group].astype(np.int64) * len(offset) + source[by_group]
    _, first, size = np.unique(group, return_index=True, return_counts=True)
    from_group_end = np.repeat(first + size, size) - 1 - np.arange(len(group))
    recent = np.sort(keep[by_group][from_group_end < max_events])

    cust, source = ev["customer"][recent], ev["source"][recent]
    token = np.array(offset)[source] + ev["category"][recent].astype(np.int64) * n_amount + ev["amount_bucket"][recent]
    recency = np.minimum(np.log2(1 + ev["day"][recent]).astype(np.int64), N_TIME_BUCKETS - 1)
    hour = ev["hour"][recent].astype(np.int64) // 6

    counts = np.bincount(cust, minlength=n_customers)
    from_end = np.cumsum(counts)[cust] - 1 - np.arange(len(cust))  # 0 = most recent kept event
    length = max_events * len(sources) + 1
    col = length - 1 - from_end
    tokens = np.zeros((n_customers, length), dtype=np.int64)
    times = np.zeros((n_customers, length), dtype=np.int64)
    hours = np.full((n_customers, length), 4, dtype=np.int64)
    tokens[cust, col], times[cust, col], hours[cust, col] = token, recency, hour
    tokens[np.arange(n_customers), length - 1 - counts] = 1
    return torch.from_numpy(tokens), torch.from_numpy(times), torch.from_numpy(hours), vocab_size


def load_tabular(data_dir, which):
    meta = json.loads((data_dir / "meta.json").read_text())
    customers = np.load(data_dir / "customers.npz")
    columns = meta["tabular_groups"]["basic"] if which == "basic" else meta["tabular"]
    idx = [meta["tabular"].index(c) for c in columns]
    return customers["id"], customers["split"], torch.from_numpy(customers["tabular"][:, idx])


def auc(labels, scores):
    """Rank AUC, enough for model selection on the validation split."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def batches(n, batch_size, generator):
    perm = torch.randperm(n, generator=generator)
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


# ---------------------------------------------------------------------------- pretrain

def pretrain(args):
    cfg = load_config()
    device, autocast = device_and_autocast()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)  # batches are drawn on the CPU, GPU or not
    tokens, times, hours, vocab_size = load_sequences(Path(args.data), cfg["data"]["sources"], cfg["data"]["max_events"])
    tokens, times, hours = tokens.to(device), times.to(device), hours.to(device)
    m = cfg["model"]
    arch = dict(vocab_size=vocab_size, n_time_buckets=N_TIME_BUCKETS, max_len=tokens.shape[1],
                d_model=m["d_model"], n_layers=m["n_layers"], n_heads=m["n_heads"], dropout=m["dropout"])
    model = EventTransformer(**arch).to(device)
    p = cfg["pretrain"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
    steps = p["epochs"] * math.ceil(len(tokens) / p["batch_size"])
    # OneCycleLR divides by (pct_start * steps - 1): exactly 0 at 10 steps with 0.1, so a small run warms up longer
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=p["lr"], total_steps=steps,
                                                pct_start=0.1 if steps >= 20 else 0.3)
    start, n_tokens = time.time(), 0
    model.train()
    for epoch in range(p["epochs"]):
        for idx in batches(len(tokens), p["batch_size"], gen):
            with autocast:
                loss = model.next_event_loss(tokens[idx], times[idx], hours[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            n_tokens += int((tokens[idx] != 0).sum())
        print(f"pretrain epoch {epoch} loss {loss.item():.4f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"arch": arch, "state": model.state_dict()}, out / "model.pt")
    seconds = time.time() - start
    (out / "metrics.json").write_text(json.dumps({"loss": loss.item(), "seconds": seconds, "tokens": n_tokens,
                                                  "tokens_per_s": n_tokens / seconds}))


# ---------------------------------------------------------------------------- finetune

def finetune(args):
    from peft import LoraConfig, get_peft_model

    cfg = load_config()
    m, f = cfg["model"], cfg["finetune"]
    device, autocast = device_and_autocast()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = Path(args.data)
    tokens, times, hours, _ = load_sequences(data, cfg["data"]["sources"], cfg["data"]["max_events"])
    ids, split, tabular = load_tabular(data, f["tabular"])
    labels = np.load(data / "labels.npz")[args.task]
    tokens, times, hours, tabular = tokens.to(device), times.to(device), hours.to(device), tabular.to(device)

    ckpt = torch.load(Path(args.pretrained) / "model.pt", map_location=device, weights_only=True)
    backbone = EventTransformer(**ckpt["arch"])
    backbone.load_state_dict(ckpt["state"])
    lora = LoraConfig(r=f["lora_rank"], lora_alpha=2 * f["lora_rank"], target_modules=["qkv", "proj", "fc", "out"],
                      lora_dropout=0.0, bias="none")
    backbone = get_peft_model(backbone, lora)  # freezes the pretrained weights, adds trainable adapters
    model = Classifier(backbone, m["d_model"], tabular.shape[1], f["cross_layers"], m["dropout"]).to(device)
    adapter = [p for n, p in model.named_parameters() if p.requires_grad and n.startswith("backbone.")]
    head = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("backbone.")]
    opt = torch.optim.AdamW([{"params": adapter, "lr": f["lr"]}, {"params": head, "lr": f["head_lr"]}],
                            weight_decay=f["weight_decay"])

    train, val, test = (torch.from_numpy(np.flatnonzero(split == k)) for k in (0, 1, 2))
    y = torch.from_numpy(labels.astype(np.float32)).to(device)

    def predict(rows):
        model.eval()
        with torch.no_grad(), autocast:
            out = [model(tokens[i], times[i], hours[i], tabular[i]) for i in rows.split(512)]
        return torch.cat(out).float().cpu().numpy()

    best_auc, best_state = -1.0, None
    for epoch in range(f["epochs"]):
        model.train()
        for b in batches(len(train), f["batch_size"], gen):
            i = train[b]
            with autocast:
                loss = F.binary_cross_entropy_with_logits(model(tokens[i], times[i], hours[i], tabular[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        val_auc = auc(labels[val.numpy()], predict(val))
        print(f"finetune {args.task} epoch {epoch} loss {loss.item():.4f} val_auc {val_auc:.4f}", flush=True)
        if val_auc > best_auc:
            best_auc, best_state = val_auc, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scores = predict(test)
    with open(out / "predictions.csv", "w") as fh:
        fh.write("id,score\n")
        fh.writelines(f"{i},{s:.6f}\n" for i, s in zip(ids[test.numpy()], scores))
    (out / "metrics.json").write_text(json.dumps({"val_auc": best_auc}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pretrain")
    p.add_argument("--data", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    f = sub.add_parser("finetune")
    f.add_argument("--data", required=True)
    f.add_argument("--task", required=True)
    f.add_argument("--seed", type=int, required=True)
    f.add_argument("--pretrained", required=True)
    f.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    {"pretrain": pretrain, "finetune": finetune}[args.command](args)


if __name__ == "__main__":
    main()
