"""What a peer does about its device: precision, optimizer fallback, out-of-memory, MPS, evaluation in
chunks, prefetching and throughput figures. CPU fakes stand in for GPUs; tests named ``cuda`` need one."""

from __future__ import annotations

import builtins
import dataclasses
import itertools
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarm.config import ModelSection, TrainSection, load_config
from swarm.learning import (
    EvalSet,
    InnerTrainer,
    Precision,
    Prefetcher,
    Throughput,
    _optimizer,
    auto_micro_batch_size,
    build_model,
    chunked_cross_entropy,
    count_parameters,
    evaluate,
    flops_per_token,
    is_oom,
    make_inner_optimizer,
    peak_flops,
    resolve_device,
    resolve_precision,
)
from swarm.learning._micro_batch import OutOfDeviceMemory
from swarm.learning.estimate import estimate_peer
from tests._learning import CPU, TINY, OutOfMemoryAbove, batches
from tests._markers import needs_cuda

CUDA = torch.device("cuda")


# ------------------------------------------------------------------ out of memory


def test_an_oom_halves_the_micro_batch_and_the_step_equals_one_at_the_smaller_size(caplog) -> None:
    flaky = OutOfMemoryAbove(build_model(TINY, seed=0), limit=4)
    steady = build_model(TINY, seed=0)
    cfg = TrainSection(batch_size=16)
    trainers = [
        InnerTrainer(flaky, cfg, CPU, micro_batch_size=16),
        InnerTrainer(steady, cfg, CPU, micro_batch_size=4),
    ]
    with caplog.at_level(logging.WARNING, logger="swarm.learning.inner"):
        stats = [t.step(batches(1), lr=1e-2) for t in trainers]
        trainers[0].step(batches(1, seed=1))  # no further halving, no further log
    assert trainers[0].micro_batch_size == 4 and trainers[0].oom_retries == 2  # 16 -> 8 -> 4
    assert flaky.sizes[:3] == [16, 8, 4]
    assert sum("out of memory" in r.getMessage() for r in caplog.records) == 1
    assert stats[0].samples == 16 and stats[0].loss == pytest.approx(stats[1].loss, rel=1e-6)
    trainers[1].step(batches(1, seed=1))
    for a, b in zip(flaky.inner.parameters(), steady.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_an_oom_at_one_sample_says_so_and_another_error_is_raised() -> None:
    flaky = OutOfMemoryAbove(build_model(TINY, seed=0), limit=0)
    trainer = InnerTrainer(flaky, TrainSection(batch_size=2), CPU, micro_batch_size=2)
    with pytest.raises(OutOfDeviceMemory, match="micro-batch of 1 sample"):
        trainer.step(batches(1, batch_size=2))
    assert trainer.micro_batch_size == 1
    assert all(p.grad is None for p in flaky.parameters())  # nothing of the step kept
    assert is_oom(RuntimeError("HIP out of memory")) and not is_oom(RuntimeError("shape mismatch"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"))


def test_micro_batch_from_free_memory_less_the_state_to_come() -> None:
    model = build_model(TINY, seed=0)

    def probe(n: int) -> int:
        return 1000 * n

    def size(free: int, reserve: int = 0) -> int:
        return auto_micro_batch_size(
            model, 16, CUDA, 32, reserve_bytes=reserve, memory_fraction=1.0, free_bytes=free, probe=probe
        )

    assert size(40_000) == 32
    assert size(40_000, reserve=20_000) == 16  # the optimizer state still to come leaves less
    assert size(10_000, reserve=20_000) == 1  # nothing left: start small, halve no further

    def oom_above_8(n: int) -> int:
        if n > 8:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 0

    assert auto_micro_batch_size(model, 16, CUDA, 32, free_bytes=1 << 30, probe=oom_above_8) == 8


# ------------------------------------------------------------------ evaluation


def test_chunked_cross_entropy_equals_the_whole_vocabulary_one() -> None:
    logits = torch.randn(3, 7, 1000, generator=torch.Generator().manual_seed(0)) * 5
    targets = torch.randint(1000, (3, 7))
    whole = F.cross_entropy(logits.reshape(-1, 1000), targets.reshape(-1), reduction="sum")
    for chunk in (128, 300, 1000, 4096):
        assert torch.allclose(chunked_cross_entropy(logits, targets, chunk), whole, rtol=1e-5)


def test_evaluation_at_the_micro_batch_in_vocabulary_chunks_equals_the_whole_batch() -> None:
    model = build_model(TINY, seed=0)
    eval_set = EvalSet(
        torch.randint(256, (4000,), generator=torch.Generator().manual_seed(1)), 16, batch_size=8
    )
    whole = evaluate(model, eval_set, 3)
    with torch.no_grad():
        reference = sum(
            float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1), reduction="sum"))
            for x, y in eval_set.batches(3)
        ) / (3 * 8 * 16)
    assert whole == pytest.approx(reference / torch.log(torch.tensor(2.0)).item(), rel=1e-5)
    assert evaluate(model, eval_set, 3, micro_batch_size=3, vocab_chunk=100) == pytest.approx(whole, rel=1e-5)


