"""Out of memory is never fatal (issue 39): in the optimizer step, in an evaluation, while applying an
update, at a micro-batch of 1; and the device suspects that a CPU can show (S4, S6, S9, S10, S12, S13).

The allocation failures are real: a tensor of 2**50 bytes, which the CPU's allocator refuses with its
own "can't allocate memory" (what :func:`swarm.learning.is_oom` must recognise, as CUDA's)."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from swarm.config import TrainSection, load_config
from swarm.learning import (
    EvalSet,
    InnerTrainer,
    Interrupted,
    OuterOptimizer,
    OutOfDeviceMemory,
    Prefetcher,
    auto_micro_batch_size,
    build_model,
    evaluate_fitting,
)
from swarm.learning._optimizer import can_load_state, state_kind
from swarm.learning._precision import half_dtype
from swarm.trainer._peer import WholeModel
from tests._learning import CPU, TINY, OutOfMemoryAbove, batches


def huge_allocation() -> torch.Tensor:
    """A real allocation the CPU refuses (RuntimeError: DefaultCPUAllocator: can't allocate memory)."""
    return torch.empty(1 << 50, dtype=torch.uint8)


class FailingStep(torch.optim.AdamW):
    """torch's AdamW whose next ``failures`` steps run out of memory half-way (a real allocation)."""

    failures = 0

    def step(self, closure=None):  # type: ignore[override]
        if self.failures:
            self.failures -= 1
            huge_allocation()
        return super().step(closure)


def test_an_oom_in_the_optimizer_step_skips_that_update_and_training_goes_on(caplog) -> None:
    model = build_model(TINY, seed=0)
    optimizer = FailingStep(model.parameters(), lr=1e-2)
    trainer = InnerTrainer(model, TrainSection(batch_size=4), CPU, optimizer=optimizer, micro_batch_size=4)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.failures = 1
    with caplog.at_level(logging.WARNING, logger="swarm.learning.inner"):
        trainer.step(batches(1, batch_size=4))
    assert trainer.skipped_updates == 1 and "optimizer step" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # dropped with the update
    trainer.step(batches(1, batch_size=4, seed=1))  # the next one updates
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer.failures = 3
    with pytest.raises(OutOfDeviceMemory, match="3 times in a row"):
        for seed in range(3):
            trainer.step(batches(1, batch_size=4, seed=seed))


def test_an_evaluation_that_runs_out_halves_its_micro_batch_and_one_that_never_fits_is_skipped() -> None:
    eval_set = EvalSet(torch.randint(256, (4096,), dtype=torch.uint8), TINY.block_size, batch_size=8)
    model = OutOfMemoryAbove(build_model(TINY, seed=0), limit=2, run_out=lambda _: huge_allocation())
    loss = evaluate_fitting(model, eval_set, 1, micro_batch_size=8)
    assert loss is not None and loss > 0 and model.sizes[:3] == [8, 4, 2]
    never = OutOfMemoryAbove(build_model(TINY, seed=0), limit=0, run_out=lambda _: huge_allocation())
    assert evaluate_fitting(never, eval_set, 1, micro_batch_size=2) is None
    assert never.sizes == [2, 1]


def test_a_probe_that_runs_out_empties_the_cache_after_its_activations_are_gone(monkeypatch) -> None:
    """S5: the cache is emptied once the error's traceback (which holds the probe's activations) is
    gone, not in a ``finally`` while it propagates."""
    held: list[weakref.ref] = []
    seen_alive: list[bool] = []

    def probe(candidate: int) -> int:
        activations = torch.ones(1024)
        held.append(weakref.ref(activations))
        if candidate > 2:
            huge_allocation()
        return 0

    def release(device: torch.device) -> None:
        gc.collect()
        seen_alive.append(any(ref() is not None for ref in held))

    monkeypatch.setattr("swarm.learning._micro_batch.release_cached", release)
    micro = auto_micro_batch_size(
        nn.Linear(1, 1), 8, torch.device("cuda"), batch_size=8, free_bytes=1 << 30, probe=probe
    )
    assert micro == 2 and len(seen_alive) == 3 and not any(seen_alive)


def test_an_oom_applying_an_update_drops_it_and_training_goes_on(caplog) -> None:
    def apply_runs_out(backend: object, samples: int) -> list:
        huge_allocation()
        return ["a round"]

    peer = SimpleNamespace(core=SimpleNamespace(rounds_after_step=apply_runs_out), backend=None, device=CPU)
    with caplog.at_level(logging.WARNING, logger="swarm.trainer._peer"):
        assert WholeModel._rounds_after_step(peer, 4) == []  # type: ignore[arg-type]
    assert "applying an exchange's update" in caplog.text

    def other_error(backend: object, samples: int) -> list:
        raise RuntimeError("shape mismatch")

    failing = SimpleNamespace(core=SimpleNamespace(rounds_after_step=other_error), backend=None, device=CPU)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        WholeModel._rounds_after_step(failing, 4)  # type: ignore[arg-type]


def test_out_of_memory_at_one_sample_stops_with_the_config_checks_advice() -> None:
    """The outer state cannot move (``outer_state_device: device``): the error carries the advice."""
    config = load_config("configs/llama-1b.yaml", ["averaging.outer_state_device=device"], env={})
    model = nn.Linear(2, 2)
    backend = SimpleNamespace(outer=OuterOptimizer(model, 0.7, 0.9), update_guard=None)
    peer = SimpleNamespace(config=config, backend=backend, device=CPU)
    peer._memory_advice = lambda: WholeModel._memory_advice(peer)  # type: ignore[arg-type]
    with pytest.raises(OutOfDeviceMemory, match="swarm config check advises"):
        WholeModel._out_of_device_memory(peer, OutOfDeviceMemory("out of memory at 1 sample"))  # type: ignore[arg-type]


def test_the_outer_state_moves_to_the_host_one_tensor_at_a_time() -> None:
    model = nn.Linear(3, 2)
    outer = OuterOptimizer(model, 0.7, 0.9, state_device="meta")
    outer.momentum_buffers = {name: torch.empty(t.shape, device="meta") for name, t in outer.anchor.items()}
    outer.anchor = {name: torch.zeros(t.shape) for name, t in outer.anchor.items()}  # meta holds no data
    outer.momentum_buffers = {name: torch.zeros(t.shape) for name, t in outer.momentum_buffers.items()}
    outer.move_state("cpu")
    assert outer.state_device == CPU
    assert all(t.device == CPU for t in (*outer.anchor.values(), *outer.momentum_buffers.values()))


def test_reset_anchor_overwrites_the_anchor_in_place() -> None:
    """A joiner's new anchor takes the old one's memory: never both at once."""
    model = nn.Linear(4, 4)
    outer = OuterOptimizer(model, 0.7, 0.9)
    pointers = {name: t.data_ptr() for name, t in outer.anchor.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    outer.reset_anchor()
    assert {name: t.data_ptr() for name, t in outer.anchor.items()} == pointers
    assert torch.equal(outer.anchor["weight"], model.weight)


# ------------------------------------------------------------------ S10: resume into another optimizer


def test_a_checkpoint_of_another_optimizer_kind_is_not_loaded(caplog) -> None:
    model = build_model(TINY, seed=0)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    adamw.step()
    eight_bit = {"state": {0: {"state1": torch.zeros(4), "absmax1": torch.ones(1)}}, "param_groups": []}
    assert state_kind(adamw.state_dict()) == "adamw" and state_kind(eight_bit) == "adamw8bit"
    assert can_load_state(adamw, adamw.state_dict()) and not can_load_state(adamw, eight_bit)
    assert can_load_state(adamw, {"state": {}, "param_groups": []})  # nothing saved yet: loads
    peer = SimpleNamespace(inner=SimpleNamespace(optimizer=adamw, optimizer_name="adamw"))
    with caplog.at_level(logging.WARNING, logger="swarm.trainer._peer"):
        WholeModel._load_inner_optimizer(peer, eight_bit, "adamw8bit")  # type: ignore[arg-type]
    assert "starting the inner optimizer afresh" in caplog.text
    assert state_kind(adamw.state_dict()) == "adamw"  # its own state, untouched


# ------------------------------------------------------------------ S4, S6, S9, S12, S13


def test_a_bitsandbytes_whose_kernels_fail_leaves_auto_on_the_torch_codec(monkeypatch) -> None:
    from swarm.compression import _quantize

    class Broken:
        def quantize_blockwise(self, *args, **kwargs):
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    _quantize.bnb_works.cache_clear()
    monkeypatch.setattr(_quantize, "bnb_functional", lambda: Broken())
    assert not _quantize.bnb_works(CPU, 64)
    _quantize.bnb_works.cache_clear()
    monkeypatch.setattr(_quantize, "bnb_works", lambda device, block: False)
    monkeypatch.setattr(_quantize, "bnb_supports", lambda block: True)
    assert _quantize.resolve_backend("auto", 64, torch.device("cuda")) == "torch"
    monkeypatch.setattr(_quantize, "bnb_works", lambda device, block: True)
    assert _quantize.resolve_backend("auto", 64, torch.device("cuda")) == "bnb"


def test_auto_layout_compares_against_the_memory_available_not_the_cards_total(monkeypatch) -> None:
    from swarm.learning import estimate

    monkeypatch.setattr(estimate, "adamw8bit_works", lambda device: True)
    config = load_config("configs/gpt-125m.yaml", env={})
    need = estimate.estimate_peer(config, "cuda", eight_bit=True).device_memory(False)
    cuda = torch.device("cuda")
    assert not estimate.outer_state_on_host(config, cuda, available=2 * need)
    assert estimate.outer_state_on_host(config, cuda, available=need)  # a display took the rest
    monkeypatch.setattr(estimate, "available_device_bytes", lambda device: need)
    assert estimate.outer_state_on_host(config, cuda)


def test_an_mps_device_without_bf16_keeps_its_compact_copies_in_fp16() -> None:
    mps = torch.device("mps")
    assert half_dtype(mps, bf16_supported=lambda d: False) == torch.float16
    assert half_dtype(mps, bf16_supported=lambda d: True) == torch.bfloat16
    assert half_dtype(CPU) == torch.bfloat16


def test_the_advice_names_pipeline_stages_only_where_the_pipeline_can_split_the_model() -> None:
    from swarm.learning.estimate import estimate_peer
    from swarm.learning.fit import fit_peer

    llama = load_config("configs/llama-1b.yaml", env={})
    advice = " ".join(fit_peer(llama, estimate_peer(llama, "cuda"), 4 << 30, None).advice)
    assert "cannot be split over pipeline stages" in advice and "split the model over" not in advice
    gpt = load_config("configs/gpt-125m.yaml", env={})
    assert "split the model over pipeline stages" in " ".join(
        fit_peer(gpt, estimate_peer(gpt, "cuda"), 1 << 30, None).advice
    )


def test_a_stop_interrupts_a_wait_for_a_stalled_source() -> None:
    released = threading.Event()

    def stalled():
        released.wait()  # a streamed dataset that stopped answering
        yield torch.zeros(1, 4), torch.zeros(1, 4)

    stop = threading.Event()
    prefetcher = Prefetcher(stalled())
    try:
        stop.set()
        with pytest.raises(Interrupted):
            prefetcher.draw(stop)
        assert prefetcher.samples_drawn == 0
    finally:
        released.set()
        prefetcher.close()
