"""Muon for the blocks' matrices and AdamW for the rest, as one ``torch.optim.Optimizer``.

Muon (Jordan et al. 2024; Liu et al., "Muon is Scalable for LLM Training", 2025) steps each hidden
matrix along the nearest semi-orthogonal matrix to its momentum (Newton-Schulz iterations). The
embedding, the output head and the norm gains stay on AdamW, as in both papers. With Moonshot's
scaling (``adjust_lr_fn="match_rms_adamw"``: ``0.2 * sqrt(max(rows, cols))``) an update's RMS
matches AdamW's, so one learning rate and one weight decay, tuned for AdamW, serve both.

The maths is torch's own: this class holds a ``torch.optim.Muon`` and a ``torch.optim.AdamW`` and
shares their parameter groups and state, so Lightning, the LR schedulers and the checkpoints see
one optimizer with one state dict.
"""

from __future__ import annotations

import torch

MUON_GROUP = "decay"  # bnlit.module.param_groups: the blocks' matrices (embeddings and norms are "no_decay")


class MuonAdamW(torch.optim.Optimizer):
    """Groups named ``"decay"`` (:func:`bnlit.module.param_groups`) step with Muon, every other
    group with AdamW. Args are AdamW's, plus Muon's ``momentum``, ``nesterov`` and ``ns_steps``;
    ``fused`` goes to AdamW."""

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, fused: bool | None = None):
        groups = [dict(g) for g in params]
        muon_groups = [g for g in groups if g.get("name") == MUON_GROUP]
        adamw_groups = [g for g in groups if g.get("name") != MUON_GROUP]
        if not muon_groups or not adamw_groups:
            raise ValueError(f"MuonAdamW needs a {MUON_GROUP!r} group and another: bnlit.module.param_groups")
        self.muon = torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=tuple(betas), eps=eps,
                                       weight_decay=weight_decay, fused=fused)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._link()

    def _link(self) -> None:
        """The inner optimizers read this one's groups (so a scheduler's lr reaches them) and state."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups) or "momentum" not in groups[0]:
            raise ValueError("the optimizer state is not MuonAdamW's (a checkpoint trained with another optimizer); "
                             "resume with the optimizer it was trained with, e.g. optimizer=adamw")
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss
