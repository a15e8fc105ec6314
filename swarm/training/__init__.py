"""Training components: model, data, the inner loop and the outer (DiLoCo) step. See docs/training.md."""

from swarm.training._prepare import prepare_tokens
from swarm.training.data import (
    Corpus,
    HFStreamSource,
    TokenFile,
    TokenFileError,
    TrainBatches,
    open_source,
    stdlib_files,
)
from swarm.training.evaluation import (
    EvalSet,
    Interrupted,
    evaluate,
    make_eval_set,
    nats_to_bits,
    unigram_bits,
)
from swarm.training.inner import (
    InnerTrainer,
    StepStats,
    auto_micro_batch_size,
    lr_at,
    make_inner_optimizer,
    resolve_device,
    total_samples_of,
)
from swarm.training.model import GPT, build_model, count_parameters, lm_loss
from swarm.training.outer import OuterOptimizer, all_finite, drift

__all__ = [
    "GPT",
    "Corpus",
    "EvalSet",
    "HFStreamSource",
    "InnerTrainer",
    "Interrupted",
    "OuterOptimizer",
    "StepStats",
    "TokenFile",
    "TokenFileError",
    "TrainBatches",
    "all_finite",
    "auto_micro_batch_size",
    "build_model",
    "count_parameters",
    "drift",
    "evaluate",
    "lm_loss",
    "lr_at",
    "make_eval_set",
    "make_inner_optimizer",
    "nats_to_bits",
    "open_source",
    "prepare_tokens",
    "resolve_device",
    "stdlib_files",
    "total_samples_of",
    "unigram_bits",
]
