"""LoRA adapter sync without an engine: PEFT names, the adapter specs of ``init_info.lora``,
an adapter that does not fit an engine's slots refused before anything is written, several
adapters by id, and the trainer side's ``adapter_state`` (the adapters only, no copies)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protocol import AdapterMismatchError, ConfigError
from receiver.vllm.adapters import AdapterKey, Slots, SlotShape, parse_key, parse_specs, plan_adapters
from sender import adapter_state

HIDDEN, KV, INTER, R = 128, 64, 256, 8
ATTN = "model.layers.{}.self_attn"
MLP = "model.layers.{}.mlp"


def slots(layers: int = 2, max_rank: int = 8, max_loras: int = 3, max_cpu_loras: int = 4) -> Slots:
    """A Qwen2-like engine's LoRA layers: qkv_proj packed from q, k, v; gate_up from gate, up."""
    modules = {}
    for i in range(layers):
        modules[f"{ATTN.format(i)}.qkv_proj"] = SlotShape(("q_proj", "k_proj", "v_proj"), HIDDEN, (HIDDEN, KV, KV))
        modules[f"{ATTN.format(i)}.o_proj"] = SlotShape(("o_proj",), HIDDEN, (HIDDEN,))
        modules[f"{MLP.format(i)}.gate_up_proj"] = SlotShape(("gate_proj", "up_proj"), HIDDEN, (INTER, INTER))
        modules[f"{MLP.format(i)}.down_proj"] = SlotShape(("down_proj",), INTER, (HIDDEN,))
    return Slots(modules, max_rank, max_loras, max_cpu_loras)


SIZES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
         "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}  # (in, out)


def trainer_tensors(
    adapter: str = "default", r: int = R, layers: int = 2, modules: tuple[str, ...] = tuple(SIZES),
) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for i in range(layers):
        for leaf in modules:
            parent = ATTN if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") else MLP
            n_in, n_out = SIZES[leaf]
            stem = f"base_model.model.{parent.format(i)}.{leaf}"
            out += [(f"{stem}.lora_A.{adapter}.weight", (r, n_in)), (f"{stem}.lora_B.{adapter}.weight", (n_out, r))]
    return out


def spec(ident: int = 1, name: str = "policy", r: int = R, targets: tuple[str, ...] = tuple(SIZES)) -> dict:
    return {"id": ident, "name": name, "r": r, "lora_alpha": 16, "target_modules": list(targets)}


def test_peft_names_map_to_the_saved_names_vllm_loads() -> None:
    key = parse_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert key == AdapterKey("default", "model.layers.0.self_attn.q_proj", True)
    assert key.file_name == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert parse_key("base_model.model.model.layers.1.mlp.down_proj.lora_B.critic.weight").a is False
    for bad in ("model.layers.0.self_attn.q_proj.weight", "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
                "base_model.model.x.lora_A.weight"):  # a base weight; PEFT's saved name (no adapter): not a trainer's
        with pytest.raises(AdapterMismatchError):
            parse_key(bad)


def test_a_planned_adapter_lands_in_the_packed_layers() -> None:
    plan = plan_adapters(trainer_tensors(), parse_specs({"default": spec()}), slots())
    assert len(plan) == 2 * 7 * 2
    q = plan["base_model.model.model.layers.1.self_attn.k_proj.lora_B.default.weight"]
    assert (q.layer, q.index, q.key.a) == ("model.layers.1.self_attn.qkv_proj", 1, False)
    up = plan["base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"]
    assert (up.layer, up.index) == ("model.layers.0.mlp.gate_up_proj", 1)
    assert parse_specs({"default": spec()})["default"].scaling == 2.0


def test_several_adapters_by_id() -> None:
    specs = parse_specs({"default": spec(1, "policy"), "second": spec(2, "critic", r=4, targets=("q_proj", "v_proj"))})
    tensors = trainer_tensors("default") + trainer_tensors("second", r=4, modules=("q_proj", "v_proj"))
    plan = plan_adapters(tensors, specs, slots())
    by_adapter = {a: sum(1 for p in plan.values() if p.key.adapter == a) for a in specs}
    assert by_adapter == {"default": 28, "second": 8}
    assert {s.id for s in specs.values()} == {1, 2}
    with pytest.raises(ConfigError, match="share one id"):
        parse_specs({"default": spec(1, "policy"), "second": spec(1, "critic")})
    with pytest.raises(ConfigError, match="share one name"):
        parse_specs({"default": spec(1, "policy"), "second": spec(2, "policy")})
    with pytest.raises(AdapterMismatchError, match="max_loras"):  # every adapter is pinned in its own slot
        plan_adapters(tensors, specs, slots(max_loras=1))


