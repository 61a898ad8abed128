"""The arbiter on FSDP2 shards (issue 28 item 4): on a ``fully_shard``-ed tiny model in a gloo
group, a planted zero gradient, a vanishing gradient and dead rows (in a middle-sized matrix and in
the embedding table, across the shard boundary) are each named by the full check and the sentinel
exactly as on the unsharded model, with the dead rows' global indices; a healthy sharded model
has 0 findings; each check is one collective. FSDP on 2 ranks, HSDP on a 2 x 2 mesh (replicated x
sharded) of 4 ranks. The vocabulary (97) does not divide by the shards: rank 0 holds 49 rows, the
last rank 48 and a padded shard; a one-row parameter leaves the last rank an empty shard."""

from __future__ import annotations

import json
import textwrap

import pytest

from bnlit.checks.gradient_flow import row_ranges
from helpers_dist import run_two_ranks

ZERO = "layers.0.attention.wv.weight"
VANISHING = "layers.1.feed_forward.w2.weight"
DEAD_MATRIX, DEAD_MATRIX_ROWS = "layers.0.feed_forward.w1.weight", (20, 75)  # of 96 rows: 48 per shard
EMBEDDING, EMBEDDING_ROWS = "tok_embeddings.weight", (10, 80)  # of 97 rows: 49 + 48

WORKER = textwrap.dedent(f'''
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from bnlit.checks.gradient_flow import GradientSentinel, embedding_row_exempt, gradient_flow_report, shard_layout, total_grad_norm
    from bnlit.module import shard
    from test_gradient_flow import batch, loss_fn, tiny

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hsdp = sys.argv[3] == "hsdp"
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,), mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
    calls = []

    def reduce(t, op):
        calls.append(op)
        dist.all_reduce(t, op=dict(sum=dist.ReduceOp.SUM, min=dist.ReduceOp.MIN, max=dist.ReduceOp.MAX)[op])
        return t

    b = batch()  # every rank the same batch: the averaged gradient is the one-process gradient
    reference, model = tiny(tie=False, vocab_size=97), tiny(tie=False, vocab_size=97)
    shard(model, mesh)
    for m in (reference, model):
        loss_fn(m, b).backward()
    present = set(b[0].flatten().tolist()) | set(b[1].flatten().tolist())
    dead_embedding = [r for r in range({EMBEDDING_ROWS[0]}, {EMBEDDING_ROWS[1]} + 1) if r in present]

    def plant(m):
        g = dict(m.named_parameters())
        def rows(name, global_rows):  # zero these global rows of the local shard
            grad = g[name].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            start = shard_layout(g[name])[0]
            for r in global_rows:
                if start <= r < start + local.shape[0]:
                    local[r - start] = 0.0
        rows("{ZERO}", range(97))
        rows("{DEAD_MATRIX}", range({DEAD_MATRIX_ROWS[0]}, {DEAD_MATRIX_ROWS[1]} + 1))
        rows("{EMBEDDING}", dead_embedding)
        grad = g["{VANISHING}"].grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).mul_(1e-10)

    def report(m, sharded):
        kw = dict(reduce=reduce, sharded=True, world_size=world) if sharded else {{}}
        r = gradient_flow_report(m.named_parameters(), row_exempt=embedding_row_exempt(m, [b]), **kw)
        return dict(findings=[(f["category"], f["parameter"]) for f in r.findings()], norms=r.norms,
                    total_norm=r.total_norm, weight_norms=r.weight_norms, dead_row_ranges=r.dead_row_ranges,
                    dead_row_counts=r.dead_row_counts, messages=[f["message"] for f in r.findings()]), r

    out = dict(placements={{n: [str(x) for x in p.placements] for n, p in model.named_parameters()}},
               local_rows={{n: p.to_local().shape[0] for n, p in model.named_parameters() if p.ndim == 2}})
    out["healthy"], healthy = report(model, True)
    out["healthy_reference"], _ = report(reference, False)
    out["healthy_calls"] = list(calls)
    sentinel = GradientSentinel(sharded=True)
    sentinel.set_weight_norms(healthy.weight_norms)
    calls.clear()
    out["sentinel_norm"] = float(sentinel.observe(model.named_parameters(), 1, reduce=reduce))
    out["sentinel_healthy"], out["sentinel_healthy_calls"] = sentinel.findings(), list(calls)
    out["total_grad_norm"] = float(total_grad_norm(model.named_parameters(), reduce))
    for m in (reference, model):
        plant(m)
    calls.clear()
    out["planted"], _ = report(model, True)
    out["planted_calls"] = list(calls)
    out["planted_reference"], _ = report(reference, False)
    sentinel.observe(model.named_parameters(), 2, reduce=reduce)
    out["sentinel_planted"] = sentinel.findings()
    out["dead_embedding"] = dead_embedding

    # one row on several shards: the last rank holds an empty shard and still joins every collective
    from torch.distributed.fsdp import fully_shard
    lone = torch.nn.Linear(8, 1, bias=False)
    fully_shard(lone, mesh=mesh)
    lone(torch.ones(2, 8)).sum().backward()
    out["lone_rows"] = lone.weight.to_local().shape[0]
    lone_sentinel = GradientSentinel(sharded=True)
    for step in (1, 2):
        if step == 2:
            lone.weight.grad.to_local().zero_()
        r = gradient_flow_report(lone.named_parameters(), reduce=reduce, sharded=True, world_size=world)
        lone_sentinel.observe(lone.named_parameters(), step, reduce=reduce)
        out[f"lone_{{step}}"] = dict(findings=[[f["category"], f["parameter"]] for f in r.findings()],
                                     norm=r.norms["weight"], sentinel=lone_sentinel.findings())
    (Path(sys.argv[1]) / f"rank{{rank}}.txt").write_text(json.dumps(out))
    dist.destroy_process_group()
''')


def check_sharded_arbiter(tmp_path, mode: str, nproc: int) -> None:
    import torch

    proc, outs = run_two_ranks(WORKER, tmp_path, timeout=300, nproc=nproc, args=(mode,))
    assert proc.returncode == 0 and all(outs), proc.stderr[-3000:]
    outs = [json.loads(o) for o in outs]
    got = outs[0]
    shard_dims = ["R", "S(0)"] if mode == "hsdp" else ["S(0)"]
    assert got["placements"][EMBEDDING] == shard_dims
    assert [o["local_rows"][EMBEDDING] for o in outs] == [49, 48] * (nproc // 2)  # uneven: the last shard padded
    for o in outs[1:]:  # every rank reaches the same verdict
        assert o["healthy"]["findings"] == got["healthy"]["findings"]
        assert o["planted"]["findings"] == got["planted"]["findings"]
        assert o["planted"]["dead_row_ranges"] == got["planted"]["dead_row_ranges"]
        assert o["sentinel_planted"] == got["sentinel_planted"]

    # a healthy sharded model: 0 findings, full-parameter norms equal to one process's, one collective
    assert got["healthy"]["findings"] == [] and got["healthy_reference"]["findings"] == []
    for key in ("norms", "weight_norms"):
        torch.testing.assert_close(got["healthy"][key], got["healthy_reference"][key], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["healthy"]["total_norm"], got["healthy_reference"]["total_norm"], rtol=1e-5, atol=0)
    assert got["healthy_calls"] == ["sum"] and got["planted_calls"] == ["sum"]
    assert got["sentinel_healthy"] == {} and got["sentinel_healthy_calls"] == ["sum"]
    for key in ("sentinel_norm", "total_grad_norm"):  # grad/norm: the full model's
        torch.testing.assert_close(got[key], got["healthy_reference"]["total_norm"], rtol=1e-5, atol=0)

    # the planted faults: each named, as on the unsharded model, dead rows by global index
    planted, reference = got["planted"], got["planted_reference"]
    assert sorted(planted["findings"]) == sorted(reference["findings"]) == sorted([
        ["zero", ZERO], ["vanishing", VANISHING], ["dead_rows", DEAD_MATRIX], ["dead_rows", EMBEDDING]])
    dead = got["dead_embedding"]
    assert planted["dead_row_ranges"] == reference["dead_row_ranges"]
    assert planted["dead_row_ranges"][DEAD_MATRIX] == [list(DEAD_MATRIX_ROWS)]
    assert sum(b - a + 1 for a, b in planted["dead_row_ranges"][EMBEDDING]) == len(dead)
    assert [r for a, b in planted["dead_row_ranges"][EMBEDDING] for r in range(a, b + 1)] == dead
    assert planted["dead_row_counts"] == reference["dead_row_counts"]
    assert planted["dead_row_counts"][DEAD_MATRIX] == [DEAD_MATRIX_ROWS[1] - DEAD_MATRIX_ROWS[0] + 1, 96]
    assert f"rows {DEAD_MATRIX_ROWS[0]}-{DEAD_MATRIX_ROWS[1]}" in " ".join(planted["messages"])
    torch.testing.assert_close(planted["norms"], reference["norms"], rtol=1e-5, atol=1e-7)
    # the sentinel judges the full parameters too: the zero and the vanishing gradient, at step 2
    assert got["sentinel_planted"] == {ZERO: ["zero", 2], VANISHING: ["vanishing", 2]}

    # an empty shard: a healthy one-row parameter passes with its full norm, a zeroed one is named
    assert [o["lone_rows"] for o in outs] == [1, 0] * (nproc // 2)  # shards of 2 ranks (HSDP: per replica)
    assert got["lone_1"]["findings"] == [] and got["lone_1"]["sentinel"] == {}
    assert got["lone_1"]["norm"] == pytest.approx(2 * 8 ** 0.5)  # d(sum of 2 rows of ones @ w) / dw = 2
    assert got["lone_2"]["findings"] == [["zero", "weight"]] and got["lone_2"]["sentinel"] == {"weight": ["zero", 2]}


def test_row_ranges_are_runs_of_consecutive_rows():
    assert row_ranges([1, 2, 3, 7, 9, 10]) == [[1, 3], [7, 7], [9, 10]]
    assert row_ranges([]) == []


@pytest.mark.distributed
def test_fsdp_arbiter_names_planted_faults_by_full_parameter_and_global_row(tmp_path):
    check_sharded_arbiter(tmp_path, "fsdp", 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_arbiter_names_planted_faults_by_full_parameter_and_global_row(tmp_path):
    check_sharded_arbiter(tmp_path, "hsdp", 4)
