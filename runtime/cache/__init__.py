# SPDX-License-Identifier: Apache-2.0
"""Request slots, token slots and the typed cache pools every attention kind owns.

Capacity is fixed when the pools are built; running out is reported to the caller
(which retracts requests), never an exception in the middle of a forward.
"""

from runtime.cache.allocator import PagedTokenAllocator
from runtime.cache.req_to_token_pool import ReqToTokenPool
from runtime.cache.slot_table import SlotTable

__all__ = ["PagedTokenAllocator", "ReqToTokenPool", "SlotTable"]
