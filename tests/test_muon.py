"""Muon at every stage: DeepSpeed's config and math, each whole matrix orthogonalized by one owner rank."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import muon_tasks as mt
import pytest
import torch
from torchrun_cases import run_cases

import zerodp
from zerodp.optim.muon_math import ns_flops, orthogonalize


def gap(a: dict, b: dict) -> float:
    """The largest relative difference of a parameter between two runs."""
    return max(((a[n] - p).norm() / p.norm()).item() for n, p in b.items())


# -- the math against DeepSpeed's and torch's own ---------------------------------------------------


@pytest.mark.parametrize("shape, heads", [((8, 24), None), ((24, 8), None), ((16, 16), None), ((3, 6, 10), None),
                                          ((24, 10), 3)])
def test_update_equals_deepspeeds_muon_update(shape, heads):
    original = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    torch.manual_seed(0)
    grad, momentum = torch.randn(shape), torch.randn(shape)
    for method, tol in (("gram", 1e-5), ("standard", 0.1)):  # standard runs in bf16 on a CPU
        with torch.compiler.set_stance("force_eager"):
            theirs = original.muon_update(grad.clone(), momentum.clone(), beta=0.9, ns_method=method, num_heads=heads)
        mine_momentum, mine_grad = momentum.clone(), grad.clone()
        mine_momentum.lerp_(mine_grad, 0.1)
        blend = mine_grad.lerp_(mine_momentum, 0.9)
        ours = orthogonalize(blend.reshape(-1), torch.Size(shape), ns_method=method, num_heads=heads).view(shape)
        assert (ours - theirs).abs().max().item() <= tol * theirs.abs().max().item(), method


def test_torch_flavour_equals_torch_muon():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 20))
    grad = torch.randn(12, 20)
    theirs = w.detach().clone().requires_grad_()
    opt = torch.optim.Muon([theirs], lr=0.1, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    theirs.grad = grad.clone()
    opt.step()
    blend = grad.lerp(grad * 0.05, 0.95)  # the momentum after one step is 0.05 g
    update = orthogonalize(blend.reshape(-1), w.shape, flavour="torch", adjust_lr_fn="match_rms_adamw").view(w.shape)
    ours = w.detach() * (1 - 0.1 * 0.01) - 0.1 * update
    torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-6)


# -- parity with one process -------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_at_every_stage_equals_one_process(pool, world, stage):
    ref = mt.reference(world)
    runs = pool.run(mt.train, world, stage)
    for run in runs:
        assert gap(run["params"], ref["params"]) <= 1e-5
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert [(name, muon) for name, muon, _ in runs[0]["groups"]] == [("muon-params", True), ("adam-params", False)]
    assert [lr for *_, lr in runs[0]["groups"]] == [mt.PARAMS["muon_lr"], mt.PARAMS["adam_lr"]]


def test_a_plain_pytorch_loop(pool):
    """``loss.backward(); optimizer.step()`` with the optimizer ``initialize`` returned: the same update."""
    ref = mt.reference(2, steps=3)
    for run in pool.run(mt.train, 2, 2, steps=3, plain=True):
        assert gap(run["params"], ref["params"]) <= 1e-5


def test_a_projection_orthogonalized_head_by_head(pool):
    """``param.muon_num_heads`` (DeepSpeed's attribute): the owner orthogonalizes each head's rows apart."""
    ref = mt.reference(2, steps=3, heads=3)
    for run in pool.run(mt.train, 2, 3, steps=3, heads=3):
        assert gap(run["params"], ref["params"]) <= 1e-5
        assert gap(run["params"], mt.reference(2, steps=3)["params"]) > 1e-4


def test_muon_in_bf16(pool):
    """bf16 forward and backward, fp32 masters, momentum and iterations: within bf16's reach of fp32."""
    ref = mt.reference(2, steps=3)
    for run in pool.run(mt.train, 2, 3, steps=3, bf16=True):
        assert gap({n: p.float() for n, p in run["params"].items()}, ref["params"]) <= 3e-2
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-2)


def test_muon_takes_the_clipped_gradient(pool):
    ref = mt.reference(2, steps=3, clip=0.5)
    for run in pool.run(mt.train, 2, 2, steps=3, clip=0.5):
        assert gap(run["params"], ref["params"]) <= 1e-5


