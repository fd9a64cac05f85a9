"""The value head's network and its fit (used by :mod:`rredcot.methods.value_head`): the MLP,
TD(lambda) targets over segment boundaries, and :class:`ValueFit` (optimiser, EMA target,
replay). Nothing here knows about batches, hand-over or credit: it learns from tensors."""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rredcot.algebra.normalization import masked_mean
from rredcot.config import HEAD_BYTES_PER_WEIGHT, ValueHeadConfig
from rredcot.machine import refuse_bytes_beyond_memory

__all__ = ["INIT_SEED", "ValueFit", "ValueMLP", "td_lambda_targets"]

INIT_SEED = 0  # the head's initial weights do not depend on (or consume) the global RNG


class ValueMLP(nn.Module):
    """``x (..., D + E) -> logit (...)``: a parameter-free LayerNorm over the D hidden-state
    features (the E extra features pass as they are), Linear(D + E, h), GELU, Linear(h, 1).

    The LayerNorm puts hidden states of different models on one scale without adding parameters;
    the last layer starts at zero so every first prediction is the neutral logit 0.
    """

    def __init__(self, input_size: int, hidden_size: int, extra_size: int = 0) -> None:
        super().__init__()
        self.input_size = input_size
        self.extra_size = extra_size
        self.hidden_size = hidden_size
        self.norm = nn.LayerNorm(input_size, elementwise_affine=False)
        self.fc1 = nn.Linear(input_size + extra_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden, extra = x.split([self.input_size, self.extra_size], dim=-1)
        x = torch.cat([self.norm(hidden), extra], dim=-1)
        return self.fc2(F.gelu(self.fc1(x))).squeeze(-1)


def td_lambda_targets(
    target_values: Tensor, value_mask: Tensor, rewards: Tensor, lam: float
) -> tuple[Tensor, Tensor]:
    """TD(lambda) targets over segment boundaries (gamma = 1, reward only at the end).

    With ``V̄(s_n) := R``: ``G_k = (1 - lam) V̄(s_{k+1}) + lam G_{k+1}``, ``G_n = R``, i.e.
    ``G_k = (1-lam) sum_{m>=1} lam^(m-1) V̄(s_{k+m}) + lam^(n-k-1) R`` truncated at ``s_n``.
    ``lam = 1`` regresses every boundary on ``R``; ``lam = 0`` is TD(0), ``G_k = V̄(s_{k+1})``.

    Args:
        target_values: ``(B, S+1)`` stop-gradient values ``V̄(s_k)`` (whatever sits at ``s_n`` and
            beyond is ignored).
        value_mask: ``(B, S+1)`` prefix mask, ``n_b + 1`` True entries per row.
        rewards: ``(B,)`` outcomes.
        lam: lambda_v in ``[0, 1]``.

    Returns:
        targets ``(B, S+1)`` and target_mask ``(B, S+1)`` bool: valid for ``k = 0 .. n_b - 1``
        (``s_n`` has no target, it *is* the outcome); targets are 0 elsewhere.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"TD lambda must be in [0, 1], got {lam}")
    mask = value_mask.bool()
    last = mask.sum(dim=1) - 1  # (B,) column of s_n
    cols = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    target_mask = mask & (cols < last.unsqueeze(1))
    r = rewards.to(target_values.dtype)
    # V̄ with V̄(s_n) := R and zeros beyond.
    vbar = torch.where(cols == last.unsqueeze(1), r.unsqueeze(1), target_values)
    vbar = torch.where(mask, vbar, torch.zeros_like(vbar))
    targets = torch.zeros_like(vbar)
    running = r.clone()  # G_{k+1}; at the last valid column this is G_n = R
    for k in reversed(range(mask.shape[1] - 1)):
        nxt = vbar[:, k + 1]
        g = (1.0 - lam) * nxt + lam * running
        # At k = n - 1 the recursion gives (1-lam) R + lam R = R; rows where k >= n keep R.
        running = torch.where(target_mask[:, k], g, r)
        targets[:, k] = running
    return torch.where(target_mask, targets, torch.zeros_like(targets)), target_mask


class ValueFit:
    """The value network and how it learns: the head, its EMA target (``credit.value_head.ema``),
    its optimiser and a replay buffer of recent batches' boundary features, fitted by TD(lambda_v)
    over segment boundaries (``credit.value_head.td_lambda``; 1 regresses every boundary on R)."""

    def __init__(self, config: ValueHeadConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.head: ValueMLP | None = None
        self.target: ValueMLP | None = None  # EMA copy when ema > 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.replay: deque[dict[str, Tensor]] = deque(maxlen=max(config.replay, 1))

    def build(self, input_size: int, hidden_size: int, extra_size: int) -> None:
        """A fresh head (its initial weights do not consume the global RNG), target, optimiser;
        a head that cannot fit this machine's memory is refused before it is allocated."""
        weights = (input_size + extra_size + 2) * hidden_size + 1
        copies = 2 if self.config.ema > 0 else 1  # the EMA target is one more copy
        refuse_bytes_beyond_memory(
            f"credit.value_head.hidden_size={hidden_size}",
            weights * HEAD_BYTES_PER_WEIGHT * copies,
            f"a head of {weights:,} weights ({input_size + extra_size} inputs)",
            "lower it (0: auto, about 1% of the policy)",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            head = ValueMLP(input_size, hidden_size, extra_size=extra_size)
        self.head = head.to(self.device)
        self.target = (
            copy.deepcopy(self.head).requires_grad_(False) if self.config.ema > 0 else None
        )
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.config.lr)

    def activation(self, logits: Tensor) -> Tensor:
        return torch.sigmoid(logits) if self.config.output == "sigmoid" else logits

    def predict(self, net: nn.Module, feats: Tensor) -> Tensor:
        return self.activation(net(feats))

    def loss(self, entry: dict[str, Tensor]) -> Tensor:
        """The loss of one entry (``features``, ``mask``, ``rewards``): against its own
        ``targets`` at ``target_mask`` where it has them (a teacher's values), else TD(lambda_v)."""
        feats, mask, rewards = entry["features"], entry["mask"], entry["rewards"]
        logits = self.head(feats)
        if "targets" in entry:
            targets, target_mask = entry["targets"], entry["target_mask"]
        else:
            targets, target_mask = self._td_targets(feats, mask, rewards, logits)
        if self.config.loss == "bce":
            per = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        else:
            per = (self.activation(logits) - targets) ** 2
        return masked_mean(per, target_mask)

    def _td_targets(
        self, feats: Tensor, mask: Tensor, rewards: Tensor, logits: Tensor
    ) -> tuple[Tensor, Tensor]:
        lam_v = self.config.td_lambda
        if lam_v < 1.0:
            with torch.no_grad():
                vbar = self.predict(self.target if self.target is not None else self.head, feats)
        else:
            vbar = torch.zeros_like(logits)  # lam_v = 1: targets are R, V̄ is not used
        return td_lambda_targets(vbar, mask, rewards, lam_v)

    @staticmethod
    def has_targets(entry: dict[str, Tensor]) -> bool:
        if "target_mask" in entry:
            return bool(entry["target_mask"].any())
        return bool((entry["mask"].sum(dim=1) > 1).any())

    def fit(self, entry: dict[str, Tensor]) -> dict[str, float]:
        """``epochs`` passes over the replayed entries and this one, then keep it."""
        data = [{k: v.to(self.device) for k, v in e.items()} for e in self.replay]
        data = [e for e in data + [entry] if self.has_targets(e)]
        losses = []
        self.head.train()
        for _ in range(self.config.epochs):
            for e in data:
                loss = self.loss(e)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.ema_step()
                losses.append(float(loss.detach()))
        if self.config.replay > 0 and self.has_targets(entry):
            self.replay.append({k: v.detach().cpu() for k, v in entry.items()})
        return {
            "value/loss": sum(losses) / len(losses) if losses else float("nan"),
            "value/replay_batches": float(len(data)),
        }

    @torch.no_grad()
    def ema_step(self) -> None:
        if self.target is None:
            return
        decay = self.config.ema
        for t, p in zip(self.target.parameters(), self.head.parameters()):
            t.mul_(decay).add_(p.detach(), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {
            "input_size": None if self.head is None else self.head.input_size,
            "extra_size": None if self.head is None else self.head.extra_size,
            "hidden_size": None if self.head is None else self.head.hidden_size,
            "head": None if self.head is None else self.head.state_dict(),
            "target": None if self.target is None else self.target.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "replay": list(self.replay),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["head"] is not None:
            if (
                self.head is None
                or self.head.input_size != state["input_size"]
                or self.head.hidden_size != state["hidden_size"]
            ):
                self.build(state["input_size"], state["hidden_size"], state["extra_size"])
            self.head.load_state_dict(state["head"])
            if self.target is not None:
                self.target.load_state_dict(
                    state["target"] if state["target"] is not None else state["head"]
                )
            self.optimizer.load_state_dict(state["optimizer"])
        self.replay.clear()
        self.replay.extend(state["replay"])
