"""Known edits of the transactions template, for benchmarks and end-to-end tests.

`PLANTED` are real gains the template baseline leaves on the table (proved by
`benchmarks/headroom.py`); `NOOPS` are behaviour-preserving edits that a sound gate must never
promote; `HARMS` are changes that can only lose (planted-truth campaigns, `benchmarks/planted.py`). Each edit is a search/replace on one template file, the same shape the agent produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError


@dataclass(frozen=True)
class Edit:
    path: str
    search: str
    replace: str


PLANTED: dict[str, list[Edit]] = {
    # The fine-tuning learning rate of the LoRA adapters was never tuned and is far too low.
    "finetune_lr": [Edit("config.toml", "lr = 3e-4", "lr = 3e-3")],
    # The credit-bureau columns are in the data but the baseline only reads the demographic ones.
    "bureau_features": [Edit("config.toml", 'tabular = "basic"', 'tabular = "all"')],
    # Rank-4 adapters are too narrow to adapt the backbone to each task.
    "lora_rank_16": [Edit("config.toml", "lora_rank = 4 ", "lora_rank = 16 ")],
}

# Gains that depend on another: PIX transfers carry information nothing else has (informal cash
# flow, gambling), but the untuned fine-tuning recipe cannot exploit them (1/8 tasks up over 5
# seeds, benchmarks/results/headroom.txt). After `finetune_lr` they helped on an earlier recipe
# (5 fine-tuning epochs, 32 events per source; one seed); to re-measure on this one:
# `benchmarks/headroom.py --on finetune_lr --only add_pix_source`.
CONDITIONAL: dict[str, list[Edit]] = {
    "add_pix_source": [Edit("config.toml", 'sources = ["card"]', 'sources = ["card", "pix"]')],
}

NOOPS: dict[str, list[Edit]] = {
    "config_comment": [
        Edit("config.toml", "[model]\n", "[model]\n# width and depth of the event transformer; LoRA settings below\n"),
    ],
    "cross_network_rename": [
        Edit(
            "model.py",
            "        x = x0\n        for layer in self.layers:\n            x = x0 * layer(x) + x\n        return x\n",
            "        x_l = x0\n        for cross in self.layers:\n            x_l = x0 * cross(x_l) + x_l\n        return x_l\n",
        ),
    ],
    # a comment in the training script: every stage's input digest changes, so the pipeline reruns
    # from pretraining, but not one number the model computes does
    "train_comment": [
        Edit("train.py", "    def predict(rows):\n", "    # batched inference over the given rows, in eval mode\n    def predict(rows):\n"),
    ],
}


# Known harms, for planted-truth campaigns (benchmarks/planted.py): changes that can only lose.
HARMS: dict[str, list[Edit]] = {
    # Keep 2 events per source instead of 24: most of the behavioural history is thrown away.
    "truncate_history": [Edit("config.toml", "max_events = 24 ", "max_events = 2 ")],
    # Noise as large as the scores' own spread added to every prediction: ranking can only get worse.
    "jitter_predictions": [
        Edit(
            "train.py",
            "    scores = predict(test)\n",
            "    scores = predict(test)\n"
            "    scores = scores + np.random.default_rng(args.seed).normal(0.0, scores.std(), len(scores))\n",
        ),
    ],
}

def apply_edit(root: Path, edit: Edit) -> None:
    path = Path(root) / edit.path
    text = path.read_text()
    if text.count(edit.search) != 1:
        raise UserError(f"{edit.path}: search text found {text.count(edit.search)} times, expected once")
    path.write_text(text.replace(edit.search, edit.replace))
