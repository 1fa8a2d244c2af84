# SPDX-License-Identifier: Apache-2.0
"""Chat messages through the tokenizer's chat template (transformers'
`apply_chat_template`, which renders it with jinja2), with the client's
`chat_template_kwargs` checked first and every rendering failure a 400.

A kwarg is accepted only when the template reads it: its name is one of the template's
undeclared variables (`jinja2.meta.find_undeclared_variables` on the parsed template,
cached per template), and it is not one the server sets itself: an argument of
`apply_chat_template` (`tokenize`, `add_generation_prompt`, `tools`, `chat_template`, ...),
the conversation (`messages`), a special token (`bos_token`, ...) or a global of the
template environment (`raise_exception`, `range`, ...). Values are JSON of bounded size.
Rendering runs in the caller's worker thread, never on the event loop; its input is bounded
by the body-size cap and its output by the prompt-length check that follows it.
"""

from __future__ import annotations

import inspect
import json
import logging
from functools import lru_cache

from jinja2 import meta
from jinja2.exceptions import TemplateError

from runtime.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_KWARGS = 32
MAX_VALUE_CHARS = 4096  # one value, as compact JSON
MAX_VALUE_DEPTH = 8  # nesting of lists and objects in one value


class ChatTemplateError(InvalidRequestError):
    """A 400 whose message quotes the template or the client's keys verbatim (the OpenAI
    routes' renaming of SGLang field names must not touch it)."""


# What `render_jinja_template` passes to the template under its own name besides the
# arguments of `apply_chat_template` (read from its signature below).
_RENDERER_NAMES = frozenset({"messages", "conversation", "conversations", "tools", "documents"})


@lru_cache(maxsize=16)
def _compiled(template: str):
    # transformers' own environment (its `generation` tag, globals and sandbox), so the
    # variables found here are those of the template that renders.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables `template` reads from its context (its undeclared variables)."""
    environment = _compiled(template).environment
    return frozenset(meta.find_undeclared_variables(environment.parse(template)))


def reserved_names(tokenizer, template: str) -> frozenset[str]:
    """Names a client may not set: the server's arguments, special tokens, globals."""
    parameters = inspect.signature(type(tokenizer).apply_chat_template).parameters
    own = {
        name
        for name, p in parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    special = set(getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", ()))
    special |= set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset(own | _RENDERER_NAMES | special | set(_compiled(template).environment.globals))


def _json_depth(value) -> int:
    depth, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        depth = max(depth, level)
        if level > MAX_VALUE_DEPTH:
            break
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return depth


def _check_value(value, param: str) -> None:
    if _json_depth(value) > MAX_VALUE_DEPTH:
        raise ChatTemplateError(
            f"'{param}' is nested more than {MAX_VALUE_DEPTH} levels deep", param=param
        )
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_VALUE_CHARS:
        raise ChatTemplateError(
            f"'{param}' is {size} characters as JSON; at most {MAX_VALUE_CHARS} are allowed",
            param=param,
        )


def check_template_kwargs(kwargs: dict | None, tokenizer, template: str) -> dict:
    """`kwargs` when every key is a variable `template` reads and no reserved name, every
    value bounded JSON; else a 400 naming `chat_template_kwargs.<key>`."""
    if not kwargs:
        return {}
    if len(kwargs) > MAX_KWARGS:
        raise ChatTemplateError(
            f"'chat_template_kwargs' has {len(kwargs)} keys; at most {MAX_KWARGS} are allowed",
            param="chat_template_kwargs",
        )
    reserved = reserved_names(tokenizer, template)
    declared = _variables_or_400(template)
    for key, value in kwargs.items():
        param = f"chat_template_kwargs.{key}"
        if key in reserved:
            raise ChatTemplateError(
                f"'{param}' is set by the server and cannot be passed to the chat template",
                param=param,
            )
        if key not in declared:
            readable = sorted(declared - reserved)
            raise ChatTemplateError(
                f"'{param}' is not a variable of this model's chat template "
                f"(it reads {readable or 'none'})",
                param=param,
            )
        _check_value(value, param)
    return kwargs


def _variables_or_400(template: str) -> frozenset[str]:
    try:
        return template_variables(template)
    except TemplateError as err:
        raise ChatTemplateError(f"the chat template cannot be parsed: {err}") from None


def render_chat(tokenizer, messages: list[dict], kwargs: dict | None) -> str:
    """The messages as the template renders them, ending with the assistant's turn. A
    template that fails (`raise_exception`, an undefined value used, a type error) is a
    400 with its message, naming the first message whose addition makes it fail, or
    `chat_template_kwargs` when it renders without them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model's tokenizer has no chat template; use /v1/completions")
    try:
        template = tokenizer.get_chat_template()
    except ValueError as err:  # named templates without a default one
        raise ChatTemplateError(f"this model's chat template cannot be chosen: {err}") from None
    kwargs = check_template_kwargs(kwargs, tokenizer, template)
    rendered = _try_render(tokenizer, messages, kwargs)
    if isinstance(rendered, str):
        return rendered
    error = rendered
    text = str(error) if isinstance(error, TemplateError) else f"{type(error).__name__}: {error}"
    param = _culprit(tokenizer, messages, kwargs, str(error))
    raise ChatTemplateError(f"the chat template refused the request: {text}", param=param)


def _try_render(tokenizer, messages: list[dict], kwargs: dict) -> str | Exception:
    """The rendered text, or the exception rendering raised."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as err:  # noqa: BLE001 - any failure of the (data-driven) template is the request's
        logger.debug("chat template failed", exc_info=err)
        return err


def _culprit(tokenizer, messages: list[dict], kwargs: dict, message: str) -> str:
    """`messages[k]` for the shortest prefix that fails with the same message (binary
    search: log2 of the message count renders), else `chat_template_kwargs` or
    `messages`."""

    def fails(upto: int, with_kwargs: dict) -> bool:
        error = _try_render(tokenizer, messages[:upto], with_kwargs)
        return not isinstance(error, str) and str(error) == message

    if kwargs and not isinstance(_try_render(tokenizer, messages, {}), Exception):
        return "chat_template_kwargs"
    low, high = 1, len(messages)  # messages[:high] fails
    while low < high:
        mid = (low + high) // 2
        if fails(mid, kwargs):
            high = mid
        else:
            low = mid + 1
    return f"messages[{high - 1}]" if fails(high, kwargs) else "messages"
