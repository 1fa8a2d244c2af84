# SPDX-License-Identifier: Apache-2.0
"""HTTP server: SGLang-native and OpenAI-compatible routes over an `AsyncEngine`."""
