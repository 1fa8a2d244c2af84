# SPDX-License-Identifier: Apache-2.0
"""Attention implementations per model family (math + per-forward cache addressing)."""
