"""The export folder: a trained model in a form that evaluation, generation and other libraries read.

    OUT/
      config.json          the architecture in the authors' argument names, our settings, the tokenizer identity
      model.safetensors    the weights; each tied tensor once
      tokenizer/           (optional) the tokenizer's files and its tokenizer.json, copied unchanged
      training.json        (optional) where the weights come from: step, tokens seen, evaluation results
      checksums.json       every file above with its size and CRC-32, written last (as a checkpoint's COMPLETE.json)

One module per file: `config_file` (config.json), `weights` (model.safetensors and its ties), `tokenizer_files`
(tokenizer/), `checksums` (checksums.json and verification); `folder` writes and loads the whole folder. The
names below are the public ones.

Layer 5 (docs/architecture.md, Layers): may import layers 1-5; today checkpoints (its verification), model,
tokenizer, config and the bottom layer, nothing of training. Never convert, downstream or the launchers.
"""

from txl_dist.export.checksums import (
    CHECKSUMS_FILE,
    ExportVerificationError,
    require_verified_export,
    verify_export,
)
from txl_dist.export.config_file import (
    AUTHORS_FIELDS,
    CONFIG_FILE,
    EVAL_SETTINGS,
    EXTRA_FIELDS,
    apply_eval_overrides,
    config_from_json,
    config_to_json,
    read_config_file,
    read_export_config,
    require_export_folder,
)
from txl_dist.export.folder import (
    TRAINING_FILE,
    load_model,
    load_pretrained,
    model_from_state_dict,
    write_export,
)
from txl_dist.export.tokenizer_files import TOKENIZER_DIR, load_export_tokenizer
from txl_dist.export.weights import WEIGHTS_FILE, require_finite, unique_weights

__all__ = [
    "AUTHORS_FIELDS",
    "CHECKSUMS_FILE",
    "CONFIG_FILE",
    "EVAL_SETTINGS",
    "EXTRA_FIELDS",
    "TOKENIZER_DIR",
    "TRAINING_FILE",
    "WEIGHTS_FILE",
    "ExportVerificationError",
    "apply_eval_overrides",
    "config_from_json",
    "config_to_json",
    "load_export_tokenizer",
    "load_model",
    "load_pretrained",
    "model_from_state_dict",
    "read_config_file",
    "read_export_config",
    "require_export_folder",
    "require_finite",
    "require_verified_export",
    "unique_weights",
    "verify_export",
    "write_export",
]
