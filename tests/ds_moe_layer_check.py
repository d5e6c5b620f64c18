"""DeepSpeed's own MoE layer against zerodp's, in one process (expert-parallel size 1): for each gate
configuration, both layers are made on the same seed and run forward and backward on the same input
and seed; prints one JSON line per configuration with the largest differences found (outputs,
``l_aux``, ``exp_counts``, input and parameter gradients).

Run with DeepSpeed installed: ``DS_ACCELERATOR=cpu python tests/ds_moe_layer_check.py``.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: name -> MoE keyword arguments (hidden 8, 4 experts, 24 tokens). The "tight" and "cap" cases drop
#: routes by capacity whatever the gate decides: top-1 at factor 0.5 keeps at most 4 x 3 of 24 tokens,
#: top-2 at 0.5 at most 4 x 6 of 48 routes, top-3 at 0.5 at most 4 x 9 of 72.
CASES = {
    "top1": dict(k=1, min_capacity=0),
    "top1-cap4-rts": dict(k=1, capacity_factor=0.5, min_capacity=4),
    "top1-no-rts": dict(k=1, capacity_factor=0.5, min_capacity=0, use_rts=False),
    "top1-rsample": dict(k=1, min_capacity=0, noisy_gate_policy="RSample"),
    "top1-jitter": dict(k=1, min_capacity=0, noisy_gate_policy="Jitter"),
    "top1-no-drop": dict(k=1, min_capacity=0, drop_tokens=False),
    "top1-residual": dict(k=1, min_capacity=0, use_residual=True),
    "top2": dict(k=2, min_capacity=0),
    "top2-tight": dict(k=2, capacity_factor=0.5, min_capacity=0),
    "top2-no-sampling": dict(k=2, min_capacity=0, top2_2nd_expert_sampling=False),
    "top2-no-drop": dict(k=2, min_capacity=0, drop_tokens=False),
    "top3-tight": dict(k=3, capacity_factor=0.5, min_capacity=0),
    "top3-no-drop": dict(k=3, min_capacity=0, drop_tokens=False),
    "top2-eval": dict(k=2, min_capacity=0, eval_capacity_factor=0.5),
}


def run(moe_cls, kwargs: dict, train: bool) -> dict:
    torch.manual_seed(0)
    layer = moe_cls(hidden_size=8, expert=torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                                              torch.nn.Linear(16, 8)), num_experts=4, **kwargs)
    with torch.no_grad():  # the copies of the expert apart, so that which expert runs shows
        for i, p in enumerate(layer.deepspeed_moe.experts.parameters()):
            p.add_(0.01 * (i + 1))
    layer.train(train)
    torch.manual_seed(1)
    x = torch.randn(3, 8, 8, requires_grad=True)
    out, l_aux, counts = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().add(l_aux).backward()
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts, "x_grad": x.grad,
            "params": {n: p.detach().clone() for n, p in layer.named_parameters()},
            "grads": {n: p.grad for n, p in layer.named_parameters()}}


def diff(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return (a.double() - b.double()).abs().max().item()


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from zerodp.moe.layer import MoE
    for name, kwargs in CASES.items():
        train = not name.endswith("-eval")
        want, got = run(DeepSpeedMoE, kwargs, train), run(MoE, kwargs, train)
        assert set(want["params"]) == set(got["params"]), (sorted(want["params"]), sorted(got["params"]))
        row = {"case": name, "out": diff(want["out"], got["out"]), "l_aux": diff(want["l_aux"], got["l_aux"]),
               "counts": diff(want["counts"], got["counts"]), "x_grad": diff(want["x_grad"], got["x_grad"]),
               "init": max(diff(want["params"][n], got["params"][n]) for n in want["params"]),
               "grads": max(diff(want["grads"][n], got["grads"][n]) for n in want["grads"]),
               "out_norm": want["out"].norm().item()}
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