def test_standard_iteration(pool):
    """``ns_method: standard`` runs in bf16 on a CPU, where a change of 1e-7 in the input moves the
    output by about 1.5% (one process and three ranks sum gradients in different orders): they
    agree to that."""
    params = dict(mt.PARAMS, ns_method="standard")
    ref = mt.reference(3, steps=3, params=params)
    for run in pool.run(mt.train, 3, 3, steps=3, params=params):
        assert gap(run["params"], ref["params"]) <= 3e-2
        assert run["ns_methods"] == ["standard"]


@pytest.mark.parametrize("stage, device", [(2, "cpu"), (3, "cpu"), (2, "nvme")])
def test_muon_with_optimizer_offload(pool, tmp_path, stage, device):
    """The iterations run on the host, tile by tile; on disk the momentum pages out with its tile."""
    zero = {"offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}, "sub_group_size": 40_000}
    ref = mt.reference(2)
    for run in pool.run(mt.train, 2, stage, **zero):
        assert gap(run["params"], ref["params"]) <= 1e-5


@pytest.mark.parametrize("saved, loaded", [((2, 2), (3, 3)), ((3, 3), (2, 1)), ((2, 0), (3, 2))])
def test_momentum_resumes_at_any_world_size_and_stage(pool, tmp_path, saved, loaded):
    """3 steps at (world, stage) ``saved``, a checkpoint, 2 more at ``loaded``: the momentum buffers
    and the AdamW half's moments come back resharded, so the run equals one process stepping on
    the same global batches."""
    pool.run(mt.train, saved[0], saved[1], steps=3, save=str(tmp_path))
    runs = pool.run(mt.train, loaded[0], loaded[1], steps=2, load=str(tmp_path))
    ref = mt.reference([saved[0]] * 3 + [loaded[0]] * 2)
    for run in runs:
        assert gap(run["params"], ref["params"]) <= 1e-5
    forgot = mt.reference([saved[0]] * 3 + [loaded[0]] * 2, forget_at=3)
    assert gap(runs[0]["params"], forgot["params"]) > 1e-3  # what a resume without the momentum gives


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_with_pipeline_stages(pool, stage):
    """Two pipeline stages x two data-parallel ranks: each stage's matrices have owners among its own
    data-parallel ranks."""
    import pp_tasks
    ref = mt.pipeline_reference(2, 3, 2)
    runs = pool.run(pp_tasks.train, 4, 2, stage, 3, 2, optimizer="Muon")
    got = {n: p for run in runs for n, p in run["params"].items()}
    assert gap(got, ref) <= 1e-5


@pytest.mark.parametrize("zero", [{"mics_shard_size": 2}, {"zero_hpz_partition_size": 2}])
def test_muon_with_partial_sharding(pool, zero):
    """MiCS shards over pairs of ranks (each pair orthogonalizes its matrices, as every pair does);
    hpZ keeps secondary copies: four ranks, stage 3."""
    ref = mt.reference(4)
    for run in pool.run(mt.train, 4, 3, **zero):
        assert gap(run["params"], ref["params"]) <= 1e-5


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_with_expert_parallelism(pool, stage):
    """Experts split over two expert-parallel groups of a four-rank world (their flat groups shard over the
    expert-data axis, where their owners are chosen) train as with every expert on every rank."""
    whole = {n: p for run in pool.run(mt.expert_run, 4, stage, 1) for n, p in run["params"].items()}
    runs = pool.run(mt.expert_run, 4, stage, 2)
    assert [r["local"] for r in runs] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    split = {n: p for run in runs for n, p in run["params"].items()}
    assert sorted(split) == sorted(whole)
    assert gap(split, whole) <= 1e-5


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_muon_with_tensor_parallelism(pool, stage):
    """Two tensor-parallel pairs (autotp) of two data-parallel ranks: a split matrix's owners (one per
    tensor-parallel rank) send their slices to the one of them that finishes it, which orthogonalizes the whole
    and sends the slices back: every matrix once over the four ranks (at stage 0 once per data-parallel rank,
    which holds them all)."""
    ref = mt.reference(2)
    runs = pool.run(mt.train, 4, stage, extra={"tensor_parallel": {"autotp_size": 2}})
    for run in runs:
        assert "error" not in run, run.get("error")
        assert gap(run["params"], ref["params"]) <= 1e-5
        assert run["comm"][-1]["muon_gather"] > 0
    matrices = [p for n, p in mt.model().named_parameters() if p.dim() >= 2]
    replicas = 2 if stage == 0 else 1
    assert sum(r["work"]["matrices"] for r in runs) == replicas * len(matrices)
    assert sum(r["work"]["flops"] for r in runs) == replicas * sum(ns_flops(p.shape) for p in matrices)


# -- the owners: each matrix once, about 1/N of the work per rank, the bytes the layout implies ------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_matrix_orthogonalized_once_and_balanced(pool, world):
    runs = pool.run(mt.train, world, 2, steps=1)
    net = mt.model()
    costs = [ns_flops(p.shape) for n, p in net.named_parameters() if p.dim() >= 2]
    assert sum(r["work"]["matrices"] for r in runs) == len(costs)
    assert sum(r["work"]["flops"] for r in runs) == sum(costs)
    assert max(r["work"]["flops"] for r in runs) <= sum(costs) / world + max(costs)  # greedy's bound
    muon_bytes = 4 * sum(p.numel() for n, p in net.named_parameters() if p.dim() >= 2)
    for r in runs:
        moved = r["comm"][-1]["muon_gather"] + r["comm"][-1]["muon_scatter"]
        assert 0 < moved <= 2 * muon_bytes / world + 4 * 64  # what it holds of others' matrices, out and back


def test_the_metrics_file_has_the_exchange(pool, tmp_path):
    rows = pool.run(mt.monitored, 2, str(tmp_path))[0]
    assert len(rows) == 2 and all(int(r["comm_muon_gather"]) > 0 and int(r["comm_muon_scatter"]) > 0 for r in rows)


def test_stage_0_exchanges_nothing(pool):
    runs = pool.run(mt.train, 2, 0, steps=1)
    assert all("muon_gather" not in r["comm"][-1] for r in runs)
    assert all(r["work"]["matrices"] == 10 for r in runs)


# -- the split, the tags, the errors ------------------------------------------------------------------


def _engine(config: dict, model=None, **kwargs):
    model = model or mt.model()
    engine, opt, _, _ = zerodp.initialize(model=model, config=config, **kwargs)
    return engine, opt


def test_caller_tags_are_kept_and_non_matrices_go_to_adamw(caplog):
    net = mt.model()
    net.blocks[0].mlp.c_fc.weight.use_muon = False
    net.ln_f.weight.use_muon = True  # not a matrix: AdamW, said
    with caplog.at_level(logging.INFO, logger="zerodp"):
        engine, opt = _engine(mt.config(1), net)
    matrices = sum(p.numel() for p in net.parameters() if p.dim() >= 2)
    assert engine.zero_optimization_stage() == 1
    assert sum(g.numel for g in engine.trainable if opt.param_groups[g.param_group]["use_muon"]) == \
        matrices - net.blocks[0].mlp.c_fc.weight.numel()
    assert "not matrices and go to the AdamW half: ln_f.weight" in caplog.text
    assert "Muon: 9 parameters" in caplog.text
    engine.destroy()


@pytest.mark.parametrize("params, key", [({"ns_method": "cubic"}, "ns_method"), ({"nesterov": 1}, "nesterov"),
                                         ({"per_head_muon": True}, "per_head_muon"), ({"lrr": 1.0}, "lrr"),
                                         ({"momentum": 1.0}, "momentum")])
def test_bad_muon_params_name_their_key(params, key):
    with pytest.raises(zerodp.ConfigError, match=f"optimizer.params.{key}"):
        _engine(mt.config(1, params))


def test_memory_ledger_counts_one_state_for_muon_and_two_for_adamw():
    from zerodp.tools.memory_check import compare_with_engine
    engine, opt = _engine(mt.config(1))
    _, loss = engine(mt.batch(0, 0), mt.batch(0, 0))
    engine.backward(loss)
    engine.step()
    found = {c.category: c for c in compare_with_engine(engine)}
    assert all(c.ok for c in found.values()), found
    muon = sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
    adam = sum(p.numel() for g in opt.param_groups if not g["use_muon"] for p in g["params"])
    assert found["optimizer_states"].measured == 4 * (muon + 2 * adam)
    engine.destroy()


def test_a_parameter_without_gradient_steps_on_zeros_as_in_deepspeed():
    """No rank uses ``idle``: DeepSpeed's Muon steps it on a zero gradient, so its momentum stays zero, its
    update is zero and only the weight decay moves it: ``(1 - muon_lr x weight_decay)`` per step."""
    net = mt.model()
    net.idle = torch.nn.Linear(64, 64, bias=False)
    before = net.idle.weight.detach().clone()
    engine, opt = _engine(mt.config(2), net)
    for step in range(3):
        _, loss = engine(mt.batch(step, 0), mt.batch(step, 0))
        engine.backward(loss)
        engine.step()
    decay = (1 - mt.PARAMS["muon_lr"] * mt.PARAMS["weight_decay"]) ** 3
    torch.testing.assert_close(engine.module.idle.weight.detach(), before * decay, rtol=1e-6, atol=0)
    engine.destroy()


def test_a_step_without_the_whole_matrix_update_raises():
    engine, opt = _engine(mt.config(1))
    _, loss = engine(mt.batch(0, 0), mt.batch(0, 0))
    engine.backward(loss)
    for g in engine.trainable:
        g.optim.attach_grads([True] * len(g.slots), g.grads.shard)
    with pytest.raises(RuntimeError, match="not orthogonalized"):
        type(opt).step(opt)
    engine.destroy()


def test_torch_muon_passed_in_runs_torchs_math(pool):
    """torch's bf16 iteration (the 1.5% its roundings allow, see ``test_standard_iteration``) and
    its ``adjust_lr_fn``: ``match_rms_adamw`` scales these matrices' updates by 2.4-3.2, where
    DeepSpeed's scale is 1-2."""
    runs = pool.run(mt.train_torch_muon, 2, 2)
    ref = mt.reference_torch_muon(2)
    for run in runs:
        assert gap(run, ref) <= 3e-2


# -- against DeepSpeed's own MuonWithAuxAdam ----------------------------------------------------------


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> tuple[dict, Path]:
    """One two-rank job of ``muon_ds_script.py``: DeepSpeed and zerodp side by side at stages 0-3,
    and DeepSpeed's Muon checkpoints after 3 steps at stages 1-3, resumed by zerodp for 2 more."""
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("muon_ds")
    found = run_cases(sys.executable, Path(__file__).parent / "muon_ds_script.py", tmp / "out.json", [],
                      ["z0", "z1", "z2", "z3", "resume-z1", "resume-z2", "resume-z3"], ranks=2)
    return found, tmp


@pytest.mark.parametrize("case", ["z0", "z1", "z2", "z3"])
def test_muon_equals_deepspeeds(deepspeed_runs, case):
    """Real DeepSpeed (its MuonWithAuxAdam; stage 3 with reduce_scatter false) and zerodp, two ranks,
    the same model, config and batches."""
    run = deepspeed_runs[0][case]
    assert run["gap"] <= 1e-5
    assert run["zerodp"] == pytest.approx(run["deepspeed"], rel=1e-6)
    assert run["deepspeed"][-1] < run["deepspeed"][0] - 0.5  # it trained


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_muon_checkpoints_resume(deepspeed_runs, stage):
    """DeepSpeed keeps Muon's momentum per partition at stage 3 and per whole parameter at stages
    1-2 (every parameter overlapping a rank's partition, whole): both load, and the run goes on as
    one process would."""
    run = deepspeed_runs[0][f"resume-z{stage}"]
    ours = torch.load(run["params"])
    assert gap(ours, mt.reference(2)["params"]) <= 1e-5
    assert gap(ours, mt.reference(2, forget_at=3)["params"]) > 1e-3


def test_deepspeeds_muon_checkpoint_loads_at_another_world_size_and_stage(pool, deepspeed_runs):
    where = deepspeed_runs[1] / "deepspeed-resume-z1"
    ref = mt.reference([2, 2, 2, 3, 3])
    for run in pool.run(mt.train, 3, 3, steps=2, load=str(where)):
        assert gap(run["params"], ref["params"]) <= 1e-5