def test_evaluation_stops_between_micro_batches() -> None:
    from swarm.learning import Interrupted

    stop = threading.Event()
    stop.set()
    eval_set = EvalSet(torch.randint(256, (4000,)), 16, batch_size=8)
    with pytest.raises(Interrupted):
        evaluate(build_model(TINY, seed=0), eval_set, 1, micro_batch_size=2, stop=stop)


# ------------------------------------------------------------------ precision


def test_auto_precision_follows_the_device() -> None:
    def bf16(_: torch.device) -> bool:
        return True

    def no_bf16(_: torch.device) -> bool:
        return False

    def card(major: int, minor: int) -> Callable[[torch.device], tuple[int, int]]:
        return lambda _: (major, minor)

    assert resolve_precision("auto", CUDA, bf16_supported=bf16) == Precision("bf16")
    ampere_less = resolve_precision("auto", CUDA, bf16_supported=no_bf16, capability=card(7, 5))
    assert ampere_less.name == "fp16" and ampere_less.uses_scaler
    # Pascal GeForce (sm_61) and Maxwell run fp16 at 1/64 rate: fp32; the P100 (sm_60) runs it fast
    for capability, name in (((6, 1), "fp32"), ((5, 2), "fp32"), ((6, 0), "fp16"), ((7, 0), "fp16")):
        chosen = resolve_precision("auto", CUDA, bf16_supported=no_bf16, capability=card(*capability))
        assert chosen.name == name, capability
    assert resolve_precision("auto", CPU) == Precision("fp32")
    assert resolve_precision("auto", CPU).autocast_dtype is None
    assert resolve_precision("auto", torch.device("mps")).name == "fp16"
    assert resolve_precision("bf16", CPU).autocast_dtype == torch.bfloat16
    assert resolve_precision("fp32", CUDA, bf16_supported=bf16).name == "fp32"
    with pytest.raises(ValueError, match=r"train\.precision"):
        resolve_precision("int4", CPU)
    with pytest.raises(ValueError, match="precision"):
        TrainSection(precision="int4")
    assert (
        load_config(None, ["train.precision=fp16"], env={}).config_hash()
        == load_config(None, [], env={}).config_hash()
    )


