"""What an LLM's tokens cost: the list prices the client knows (dated), a lab's own price
(`[agent] price_per_mtok`), and which model a lab runs (`AUTORESEARCH_MODEL` first). A model with no
known price is counted in tokens, never guessed in dollars."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Price:
    """USD per million tokens, input (prompt) and output (completion)."""

    input_per_mtok: float
    output_per_mtok: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok) / 1e6


# OpenAI's list prices as of PRICES_AS_OF; a dated model name ("gpt-4.1-mini-2025-04-14") matches its
# longest listed prefix. Any other model has no price: its spend is counted in tokens, not guessed in
# dollars (a model on the team's own server costs no dollars per token; `[agent] price_per_mtok`
# prices one that does).
PRICES_AS_OF = "2025-08-07"
PRICES: dict[str, Price] = {
    "gpt-5": Price(1.25, 10.00),
    "gpt-5-mini": Price(0.25, 2.00),
    "gpt-5-nano": Price(0.05, 0.40),
    "gpt-4.1": Price(2.00, 8.00),
    "gpt-4.1-mini": Price(0.40, 1.60),
    "gpt-4.1-nano": Price(0.10, 0.40),
    "gpt-4o": Price(2.50, 10.00),
    "gpt-4o-mini": Price(0.15, 0.60),
    "o3": Price(2.00, 8.00),
    "o3-mini": Price(1.10, 4.40),
    "o4-mini": Price(1.10, 4.40),
}


def price_for(model: str, prices: Mapping[str, Price] = PRICES) -> Price | None:
    """The price of `model`: exact name, else the longest listed prefix, else None (no known price).

    A provider prefix ("openai/gpt-4.1-mini", as routers spell it) is ignored.
    """
    name = model.rsplit("/", 1)[-1]
    if name in prices:
        return prices[name]
    prefixes = [p for p in prices if name.startswith(p)]
    return prices[max(prefixes, key=len)] if prefixes else None


def lab_price(agent: Any) -> Price | None:
    """The price the lab sets for its model (`[agent] price_per_mtok`), or None."""
    p = agent.price_per_mtok
    return None if p is None else Price(p.input, p.output)


def model_price(agent: Any, env: Mapping[str, str] | None = None) -> tuple[str, Price | None]:
    """The model the lab's `[agent]` section runs (`AUTORESEARCH_MODEL` first) and its price: the
    lab's own, else the listed one, else None (its spend is counted in tokens)."""
    model = resolve_model(agent.model, env)
    return model, lab_price(agent) or price_for(model)


def resolve_model(configured: str, env: Mapping[str, str] | None = None) -> str:
    """The model to use: `AUTORESEARCH_MODEL` when set, else research.toml's `[agent] model`."""
    return (env if env is not None else os.environ).get("AUTORESEARCH_MODEL") or configured
