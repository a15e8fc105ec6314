"""How a model learns on one device: model, data, the inner loop, evaluation and the outer (DiLoCo) step.

The peer that trains in the swarm with these is :mod:`swarm.trainer`. See docs/training.md."""

from swarm.learning._micro_batch import OutOfDeviceMemory, auto_micro_batch_size, is_oom, release_cached
from swarm.learning._optimizer import (
    adamw8bit_works,
    bitsandbytes_installed,
    can_load_state,
    make_inner_optimizer,
    optimizer_name,
    optimizer_state_bytes,
    state_kind,
)
from swarm.learning._precision import Precision, half_dtype, resolve_precision
from swarm.learning._prefetch import Prefetcher
from swarm.learning._prepare import prepare_tokens
from swarm.learning._throughput import PEAK_TFLOPS, Throughput, flops_per_token, peak_flops, peak_memory_bytes
from swarm.learning.data import (
    Corpus,
    HFStreamSource,
    TokenFile,
    TokenFileError,
    TrainBatches,
    open_source,
    stdlib_files,
)
from swarm.learning.evaluation import (
    EvalSet,
    Interrupted,
    chunked_cross_entropy,
    evaluate,
    evaluate_fitting,
    make_eval_set,
    nats_to_bits,
    unigram_bits,
)
from swarm.learning.inner import (
    InnerTrainer,
    StepStats,
    lr_at,
    resolve_device,
    total_samples_of,
)
from swarm.learning.model import GPT, build_model, count_parameters, lm_loss
from swarm.learning.outer import OuterOptimizer, all_finite, drift

__all__ = [
    "GPT",
    "PEAK_TFLOPS",
    "Corpus",
    "EvalSet",
    "HFStreamSource",
    "InnerTrainer",
    "Interrupted",
    "OutOfDeviceMemory",
    "OuterOptimizer",
    "Precision",
    "Prefetcher",
    "StepStats",
    "Throughput",
    "TokenFile",
    "TokenFileError",
    "TrainBatches",
    "adamw8bit_works",
    "all_finite",
    "auto_micro_batch_size",
    "bitsandbytes_installed",
    "build_model",
    "can_load_state",
    "chunked_cross_entropy",
    "count_parameters",
    "drift",
    "evaluate",
    "evaluate_fitting",
    "flops_per_token",
    "half_dtype",
    "is_oom",
    "lm_loss",
    "lr_at",
    "make_eval_set",
    "make_inner_optimizer",
    "nats_to_bits",
    "open_source",
    "optimizer_name",
    "optimizer_state_bytes",
    "peak_flops",
    "peak_memory_bytes",
    "prepare_tokens",
    "release_cached",
    "resolve_device",
    "resolve_precision",
    "state_kind",
    "stdlib_files",
    "total_samples_of",
    "unigram_bits",
]
