"""Getting the model out of a run: export it as a ``transformers`` model, load it back, sample text.

* :func:`model_from_checkpoint` rebuilds a trainer's model from one of its verified checkpoints, with
  the run config the checkpoint carries (or a given one, refused unless it has the checkpoint's hash);
* :func:`download_model` takes the live swarm's state over the verified state download, as a joiner;
* :func:`export_model` writes a ``transformers`` model directory, atomically: the built-in GPT as the
  GPT-2 it is (same architecture, exact weights), an hf model with ``save_pretrained``, each with its
  tokenizer, so ``AutoModelForCausalLM.from_pretrained`` and ``pipeline("text-generation")`` load it;
* :func:`load_exported` loads an exported directory back (also the older private layout);
* :func:`generate` samples bytes from the byte-level GPT.

See docs/export.md.
"""

from swarm.export._files import (
    MODEL_FILE,
    SWARM_FILE,
    ExportedModel,
    ExportError,
    export_model,
    load_exported,
    model_from_checkpoint,
)
from swarm.export._generate import generate
from swarm.export._live import download_model

__all__ = [
    "MODEL_FILE",
    "SWARM_FILE",
    "ExportError",
    "ExportedModel",
    "download_model",
    "export_model",
    "generate",
    "load_exported",
    "model_from_checkpoint",
]