def test_fp16_steps_scale_the_loss_and_skip_an_overflowing_step() -> None:
    model = build_model(TINY, seed=0)
    trainer = InnerTrainer(model, TrainSection(batch_size=8, precision="fp16"), CPU, micro_batch_size=4)
    assert trainer.scaler is not None and trainer.summary()["precision"] == "fp16"
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.step(batches(1, batch_size=8), lr=1e-2)
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm < float("inf")
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # a scale that overflows fp16 gradients: the scaler skips the update and lowers the scale
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.step(batches(1, batch_size=8, seed=2), lr=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert trainer.scaler.get_scale() < 2.0**120


# ------------------------------------------------------------------ optimizer and device


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(_optimizer, "_probed", {})


def test_a_broken_bitsandbytes_falls_back_to_fused_torch_adamw(monkeypatch, fresh_probe, caplog) -> None:
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    with caplog.at_level(logging.WARNING):
        optimizer = make_inner_optimizer(build_model(TINY, seed=0), TrainSection(), CUDA)
        make_inner_optimizer(build_model(TINY, seed=0), TrainSection(), CUDA)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
    assert _optimizer.optimizer_name(optimizer) == "adamw-fused"
    assert sum("libcudart" in r.getMessage() for r in caplog.records) == 1  # warned once


def _fake_bitsandbytes(step) -> types.ModuleType:
    class AdamW8bit(torch.optim.AdamW):
        pass

    AdamW8bit.step = step  # type: ignore[method-assign]
    module = types.ModuleType("bitsandbytes")
    module.optim = types.SimpleNamespace(AdamW8bit=AdamW8bit)  # type: ignore[attr-defined]
    return module


def test_8bit_adamw_is_used_only_when_its_probe_step_runs(monkeypatch, fresh_probe) -> None:
    def crash(self, closure=None):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setitem(sys.modules, "bitsandbytes", _fake_bitsandbytes(crash))
    assert not _optimizer.adamw8bit_works(CPU)
    monkeypatch.setattr(_optimizer, "_probed", {})
    monkeypatch.setitem(sys.modules, "bitsandbytes", _fake_bitsandbytes(torch.optim.AdamW.step))
    assert _optimizer.adamw8bit_works(CPU)


def test_the_estimate_follows_the_optimizer_and_the_precision() -> None:
    config = load_config("configs/gpt-125m.yaml", env={})
    eight, full = (
        estimate_peer(config, "cuda", eight_bit=True),
        estimate_peer(config, "cuda", eight_bit=False),
    )
    assert full.inner_optimizer == 8 * full.parameters > 3 * eight.inner_optimizer
    assert full.optimizer == "AdamW" and eight.optimizer == "8-bit AdamW"
    assert eight.autocast_weights == 2 * eight.parameters  # bf16 copies under autocast
    fp32 = estimate_peer(load_config("configs/gpt-125m.yaml", ["train.precision=fp32"], env={}), "cuda")
    assert fp32.autocast_weights == 0 and estimate_peer(config, "cpu").autocast_weights == 0
    assert eight.device_memory(False) - fp32.device_memory(False) >= eight.autocast_weights
    # no served copy, no checkpoint copy in memory: the program, the page-locked batches, the shared
    # bases, and the frames or (more, here) a joiner's download of parameters and momentum
    steady = max(eight.exchange_frames, eight.joining)
    assert eight.host_memory() == eight.program + eight.pinned + eight.bases + steady
    assert 0 < eight.evaluation < eight.gradients + eight.activations  # evaluation no longer the peak
    assert eight.accumulation > 0  # batch_size > micro-batch 1: a gradient is added to the accumulated one


def test_auto_device_picks_mps_after_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto").type == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    with pytest.raises(RuntimeError, match="no MPS"):
        resolve_device("mps")


# ------------------------------------------------------------------ compile, prefetch, throughput


@pytest.mark.timeout(900)  # inductor compiles C++ kernels: minutes on a loaded 2-core machine
def test_compiled_forward_trains_like_the_eager_one() -> None:
    pytest.importorskip("torch._dynamo")
    results = []
    for compiled in (False, True):
        model = build_model(TINY, seed=0)
        trainer = InnerTrainer(model, TrainSection(batch_size=4, compile=compiled), CPU)
        try:
            results.append(trainer.step(batches(1, batch_size=4)).loss)
        except Exception as error:  # no C compiler for inductor on this machine
            pytest.skip(f"torch.compile does not run here: {type(error).__name__}")
        assert (trainer.forward_model is not model) == compiled
    assert results[1] == pytest.approx(results[0], rel=1e-4)


def test_prefetcher_hands_out_the_batches_in_order_and_gives_back() -> None:
    expected = list(batches(5))
    with Prefetcher(iter(batches(5)), depth=2) as prefetch:
        first = next(prefetch)
        prefetch.give_back()
        assert prefetch.samples_drawn == 0
        got = [b for b in itertools.islice(prefetch, 5)]
        assert prefetch.samples_drawn == 5 * 16
    assert torch.equal(first[0], expected[0][0])
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected, strict=True)
    )


