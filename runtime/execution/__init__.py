# SPDX-License-Identifier: Apache-2.0
"""Turning a scheduled batch into one model forward: modes, context, runner, sampler."""
