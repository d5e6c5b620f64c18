"""The estimator with expert parallelism (``zerodp estimate --ep N``, ``estimator/experts.py``).

transformers' Qwen3-MoE, 2 layers, hidden 16, 4 experts of width 8, top-2: each layer's fused
experts hold gate_up 4·16·16 = 1024 and down 4·16·8 = 512 elements, 3,072 over both layers. bf16
mixed accounting (2 + 2 + 4 + 8 bytes per element); 4 ranks. Expected numbers are worked out by
hand, never read back from the estimator."""
import json

import pytest

import zerodp
from zerodp.estimator import EstimateError
from zerodp.tools import cli

EXPERTS = 3_072


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3moe")
    transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=32).save_pretrained(path)
    return str(path)


def test_expert_states_shard_over_the_ranks_holding_the_same_experts(moe):
    plain = zerodp.estimate(moe, ranks_per_node=4)
    est = zerodp.estimate(moe, ranks_per_node=4, ep=2)
    assert est.model.expert_params == EXPERTS and est.model.moe_layers == 2 and est.model.top_k == 2
    dense = est.model.params - EXPERTS
    # stage 0: the dense part and half the experts, whole, 16 bytes each
    assert est.row(0).model_states == 16 * (dense + EXPERTS // 2)
    # stage 1: 16-bit parameters and gradients whole, master and Adam over 4 (dense) and 2 (experts)
    assert est.row(1).model_states == 4 * (dense + EXPERTS // 2) + 12 * dense // 4 + 12 * (EXPERTS // 2) // 2
    # stage 3: 16 Ψ / N either way
    assert est.row(3).model_states == plain.row(3).model_states == 16 * est.model.params // 4
    assert est.to_dict()["ep"] == 2


def test_all_to_all_and_gather_bytes(moe):
    """b 1, s 8, k 2, h 16, bf16, ep 2 of 4 ranks: all-to-alls 4·2·1·8·2·16·2·(1/2) = 2,048 bytes;
    stage 3's expert gathers 2·3,072·2·3/4 = 9,216 without, 2·1,536·2·1/2 = 3,072 with: a saving of
    9,216 - 3,072 - 2,048 = 4,096."""
    est = zerodp.estimate(moe, ranks_per_node=4, ep=2, seq_len=8)
    note = next(n for n in est.notes if n.startswith("expert parallelism"))
    assert "2.0 KB of token all-to-alls" in note and "gathers 3.1 KB of experts instead of 9.2 KB" in note
    assert "saves 4.1 KB" in note


@pytest.mark.parametrize("kw,why", [
    ({"ep": 3}, "3 does not divide the 4 ranks"),
    ({"ep": 8, "ranks_per_node": 8}, "8 does not divide the model's 4 experts"),
    ({"ep": 2, "tp": 2}, "beside tensor"),
    ({"ep": 2, "cluster": "h100-8x"}, "step times with expert parallelism are not modelled"),
])
def test_expert_parallel_refusals(moe, kw, why):
    kw = {"ranks_per_node": 4, **kw}
    with pytest.raises(EstimateError) as e:
        zerodp.estimate(moe, **kw)
    assert e.value.name == "ep" and why in e.value.detail
    with pytest.raises(EstimateError, match="bare parameter count"):
        zerodp.estimate("7B", ranks_per_node=4, ep=2)


def test_cli_ep(moe, capsys):
    assert cli.main(["estimate", "--model", moe, "--ranks-per-node", "4", "--ep", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ep"] == 2 and any(n.startswith("expert parallelism") for n in out["notes"])
