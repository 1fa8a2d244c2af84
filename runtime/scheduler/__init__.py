# SPDX-License-Identifier: Apache-2.0
"""Requests and the step loop that batches them. Never touches model tensors."""