@pytest.mark.parametrize(("case", "match"), [
    ("rank_above_the_engine", "above the engine's max_lora_rank"),
    ("rank_other_than_declared", "has shape"),
    ("module_not_declared", "not among adapter"),
    ("module_the_engine_lacks", "no LoRA layer"),
    ("adapter_without_id", "gives no id"),
    ("adapter_not_sent", "does not send"),
    ("half_a_module", "only one of lora_A and lora_B"),
])
def test_an_adapter_that_does_not_fit_is_refused(case: str, match: str) -> None:
    tensors, lora, engine = trainer_tensors(), {"default": spec()}, slots()
    if case == "rank_above_the_engine":
        tensors, lora = trainer_tensors(r=16), {"default": spec(r=16)}
    elif case == "rank_other_than_declared":
        lora = {"default": spec(r=4)}
    elif case == "module_not_declared":
        lora = {"default": spec(targets=("q_proj", "k_proj", "v_proj", "o_proj"))}
    elif case == "module_the_engine_lacks":
        engine = Slots({k: v for k, v in engine.modules.items() if not k.endswith("o_proj")}, 8, 3, 4)
    elif case == "adapter_without_id":
        tensors = tensors + trainer_tensors("other", modules=("q_proj",))
    elif case == "adapter_not_sent":
        lora = {**lora, "second": spec(2, "critic")}
    elif case == "half_a_module":
        tensors = [t for t in tensors if "layers.1.mlp.down_proj.lora_B" not in t[0]]
    with pytest.raises(AdapterMismatchError, match=match):
        plan_adapters(tensors, parse_specs(lora), engine)
    assert issubclass(AdapterMismatchError, ConfigError)


@pytest.mark.parametrize("bad", [
    {}, {"default": {"id": 0, "name": "p", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}},
    {"default": {"id": 1, "name": "p", "r": 8, "lora_alpha": 16}},
    {"default": {"id": 1, "name": "p", "r": 8, "lora_alpha": 16, "target_modules": "q_proj"}},
    {"default": {"id": 1, "name": "p", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "dora": True}},
    {"a.b": {"id": 1, "name": "p", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}},
])
def test_init_info_lora_is_checked_at_the_boundary(bad: dict) -> None:
    with pytest.raises(ConfigError):
        parse_specs(bad)
    pytest.importorskip("vllm")
    from receiver.vllm.backend import WeightsyncInitInfo

    with pytest.raises(ConfigError):
        WeightsyncInitInfo(endpoint="tcp://127.0.0.1:1", lora=bad)
    assert WeightsyncInitInfo(endpoint="tcp://127.0.0.1:1", lora={"default": spec()}).lora == {"default": spec()}


class _Lora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(4, 4)
        self.base_layer.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False), "second": nn.Linear(4, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False), "second": nn.Linear(2, 4, bias=False)})


def test_adapter_state_is_the_adapters_parameters_themselves() -> None:
    model = nn.Module()
    model.base_model = nn.Module()
    model.base_model.model = nn.ModuleDict({"q_proj": _Lora()})
    state = adapter_state(model)
    assert sorted(state) == sorted(f"base_model.model.q_proj.lora_{m}.{a}.weight" for m in "AB" for a in ("default", "second"))
    assert state["base_model.model.q_proj.lora_A.default.weight"] is model.base_model.model["q_proj"].lora_A["default"].weight
    assert sorted(adapter_state(model, ["second"])) == sorted(f"base_model.model.q_proj.lora_{m}.second.weight" for m in "AB")
    with pytest.raises(ConfigError):
        adapter_state(model, ["third"])
    with pytest.raises(ConfigError):
        adapter_state(nn.Linear(2, 2))
    assert all(isinstance(t, torch.Tensor) for t in state.values())
