# SPDX-License-Identifier: Apache-2.0
"""The tiny-model trainer behind `python -m scripts.train_tiny_model`, one module per stage:
`corpus` (the standard library, its train / held-out split and the BPE tokenizer),
`families` (one module per model family: training-form model, released checkpoint names,
router balancing, model-card lines), `loop` (losses, optimiser, schedule, the training loop),
`export` (the checkpoint directory), `evaluation` (held-out losses, the runtime's NEXTN
speed and acceptance, transformers parity) and `model_card` (the checkpoint's README)."""
