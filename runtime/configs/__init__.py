# SPDX-License-Identifier: Apache-2.0
"""Model configuration read from a checkpoint directory."""

from runtime.configs.model_config import ModelConfig, resolve_dtype

__all__ = ["ModelConfig", "resolve_dtype"]
