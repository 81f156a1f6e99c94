"""LoRA adapters against transformers + peft: the same random adapter (rank 8, q/k/v/o and the MLP), made and
saved by peft in its own file layout, gives Brine's model the logits peft gives transformers' (float32,
the model tests' tolerance), over a tiny random model of each architecture; and in a step shared with base
rows and another adapter's rows, every row keeps the bits it has alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.lora.manager import LoRAManager
from engine.model.loading.loader import load_model

peft = pytest.importorskip("peft")

TOL = dict(atol=2e-4, rtol=2e-4)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(
    hf: torch.nn.Module, path: Path, seed: int, alpha: float = 16.0, targets: list[str] = TARGETS
) -> torch.nn.Module:
    """peft's LoRA over a copy of `hf`, with random A and B (peft's init leaves B zero), saved to `path`."""
    import copy

    config = peft.LoraConfig(r=8, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture
def setup(arch, tiny_model, tmp_path):
    tiny = tiny_model(arch)
    refs = {name: peft_adapter(tiny.hf, tmp_path / name, seed) for name, seed in (("a", 1), ("b", 2))}
    model = load_model(tiny.path, torch.device("cpu"), torch.float32)
    manager = LoRAManager(model, torch.device("cpu"), max_loras=4, max_lora_rank=16)
    adapters = {name: manager.load(name, str(tmp_path / name)) for name in refs}
    return tiny, model, manager, adapters, refs


def run(paged_cls, model, manager, batch):
    """batch: (token ids, adapter or None) per request, each a fresh prefill -> logits per request."""
    paged = paged_cls(model)
    reqs = [SimpleNamespace(new_token_ids=ids, lora=adapter) for ids, adapter in batch]
    with manager.step(reqs):
        return paged.step([(ids, 0, paged.table_for(len(ids))) for ids, _ in batch])


def test_peft_saved_the_layout_brine_reads(setup, tmp_path):
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"] or files == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    _, _, _, adapters, _ = setup
    assert adapters["a"].num_targets == len(TARGETS) * 2  # every target of both layers
    assert len(adapters["a"].deltas) == 4 * 2  # one delta per fused linear (q/k/v, o, gate/up, down)


def test_adapter_logits_match_peft(setup, paged):
    tiny, model, manager, adapters, refs = setup
    ids = [5, 17, 99, 3, 64, 12, 7, 120, 1, 44]
    for name in ("a", "b"):
        with torch.no_grad():
            want = refs[name](torch.tensor([ids])).logits[0].float()
        (got,) = run(paged, model, manager, [(ids, adapters[name])])
        torch.testing.assert_close(got, want, **TOL)
        # The adapter changes the output well beyond the tolerance: the test would see a missing delta.
        assert (want - tiny.logits(ids)).abs().max() > 100 * TOL["atol"]
    (base,) = run(paged, model, manager, [(ids, None)])
    torch.testing.assert_close(base, tiny.logits(ids), **TOL)


def test_a_mixed_step_gives_every_row_its_solo_bits(setup, paged):
    _, model, manager, adapters, _ = setup
    prompts = [[5, 17, 99, 3], [8, 8, 1, 40, 2, 9], [77, 3], [5, 17, 99, 3, 11]]
    owners = [None, adapters["a"], adapters["b"], adapters["a"]]
    alone = [run(paged, model, manager, [(p, o)])[0] for p, o in zip(prompts, owners, strict=True)]
    together = run(paged, model, manager, list(zip(prompts, owners, strict=True)))
    for solo, mixed in zip(alone, together, strict=True):
        assert torch.equal(solo, mixed)
    # Same tokens under the base and adapter a differ: the rows did run their own weights.
    assert not torch.equal(alone[0], run(paged, model, manager, [(prompts[0], adapters["a"])])[0])


def test_some_targets_only_match_peft(tiny_model, paged, tmp_path):
    """q and v only (peft's usual default), and up and down without gate: the absent targets' columns of a
    fused linear get nothing."""
    tiny = tiny_model("llama")
    ref = peft_adapter(tiny.hf, tmp_path / "qv", 3, targets=["q_proj", "v_proj", "up_proj", "down_proj"])
    model = load_model(tiny.path, torch.device("cpu"), torch.float32)
    manager = LoRAManager(model, torch.device("cpu"), max_loras=1, max_lora_rank=8)
    adapter = manager.load("qv", str(tmp_path / "qv"))
    assert adapter.num_targets == 8 and len(adapter.deltas) == 6  # no o_proj delta in either layer
    ids = [5, 17, 99, 3, 64, 12]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    (got,) = run(paged, model, manager, [(ids, adapter)])
    torch.testing.assert_close(got, want, **TOL)
    assert (want - tiny.logits(ids)).abs().max() > 100 * TOL["atol"]


@pytest.mark.cuda
def test_adapter_logits_match_peft_on_cuda(tiny_model, paged, tmp_path):
    """The same design on CUDA (the deltas as float32 matmuls on the device), against peft on the CPU."""
    tiny = tiny_model("llama")
    ref = peft_adapter(tiny.hf, tmp_path / "a", 1)
    device = torch.device("cuda")
    model = load_model(tiny.path, device, torch.float32)
    manager = LoRAManager(model, device, max_loras=1, max_lora_rank=8)
    adapter = manager.load("a", str(tmp_path / "a"))
    ids = [5, 17, 99, 3, 64, 12, 7, 120]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    (got,) = run(paged, model, manager, [(ids, adapter)])
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)  # TF32-free float32, other kernels
    (base,) = run(paged, model, manager, [(ids, None)])
    torch.testing.assert_close(base.cpu(), tiny.logits(ids), atol=2e-3, rtol=2e-3)