def test_prefetcher_draws_ahead_a_bounded_amount_closes_and_reraises() -> None:
    drawn = []

    def endless() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in itertools.count():
            drawn.append(i)
            yield torch.zeros(1, 2), torch.zeros(1, 2)

    prefetch = Prefetcher(endless(), depth=2)
    next(prefetch)
    prefetch.close()
    assert not prefetch._thread.is_alive() and len(drawn) <= 1 + 2 + 2
    with pytest.raises(StopIteration):
        next(prefetch)

    def failing() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield torch.zeros(1, 2), torch.zeros(1, 2)
        raise ValueError("data file vanished")

    with Prefetcher(failing()) as prefetch:
        next(prefetch)
        with pytest.raises(ValueError, match="vanished"):
            next(prefetch)


def test_mfu_from_flops_per_token_and_the_peak_table() -> None:
    assert peak_flops("NVIDIA H100 PCIe", "bf16") != peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") != peak_flops("NVIDIA A10G", "bf16")
    assert peak_flops("Tesla T4", "bf16") is None and peak_flops("Tesla T4", "fp16")
    assert peak_flops("cpu", "fp32") is None and peak_flops("Some Future GPU", "bf16") is None
    model = build_model(TINY, seed=0)
    per_token = flops_per_token(count_parameters(model), TINY.n_layer, TINY.n_embd, TINY.block_size)
    assert per_token > 6 * count_parameters(model)
    throughput = Throughput(per_token, 1e12)
    throughput.record(tokens=1000, compute_seconds=0.5)
    assert throughput.mfu == pytest.approx(2000 * per_token / 1e12)
    assert Throughput(per_token, None).mfu is None


def test_the_trainer_reports_its_choices_and_throughput_on_cpu() -> None:
    trainer = InnerTrainer(build_model(TINY, seed=0), TrainSection(batch_size=4), CPU)
    trainer.step(batches(1, batch_size=4))
    summary = trainer.summary()
    assert summary["precision"] == "fp32" and summary["optimizer"] == "adamw"
    assert summary["compute_tokens_per_second"] > 0
    assert summary["mfu"] is None and summary["peak_memory_bytes"] is None  # unknown on the CPU


# ------------------------------------------------------------------ on a real GPU


@needs_cuda
def test_cuda_auto_precision_optimizer_and_figures() -> None:
    model = build_model(ModelSection(n_layer=2, n_head=4, n_embd=128, block_size=64), seed=0)
    trainer = InnerTrainer(model, TrainSection(batch_size=8), CUDA)
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert trainer.precision.name == expected
    assert trainer.optimizer_name in {"adamw8bit", "adamw-fused"}
    data = ((x.repeat(1, 4), y.repeat(1, 4)) for x, y in batches(3, 8))
    for _ in range(3):
        trainer.step(data)
    summary = trainer.summary()
    assert summary["peak_memory_bytes"] > 0 and summary["compute_tokens_per_second"] > 0


