"""Attention kernel benchmark for the default CPU run: ``python scripts/bench_attention.py``.

Times optimizer steps (forward, backward, AdamW) of the default model (``--model``, its
``max_seq_len`` and the data module's batch size) on random tokens with a document mask (an EOS
every ``--doc-len`` tokens on average), compiled per block as the trainer compiles it
(``module.compile``) and under the CPU run's precision, with two attention kernels switched block
by block in one process (A, B, B, A, ...): ``auto`` (``F.scaled_dot_product_attention``, which on
CPU dispatches its flash kernel) and ``math`` (``module.sdpa_backend=math``:
:func:`bnlit.speed.sdpa.math_attention`). Both models start from the same weights and see the same
batches. Prints each block's median step time, the paired ratios (math / auto) and their median
with the 1-minute load average, and the largest difference of the two models' first-step losses.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds; each times both kernels once, alternating which goes first")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per kernel per round")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--model", default="tiny", help="model preset (conf/model/<name>.yaml)")
    p.add_argument("--doc-len", type=int, default=400, help="mean tokens between EOS tokens in the random windows")
    p.add_argument("--eager", action="store_true", help="do not torch.compile the blocks and the loss")
    p.add_argument("--override", action="append", default=[],
                   help="a Hydra override of the composed config (repeatable), e.g. trainer.precision=32-true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch  # after the arguments: --help answers without it
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bnlit.resolvers  # noqa: F401
    from bnlit import CONF_DIR
    from bnlit.document_masking import document_mask
    from bnlit.speed import sdpa
    from bnlit.speed.compile import compile_loss, compile_model

    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={args.model}", "logger=none", *args.override])
    precision = str(cfg.trainer.precision)
    batch, seq = int(cfg.data.batch_size), int(cfg.model.config.max_seq_len)
    torch.manual_seed(0)
    base = instantiate(cfg.model)
    eos = 3
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randint(4, base.config.vocab_size, (batch, seq + 1), generator=g)
        x[torch.rand(x.shape, generator=g) < 1 / args.doc_len] = eos
        batches.append((x[:, :-1], x[:, 1:], document_mask(x[:, :-1], eos, flex=False)))

    models, opts = {}, {}
    for name in ("auto", "math"):
        m = copy.deepcopy(base)
        for layer in m.layers:
            layer.attention.sdpa = sdpa.kernel_fn(name, "cpu")
        if not args.eager:
            compile_loss(m, False)
            compile_model(m, False)
        models[name], opts[name] = m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    autocast = "bf16" in precision

    def step(name: str, i: int) -> float:
        x, y, mask = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = models[name](x, y, mask)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return loss.item()

    first = {name: step(name, 0) for name in models}  # the same weights and batch: the same loss
    for name in models:  # warm-up (compiles the backward)
        for i in range(1, 4):
            step(name, i)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (("auto", "math") if r % 2 == 0 else ("math", "auto")):
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(name, i)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    load = os.getloadavg()[0]
    print(f"model {args.model}: batch {batch} x seq {seq}, {precision}, "
          f"{'eager' if args.eager else 'compiled'}, {args.threads} threads, EOS every ~{args.doc_len} tokens")
    for name in models:
        print(f"  sdpa_backend={name:4}: step {statistics.median(times[name]):.1f} ms (median of {args.rounds} blocks "
              f"of {args.steps} steps)")
    ratios = [m / a for m, a in zip(times["math"], times["auto"])]
    print(f"  step time math / auto: median {statistics.median(ratios):.2f}  pairs "
          f"{' '.join(f'{v:.2f}' for v in ratios)}  (load average {load:.1f})")
    print(f"  first-step loss: auto {first['auto']:.5f}, math {first['math']:.5f} "
          f"(difference {abs(first['auto'] - first['math']):.1e})")


if __name__ == "__main__":
    main()
