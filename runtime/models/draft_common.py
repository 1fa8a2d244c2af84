# SPDX-License-Identifier: Apache-2.0
"""What every MTP draft model shares: the target's embedding and LM head."""

from __future__ import annotations

import torch


class SharesTargetEmbedHead:
    """Mixin for draft models with `model.embed_tokens` and `lm_head` the target provides."""

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Point at the target's tensors (no copy); the draft's own are dropped."""
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head