@needs_cuda
def test_cuda_oom_in_a_step_halves_and_recovers() -> None:
    model = build_model(ModelSection(n_layer=2, n_head=4, n_embd=128, block_size=64), seed=0)
    trainer = InnerTrainer(
        OutOfMemoryAbove(model, limit=2), TrainSection(batch_size=8), CUDA, micro_batch_size=8
    )
    data = ((x.repeat(1, 4), y.repeat(1, 4)) for x, y in batches(1, 8))
    stats = trainer.step(data)
    assert trainer.micro_batch_size == 2 and stats.samples == 8


@needs_cuda
def test_cuda_evaluation_peak_stays_below_the_training_one() -> None:
    model = build_model(
        ModelSection(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=32000), seed=0
    )
    trainer = InnerTrainer(model, TrainSection(batch_size=8), CUDA, micro_batch_size=4)
    data = ((x.repeat(1, 4), y.repeat(1, 4)) for x, y in batches(1, 8))
    torch.cuda.reset_peak_memory_stats()
    trainer.step(data)
    training = torch.cuda.max_memory_allocated()
    trainer.free_gradients()
    torch.cuda.reset_peak_memory_stats()
    evaluate(model, EvalSet(torch.randint(32000, (20000,)), 64), 1, micro_batch_size=4)
    assert torch.cuda.max_memory_allocated() < training


def test_the_config_headers_state_what_config_check_estimates() -> None:
    """Both headers state the card's footprint (slack and context counted) and the host memory with
    everything counted."""
    from swarm.learning.estimate import format_bytes

    for name, footprint in (("llama-1b", True), ("gpt-125m", True)):
        path = f"configs/{name}.yaml"
        lines = Path(path).read_text().splitlines()
        header = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
        config = load_config(path, env={})
        e = estimate_peer(config, "cuda", eight_bit=True)
        checkpointing = config.train.activation_checkpointing
        for host_state in (False, True):
            device = (e.device_footprint if footprint else e.device_memory)(
                checkpointing, host_state=host_state
            )
            assert format_bytes(device) in header, name
        host = e.host_memory(host_state=True) if footprint else e.exchange_frames + e.outer
        assert format_bytes(host) in header, name


def test_an_mps_peer_describes_its_device(monkeypatch) -> None:
    from swarm._device import describe_device

    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 24 * 2**30)
    assert describe_device("mps") == ("Apple MPS", 24.0)
    assert describe_device("cpu") == ("cpu", 0.0)


def test_the_sync_line_shows_throughput_before_drift() -> None:
    from peers._trainer_output import format_sync_line
    from swarm.trainer import SyncReport

    report = SyncReport(
        round=1, step=10, loss=3.0, eval_loss=3.1, samples_per_s=12.0, outcome="ok", partner=None,
        bytes_sent=0, bytes_received=0, drift=0.01, lr=1e-3, weight=1.0,
    )  # fmt: skip
    assert "tok/s" not in format_sync_line(report)
    shown = format_sync_line(
        dataclasses.replace(report, tokens_per_s=12288.0, mfu=0.412, peak_memory_bytes=3 << 30)
    )
    assert " 12288 tok/s mfu 41.2% mem 3.00 GiB drift 0.0100" in shown
    unknown = format_sync_line(dataclasses.replace(report, tokens_per_s=100.0))
    assert " 100 tok/s mfu - mem - GiB drift" in unknown and unknown.split()[-2] == "drift"


def test_the_micro_batch_leaves_room_for_exchanges_only_when_they_run_on_the_device(monkeypatch) -> None:
    from swarm.learning import estimate

    config = load_config("configs/local-tiny.yaml", env={})
    assert estimate.exchange_reserve_bytes(config, CPU) == 0
    monkeypatch.setattr(estimate, "adamw8bit_works", lambda device: False)
    monkeypatch.setattr(estimate, "outer_state_on_host", lambda config, device: True)
    assert estimate.exchange_reserve_bytes(config, CUDA) == 0
    monkeypatch.setattr(estimate, "outer_state_on_host", lambda config, device: False)
    assert estimate.exchange_reserve_bytes(config, CUDA) == estimate_peer(config, "cuda").exchange_buffers > 0
