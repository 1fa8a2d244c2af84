# SPDX-License-Identifier: Apache-2.0
"""The fields of SGLang's `/generate` request (`GenerateReqInput` in SGLang's
`managers/io_struct.py`) and what this server does with each.

sglang-router and SGLang's own clients send the whole schema filled in with defaults, so
every field is accepted at its default value (null, false, 0, empty); a field this server
does not implement is refused with a 400 naming it only when it carries something else.
Routing and bookkeeping hints that cannot change a result are accepted with any value.
"""

from __future__ import annotations

from runtime.core.errors import InvalidRequestError

# Parsed by `native_api.parse_generate`.
SUPPORTED = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "stream",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_text_in_logprobs",
    }
)

# Hints for routing, metrics, logging and caching: no effect on what a request returns.
HINTS = frozenset(
    {
        "log_metrics",
        "custom_labels",
        "priority",
        "routing_key",
        "conversation_id",
        "extra_key",
        "cache_salt",
        "received_time",
        "external_trace_header",
        "no_logs",
        "session_id",
        "data_parallel_rank",
        "routed_dp_rank",
        "http_worker_ipc",
        "model",  # sglang-router forwards its model id (null with one model) for routing
    }
)

# Implemented nowhere here: accepted only at SGLang's default ("unset").
UNSUPPORTED = frozenset(
    {
        "input_embeds",
        "image_data",
        "video_data",
        "audio_data",
        "mm_hashes",
        "mm_content_hashes",
        "use_audio_in_video",
        "video_config",
        "watermark",
        "return_sampling_mask",
        "sampling_logprobs_mode",
        "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
        "return_hidden_states",
        "return_routed_experts",
        "routed_experts_start_len",
        "return_indexer_topk",
        "modalities",
        "session_params",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "positional_embed_overrides",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "disagg_prefill_dp_rank",
        "background",
        "require_reasoning",
        "max_thinking_tokens",
        "return_bytes",
        "return_entropy",
        "return_prompt_token_ids",
        "need_wait_for_mm_inputs",
        "num_items_assigned",
        "encoder_urls",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "image_max_dynamic_patch",
        "video_max_dynamic_patch",
        "images_config",
        "mm_processor_kwargs",
        "multi_item_delimiter_indices",
        "token_indices_to_pool",
        "kv_hints",
    }
)


def is_unset(value) -> bool:
    """SGLang's defaults for the unsupported fields: null, false, 0 or empty."""
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value == 0
    if isinstance(value, str | list | dict):
        return len(value) == 0 or (
            isinstance(value, list) and all(is_unset(v) for v in value)  # one per prompt
        )
    return False


def check_fields(body: dict) -> None:
    """400 for a field SGLang does not know, or an unsupported one that is set."""
    unknown = sorted(set(body) - SUPPORTED - HINTS - UNSUPPORTED)
    if unknown:
        raise InvalidRequestError(
            f"unknown field(s) {unknown} in the /generate request", param=unknown[0]
        )
    for name in sorted(UNSUPPORTED & set(body)):
        if not is_unset(body[name]):
            raise InvalidRequestError(
                f"'{name}' is not supported by this server (send it unset: null, false or empty)",
                param=name,
            )
