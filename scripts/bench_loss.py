"""Output-head loss and optimizer benchmark for the default CPU run: ``python scripts/bench_loss.py``.

Times optimizer steps (forward, backward, AdamW) of the default model (``--model``, its
``max_seq_len`` and the data module's batch size) on random tokens with a document mask, compiled
per block as the trainer compiles it (``--eager``: not) and under the CPU run's precision, for
several variants in one process, alternated block by block (A, B, C, ..., then the reverse order):
``plain`` (the default ``module.loss_impl``), ``fused_adamw`` (the plain loss with
``optimizer.fused=true``) and ``chunked_<rows>`` (``module.loss_impl=chunked`` with ``--chunk-rows``
rows of logits per chunk).
Every variant starts from the same weights and sees the same batch. Prints each variant's median
step time, its paired ratios against ``plain`` and their median, with the 1-minute load average,
and each variant's first-step loss; ``--profile`` also prints where one plain step's CPU time goes
(``torch.profiler``, the ops by self time with their input shapes).
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
    p.add_argument("--rounds", type=int, default=6, help="rounds; each times every variant once, alternating the order")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per variant per round")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--model", default="tiny", help="model preset (conf/model/<name>.yaml)")
    p.add_argument("--chunk-rows", type=int, nargs="*", default=[128, 256, 512],
                   help="rows of logits per chunk of each chunked variant")
    p.add_argument("--eager", action="store_true", help="do not torch.compile the blocks and the loss")
    p.add_argument("--profile", action="store_true", help="also print one plain step's ops by CPU self time")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch  # after the arguments: --help answers without it
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bnlit.resolvers  # noqa: F401
    from bnlit import CONF_DIR
    from bnlit.document_masking import document_mask
    from bnlit.loss import chunked_loss, plain_loss
    from bnlit.speed import sdpa
    from bnlit.speed.compile import compile_model
    from bnlit.speed.compile_ahead import random_windows
    from bnlit.tokenizer import EOS_ID

    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={args.model}", "logger=none"])
    precision = str(cfg.trainer.precision)
    batch, seq = int(cfg.data.batch_size), int(cfg.model.config.max_seq_len)
    torch.manual_seed(0)
    base = instantiate(cfg.model)
    x, y = random_windows(batch, seq, base.config.vocab_size, EOS_ID)
    mask = document_mask(x, EOS_ID, flex=False)

    def chunked(rows: int):
        return lambda h, w, t: chunked_loss(h, w, t, rows * base.config.vocab_size)

    variants = {"plain": (plain_loss, False), "fused_adamw": (plain_loss, True),
                **{f"chunked_{rows}": (chunked(rows), False) for rows in args.chunk_rows}}
    models, opts = {}, {}
    for name, (loss_fn, fused) in variants.items():
        m = copy.deepcopy(base)
        for layer in m.layers:
            layer.attention.sdpa = sdpa.kernel_fn(str(cfg.module.sdpa_backend), "cpu")
        m.loss_fn = loss_fn
        if not args.eager:
            compile_model(m, False)
        models[name] = m
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused or None)
    autocast = "bf16" in precision

    def step(name: str) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = models[name](x, y, mask)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return loss.item()

    first = {name: step(name) for name in models}  # the same weights and batch: the same loss, to rounding
    for name in models:  # warm-up (compiles the backward)
        for _ in range(3):
            step(name)
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    load = os.getloadavg()[0]
    print(f"model {args.model}: batch {batch} x seq {seq}, {precision}, {'eager' if args.eager else 'compiled'}, "
          f"{args.threads} threads "
          f"(load average {load:.1f})")
    for name in names:
        ratios = [t / p for t, p in zip(times[name], times["plain"])]
        print(f"  {name:12}: step {statistics.median(times[name]):6.1f} ms; / plain median "
              f"{statistics.median(ratios):.3f}, pairs {' '.join(f'{v:.2f}' for v in ratios)}; "
              f"first-step loss {first[name]:.5f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                step("plain")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12,
                                                                 max_name_column_width=32, max_shapes_column_width=60))


if __name__ == "__main__":
    main()
