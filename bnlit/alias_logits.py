"""Output rows for the GGUF export's raw-spelling tokens that sit a fixed number of nats below
their piece's logit, instead of sharing its row.

A raw-spelling token (:mod:`bnlit.raw_spellings`) with a copy of its piece's output row gets the
piece's logit, so llama.cpp's softmax gives each piece with a nukta letter its probability twice:
``log2(1 + q)`` bits at every position, ``q`` the model's probability on such pieces. On text in
bnlit's own spelling (the embedded corpus, where every nukta letter is decomposed) that is a pure
cost; on text that types a nukta letter precomposed part of the time it buys the alias its
probability. With the alias's logit ``delta`` nats below the piece's, the cost per position is
``log(1 + q e^delta) - r delta`` nats, ``r`` the rate of alias tokens: ``delta`` trades the first
kind of text against the second (docs/export.md "Raw text in llama.cpp" has the measured table).

llama.cpp's ``llama`` graph has no output bias, so the offset is carried by the row itself: the
alias's row is the piece's plus ``delta * u``, where ``u`` is the direction along which the final
(normalised) hidden states ``h`` are most nearly constant, scaled so that ``u . h`` is 1 on
average: ``u = S^-1 m / (m' S^-1 m)`` for their mean ``m`` and covariance ``S`` (the least-variance
linear functional with mean 1). ``u . h`` then varies by its relative spread around 1 (docs/export.md
gives it on the default run), so the alias's logit sits ``delta`` nats below the piece's to that
precision. The states come from the model's own forward pass over the embedded corpus's Bangla
(:func:`sample_windows`); the export records ``delta`` and the spread in the file.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# nats below the piece's logit (docs/export.md "Raw text in llama.cpp": the measured trade-off)
DEFAULT_OFFSET = -0.5
# a direction whose u . h spreads more than this (relative standard deviation) cannot carry a
# fixed offset: the export shares the rows instead, and says so
MAX_SPREAD = 0.25
# final hidden states the direction is estimated from: many times the width of any preset
SAMPLE_TOKENS = 51_200


def sample_windows(tokenizer, seq_len: int, tokens: int = SAMPLE_TOKENS) -> torch.Tensor:
    """``(n, seq_len)`` token windows, ``n * seq_len >= tokens``, spread evenly over the embedded
    corpus's Bangla documents, each document cut into consecutive windows after an
    end-of-document token as training packs them. Bangla only: the raw-spelling tokens spell
    Bangla pieces, whose probability is what the offset acts on, and the states' near-constant
    direction differs between languages (docs/export.md "Raw text in llama.cpp" has ``u . h`` on the
    default run's Bangla and English)."""
    from bnlit.data.embedded import bangla_documents

    windows = []
    for ids in tokenizer.encode_batch(bangla_documents()):
        ids = [tokenizer.eos_id, *ids]
        windows += [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    n = min(len(windows), -(-tokens // seq_len))
    step = len(windows) / n
    return torch.tensor([windows[int(i * step)] for i in range(n)], dtype=torch.long)


@torch.no_grad()
def final_hidden_states(model, windows: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """``(N, dim)`` float64: the output head's inputs (after the final RMSNorm and its weight) at
    every position of ``windows``."""
    states = []
    hook = model.norm.register_forward_hook(lambda _m, _i, out: states.append(out.detach().double().flatten(0, 1)))
    was_training = model.training
    model.eval()
    try:
        for batch in windows.split(batch_size):
            model(batch.to(next(model.parameters()).device))
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(states).cpu()


def constant_direction(h: torch.Tensor, ridge: float = 1e-6) -> tuple[torch.Tensor, float]:
    """``(u, spread)``: the direction of least relative variance of the rows of ``h`` (the
    module docstring), with ``mean(h @ u) == 1``, and the relative standard deviation of
    ``h @ u``. ``ridge`` (relative to the covariance's mean diagonal) keeps the solve stable."""
    m = h.mean(0)
    c = torch.cov(h.T)
    c = c + ridge * c.diagonal().mean() * torch.eye(c.shape[0], dtype=c.dtype)
    s = torch.linalg.solve(c, m)
    u = s / (m @ s)
    proj = h @ u
    return u, float(proj.std() / proj.mean())


def alias_rows(output: torch.Tensor, alias_of: Sequence[int], direction: torch.Tensor, offset: float) -> torch.Tensor:
    """The output rows of the raw-spelling tokens: their pieces' rows plus ``offset * direction``."""
    rows = output[list(alias_of)].double() + offset * direction.to(torch.float64)
    return rows.to(output.dtype)


def offset_direction(model, tokenizer) -> tuple[torch.Tensor, float]:
    """:func:`constant_direction` of ``model``'s final hidden states on :func:`sample_windows`."""
    windows = sample_windows(tokenizer, model.config.max_seq_len)
    return constant_direction(final_hidden_states(model, windows))
